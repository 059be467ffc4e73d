"""Memory per component for ``areal plan``: the validator's estimates (``allocation/estimate.py``) turned into
what one process holds resident, and what binds first.

The validator already estimates a trainer's weights, gradients, optimizer states and activations and a
server's weights and KV budget. A plan needs three more things: the whole trainer process (a KL reference
model and a critic live in the same process as the actor), the KV cache the configured concurrency really
fills (the built-in hf server allocates on demand; SGLang and vLLM reserve a fixed fraction up front), and
the process's fixed base (CUDA context or, on CPU, the interpreter with torch imported), so the total can
be compared with a measured peak RSS.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from areal_cli.allocation.estimate import GiB, ModelFacts, dtype_bytes, server_mem_fraction

if TYPE_CHECKING:
    from areal_cli.config.schema import ExperimentConfig

# Parts named in ``binds``, in the words the tables print.
PART_NAMES = {"weights_gb": "weights", "grads_gb": "gradients", "optim_gb": "optimizer states",
              "activations_gb": "activations", "kv_cache_gb": "KV cache", "process_gb": "process",
              "buffers_gb": "buffers (fused weights, push staging, prefix cache)"}


@dataclass
class ComponentMemory:
    weights_gb: float
    grads_gb: float
    optim_gb: float
    activations_gb: float
    kv_cache_gb: float
    process_gb: float  # one process (trainer rank / server instance per device), base included
    total_gb: float  # on one device: what the process holds there (a reserving server: its reservation)
    device_gb: float
    binds: str  # what runs out first, one phrase
    fits: bool
    kv_tokens: int = 0  # servers: tokens of KV cache that fit per instance
    concurrency: int = 0  # servers: sequences running at once per instance (after the KV limit)
    # The process at the workload's mean lengths (a trainer's micro-batches packed with sequences of the
    # mean length, not at the caps): what a typical step's peak is. ``process_gb`` is the bound.
    expected_gb: float = 0.0
    # Buffers beyond the model's states and KV: the hf server's fused weight copy (CPU fast path), its
    # weight-push staging slots and its prefix cache.
    buffers_gb: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def _largest(parts: dict[str, float]) -> str:
    key = max(parts, key=lambda k: parts[k])
    total = sum(parts.values()) or 1.0
    return f"{PART_NAMES[key]} ({parts[key] / total:.0%} of the estimate)"


def trainer_memory(cfg: ExperimentConfig, part, facts: ModelFacts, base_gb: float,
                   mean_mb_tokens: float | None = None) -> ComponentMemory:
    """One trainer rank of ``part`` (a validated TrainPart): the actor's states from the validator, plus a
    KL reference's weights (``algo.kl_coef > 0`` without LoRA: a second, frozen engine), a distillation
    teacher's (``algo.distill``, scaled by its size), a reward model's (``workflow.reward_model``, likewise) and
    a critic's
    weights, gradients and optimizer states (``algo.use_critic``) in the same process.

    The validator sizes activations for a micro-batch of sequences at their length caps (the bound a run
    must fit). ``mean_mb_tokens``, the tokens a micro-batch really packs at the mean lengths, scales them
    (activations are linear in tokens) for ``expected_gb``."""
    m = part.memory
    cw, cg, co = part.companions
    weights, grads, optim = m.weights_gb + cw, m.grads_gb + cg, m.optim_gb + co
    parts = {"weights_gb": weights, "grads_gb": grads, "optim_gb": optim, "activations_gb": m.activations_gb}
    states = sum(parts.values())
    total = states + base_gb
    fits = total <= m.device_gb
    if fits:
        binds = f"{_largest(parts)}; {m.device_gb - total:.1f} GB free"
    else:
        binds = (f"over the device's {m.device_gb:.1f} GB by {total - m.device_gb:.1f} GB; "
                 f"largest: {_largest(parts)}")
    cap = max(1, part.micro_batch.tokens_per_mb)
    share = min(1.0, mean_mb_tokens / cap) if mean_mb_tokens else 1.0
    expected = total - m.activations_gb * (1.0 - share)
    return ComponentMemory(weights, grads, optim, m.activations_gb, 0.0, total, total, m.device_gb, binds, fits,
                           expected_gb=expected)


# The hf server's KV slabs start this long and double (in multiples of 16 tokens) to hold the longest row
# (inference/server/fastpath.py: FastRunner._ensure); rows start at 8.
_SLAB_MIN_LEN, _SLAB_MIN_ROWS = 64, 8
# A distributed weight push to the hf server stages buckets of at most this many bytes in two slots
# (api/io_struct.py: WeightUpdateMeta.bucket_bytes; inference/server/weights.py: DistributedReceiver).
_PUSH_BUCKET_BYTES = 256 * 1024 ** 2


def _slab_len(max_seq: int) -> int:
    n = _SLAB_MIN_LEN
    while n < max_seq:
        n *= 2
    return -(-n // 16) * 16


# The hf server's prefix cache at ``--prefix-cache-tokens -1`` (inference/server/prefix_cache.py auto_budget).
_PREFIX_CACHE_MIB, _PREFIX_CACHE_MAX_TOKENS = 512, 1 << 16


def prefix_cache_budget(cfg: ExperimentConfig) -> int:
    """Tokens the hf server's prefix cache may hold in this run: what the launcher passes
    (``inference/launch.py:prefix_cache_tokens``), or the user's own ``--prefix-cache-tokens`` in
    ``launcher.server_args`` (the last one wins, as on the command line); -1 is auto."""
    from areal_cli.inference.launch import prefix_cache_tokens

    from areal_cli.errors import ConfigError

    value = prefix_cache_tokens(cfg.workflow.name)
    args = [str(a) for a in cfg.launcher.server_args]
    for i, a in enumerate(args):
        raw = args[i + 1] if a == "--prefix-cache-tokens" and i + 1 < len(args) else (
            a.split("=", 1)[1] if a.startswith("--prefix-cache-tokens=") else None)
        if raw is None:
            continue
        try:
            value = int(raw)
        except ValueError:
            raise ConfigError("launcher.server_args", f"--prefix-cache-tokens {raw!r} is not a token count",
                              "give an integer: 0 turns the cache off, -1 is automatic") from None
    return value


def hf_server_extras(cfg: ExperimentConfig, facts: ModelFacts, push_mode: str | None,
                     cached_tokens: float = 0.0) -> tuple[float, float, float]:
    """Bytes the built-in server holds beyond the HF model and its KV, on CPU: the fast decode path's fused,
    pre-transposed copy of every layer's projections (a dense model on CPU: inference/server/engine.py
    ``_make_runner``), two staging slots of one bucket each when weights arrive by broadcast, and its
    prefix cache filled with ``cached_tokens`` (what one weight version stores: it is dropped on every
    update) up to its budget. (fused, staging, cache)."""
    cpu = cfg.cluster.device != "cuda"
    pb = 4 if cpu else 2
    emb = facts.vocab * facts.hidden * (1 if facts.tied else 2)
    fast = cpu and facts.experts == 0
    fused = (facts.total_params() - emb) * pb if fast else 0.0
    model_bytes = facts.total_params() * pb
    staging = 2 * min(_PUSH_BUCKET_BYTES, model_bytes) if push_mode == "distributed" else 0.0
    cache = 0.0
    budget = prefix_cache_budget(cfg) if fast else 0
    if budget != 0:
        per_token = facts.kv_bytes_per_token(pb)
        if budget < 0:
            budget = min(_PREFIX_CACHE_MAX_TOKENS, _PREFIX_CACHE_MIB * 1024 ** 2 // max(1, int(per_token)))
        cache = min(float(budget), cached_tokens) * per_token
    return float(fused), float(staging), float(cache)


def server_memory(cfg: ExperimentConfig, part, facts: ModelFacts, concurrency: int, seq_tokens: int,
                  base_gb: float, *, max_seq_tokens: int | None = None,
                  push_mode: str | None = None, cached_tokens: float = 0.0) -> ComponentMemory:
    """One device of a server instance of ``part`` (a validated InferencePart) running ``concurrency``
    sequences of ``seq_tokens`` tokens (the mean; ``max_seq_tokens``: the longest one). SGLang/vLLM hold
    their reserved fraction whatever the load; the hf server holds what it uses: on the CPU fast path,
    KV slabs of the longest row's doubled length for every running row, its fused weight copy, and
    the staging of a distributed push (``push_mode``)."""
    m = part.memory
    pb = 2 if cfg.cluster.device == "cuda" else 4
    per_token = facts.kv_bytes_per_token(pb, part.tp, part.pp)
    from areal_cli.inference.backends import backend_spec

    reserving = backend_spec(part.backend).reserves_memory  # else: on demand, as the hf server
    fused, staging, cache = hf_server_extras(cfg, facts, push_mode, cached_tokens) if not reserving else (0.0,) * 3
    staging += cache  # the buffers column: fused copy, push staging and prefix cache
    kv_tokens = m.kv_tokens if reserving else int(max(0.0, m.device_gb - m.weights_gb - base_gb) * GiB
                                                   // max(per_token, 1))
    fit_seqs = kv_tokens // max(1, seq_tokens)
    conc = max(1, min(concurrency, fit_seqs)) if fit_seqs > 0 else 0
    if fused:  # the fast path's slabs: every row at the capacity the longest row needs
        kv_gb = max(conc, _SLAB_MIN_ROWS) * _slab_len(max_seq_tokens or seq_tokens) * per_token / GiB
    else:
        kv_gb = conc * seq_tokens * per_token / GiB
    # Decode's working set: hidden states and fp32 logits of the running batch (prefill's are chunked).
    act_gb = conc * (8 * facts.hidden + facts.vocab) * 4 / GiB
    used = m.weights_gb + kv_gb + act_gb + (fused + staging) / GiB
    total = max(used, m.device_gb * server_mem_fraction(part.backend)) if reserving else used
    process = total + base_gb
    if m.weights_gb + base_gb > m.device_gb:
        binds, fits = f"weights: {m.weights_gb:.1f} GB per device exceed the device's {m.device_gb:.1f} GB", False
    elif conc < concurrency:
        binds = (f"KV cache: {kv_tokens} tokens hold {conc} of the {concurrency} concurrent sequences per "
                 "instance")
        fits = conc > 0
    elif reserving:
        binds = f"KV cache: room for {fit_seqs} sequences of {seq_tokens} tokens, {conc} run at once"
        fits = True
    else:
        parts = {"weights_gb": m.weights_gb, "kv_cache_gb": kv_gb, "activations_gb": act_gb,
                 "buffers_gb": (fused + staging) / GiB}
        binds = (f"{_largest(parts)}; "
                 f"{m.device_gb - process:.1f} GB free")
        fits = process <= m.device_gb
    return ComponentMemory(m.weights_gb, 0.0, 0.0, act_gb, kv_gb, process, process, m.device_gb, binds, fits,
                           kv_tokens=int(kv_tokens), concurrency=int(conc), expected_gb=process,
                           buffers_gb=(fused + staging) / GiB)


def weight_bytes(facts: ModelFacts, dtype: str) -> float:
    """Bytes of the full model in ``dtype`` (what a weight push moves; LoRA: the adapter only)."""
    n = facts.lora_params() if facts.lora_rank > 0 else facts.total_params()
    return float(n) * dtype_bytes(dtype)
