"""Groundwork for the Megatron engine (megatron-core 0.16.1): the CPU shim (:mod:`.compat`), the GPTModel
builder (:mod:`.model`) and the HF <-> mcore weight converter (:mod:`.convert`).

Import-light on purpose: nothing here imports torch or megatron-core at package import, so the CLI never
pays for (or depends on) megatron-core. The engine class itself is not written yet: ``engine=megatron``
is validated and refused by the registry (its ``target`` is None).
"""
