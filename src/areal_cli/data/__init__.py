"""Data: the built-in task (``builtin``), the built-in tiny model (``builtin_model``), local datasets
(``datasets``), a resumable loader (``loader``) and sequence packing (``packing``).

Nothing is imported here on purpose: the CLI imports submodules it needs without pulling in
``datasets``/``transformers``.
"""
