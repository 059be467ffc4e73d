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

from areal_cli.allocation.estimate import SERVER_MEM_FRACTION, GiB, ModelFacts, companion_states, dtype_bytes

# Parts named in ``binds``, in the words the tables print.
PART_NAMES = {"weights_gb": "weights", "grads_gb": "gradients", "optim_gb": "optimizer states",
              "activations_gb": "activations", "kv_cache_gb": "KV cache", "process_gb": "process"}


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

    def to_dict(self) -> dict:
        return asdict(self)


def _largest(parts: dict[str, float]) -> str:
    key = max(parts, key=lambda k: parts[k])
    total = sum(parts.values()) or 1.0
    return f"{PART_NAMES[key]} ({parts[key] / total:.0%} of the estimate)"


def trainer_memory(cfg, part, facts: ModelFacts, base_gb: float) -> ComponentMemory:
    """One trainer rank of ``part`` (a validated TrainPart): the actor's states from the validator, plus a
    KL reference's weights (``algo.kl_coef > 0`` without LoRA: a second, frozen engine) and a critic's
    weights, gradients and optimizer states (``algo.use_critic``) in the same process."""
    m = part.memory
    cw, cg, co = companion_states(m, reference=cfg.algo.kl_coef > 0 and facts.lora_rank == 0,
                                  critic=bool(cfg.algo.use_critic))
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
    return ComponentMemory(weights, grads, optim, m.activations_gb, 0.0, total, total, m.device_gb, binds, fits)


def server_memory(cfg, part, facts: ModelFacts, concurrency: int, seq_tokens: int,
                  base_gb: float) -> ComponentMemory:
    """One device of a server instance of ``part`` (a validated InferencePart) running ``concurrency``
    sequences of up to ``seq_tokens`` tokens. SGLang/vLLM hold their reserved fraction whatever the load;
    the hf server holds what it uses."""
    m = part.memory
    pb = 2 if cfg.cluster.device == "cuda" else 4
    per_token = facts.kv_bytes_per_token(pb, part.tp, part.pp)
    reserving = part.backend != "hf"
    kv_tokens = m.kv_tokens if reserving else int(max(0.0, m.device_gb - m.weights_gb - base_gb) * GiB
                                                   // max(per_token, 1))
    fit_seqs = kv_tokens // max(1, seq_tokens)
    conc = max(1, min(concurrency, fit_seqs)) if fit_seqs > 0 else 0
    kv_gb = conc * seq_tokens * per_token / GiB
    # Decode's working set: hidden states and fp32 logits of the running batch (prefill's are chunked).
    act_gb = conc * (8 * facts.hidden + facts.vocab) * 4 / GiB
    used = m.weights_gb + kv_gb + act_gb
    total = max(used, m.device_gb * SERVER_MEM_FRACTION.get(part.backend, 0.9)) if reserving else used
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
        binds = (f"{_largest({'weights_gb': m.weights_gb, 'kv_cache_gb': kv_gb, 'activations_gb': act_gb})}; "
                 f"{m.device_gb - process:.1f} GB free")
        fits = process <= m.device_gb
    return ComponentMemory(m.weights_gb, 0.0, 0.0, act_gb, kv_gb, process, process, m.device_gb, binds, fits,
                           kv_tokens=int(kv_tokens), concurrency=int(conc))


def weight_bytes(facts: ModelFacts, dtype: str) -> float:
    """Bytes of the full model in ``dtype`` (what a weight push moves; LoRA: the adapter only)."""
    n = facts.lora_params() if facts.lora_rank > 0 else facts.total_params()
    return float(n) * dtype_bytes(dtype)
