"""The Megatron engine (megatron-core 0.16.1): :mod:`.engine` (``MegatronEngine``), the CPU shim
(:mod:`.compat`), the GPTModel builder (:mod:`.model`), the HF <-> mcore weight converter (:mod:`.convert`)
and routing replay (:mod:`.routing`).

Import-light on purpose: nothing here imports torch or megatron-core at package import, so the CLI never
pays for (or depends on) megatron-core; the registry names ``engine:MegatronEngine`` by import path.
"""

# Said by the validator (which must not import torch) and by the engine.
FULL_RECOMPUTE = ("routing replay does not run with engine.megatron.recompute_granularity=full (mcore "
                  "recomputes the router in the backward pass, after later micro-batches set their routing)")
