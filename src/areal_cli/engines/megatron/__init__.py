"""The Megatron engine (megatron-core 0.16.1): :mod:`.engine` (``MegatronEngine``), the CPU shim (:mod:`.compat`),
the GPTModel builder (:mod:`.model`) and the HF <-> mcore weight converter (:mod:`.convert`).

Import-light on purpose: nothing here imports torch or megatron-core at package import, so the CLI never
pays for (or depends on) megatron-core; the registry names ``engine:MegatronEngine`` by import path.
"""
