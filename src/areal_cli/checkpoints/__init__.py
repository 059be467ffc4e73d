"""A run's checkpoints after the fact, from the run dir alone: finding one (``locate.py``: a RUN or a
CKPT argument), evaluating it on the held-out split (``evaluate.py``: ``areal eval``) and exporting it as
a plain HF (or peft adapter) directory (``export.py``: ``areal export``). The trainer writes them
(``trainer/checkpoint.py``); nothing here needs the run's processes, its launcher or a GPU."""
