"""Weight sync from trainers to inference servers.

- :mod:`.senders`: trainer side (disk: versioned safetensors dirs; distributed: bucketed broadcast).
- :mod:`.hf_io`: writing HF-layout dirs (shared with the engines' HF export).
"""
