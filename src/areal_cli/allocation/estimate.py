"""Memory estimates per device, from architecture facts only (no torch, no weights).

Training: weights + gradients + Adam states under the engine's sharding, plus activations for one
micro-batch (Korthikanti et al. 2022: ~34·s·h bytes per layer in 16-bit without recomputation,
inputs only with recomputation) and fp32 logits. Inference: weights plus the KV-cache budget
left under the server's memory fraction. These are planning estimates, good to ~20%.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass

GiB = 1024 ** 3


@dataclass
class ModelFacts:
    heads: int
    kv_heads: int
    layers: int
    hidden: int
    head_dim: int
    intermediate: int
    vocab: int
    experts: int
    moe_intermediate: int
    tied: bool
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ()
    experts_per_tok: int = 0
    vision: int = 0  # parameters of the vision tower and merger (vision-language models; config/model.py)

    @classmethod
    def from_config(cls, m) -> ModelFacts:
        from areal_cli.config.model import lora_target_modules, vision_tower_params

        hd = m.head_dim or (m.hidden_size // max(1, m.num_attention_heads))
        lora = getattr(m, "lora", None)
        rank = int(lora.rank) if lora is not None else 0
        targets = lora_target_modules(lora.target_modules, moe=m.num_experts > 0) if rank > 0 else ()
        return cls(m.num_attention_heads, m.num_key_value_heads, m.num_hidden_layers, m.hidden_size,
                   hd, m.intermediate_size, m.vocab_size, m.num_experts,
                   m.moe_intermediate_size or m.intermediate_size, m.tie_word_embeddings, rank, targets,
                   m.num_experts_per_tok,
                   vision_tower_params(m.vision, m.hidden_size) if getattr(m, "vision", None) is not None else 0)

    def attn_params(self) -> int:
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        return self.hidden * q + 2 * self.hidden * kv + q * self.hidden

    def expert_params(self) -> int:
        """Parameters in experts over all layers (0 for dense models)."""
        if self.experts <= 0:
            return 0
        return self.layers * self.experts * 3 * self.hidden * self.moe_intermediate

    def dense_params(self) -> int:
        """Everything that is not an expert: attention, dense MLP or router, norms, embeddings, and the vision
        tower (held, trained and sharded like the rest)."""
        mlp = self.hidden * self.experts if self.experts > 0 else 3 * self.hidden * self.intermediate
        per_layer = self.attn_params() + mlp + 2 * self.hidden
        emb = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * per_layer + emb + self.hidden + self.vision

    def total_params(self) -> int:
        return self.dense_params() + self.expert_params()

    def active_params(self) -> int:
        """Parameters one text token passes through: every dense one but the vision tower's (it runs once per
        image patch, not per token), and top-k of the experts (MoE)."""
        if self.experts <= 0:
            return self.total_params() - self.vision
        k = self.experts_per_tok or 1
        return self.dense_params() - self.vision + self.expert_params() * k // self.experts

    def kv_bytes_per_token(self, pb: int, tp: int = 1, pp: int = 1) -> float:
        """KV cache of one token on one device of a t×p server (KV heads replicate when t exceeds them)."""
        return 2 * math.ceil(self.layers / pp) * max(1, self.kv_heads // tp) * self.head_dim * pb

    def lora_params(self) -> int:
        """Adapter parameters: ``rank × (in + out)`` per targeted projection and layer."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h, i = self.hidden, self.intermediate
        dims = {"q_proj": h + q, "k_proj": h + kv, "v_proj": h + kv, "o_proj": q + h,
                "gate_proj": h + i, "up_proj": h + i, "down_proj": i + h}
        return self.layers * self.lora_rank * sum(dims[t] for t in self.lora_targets)


@dataclass
class TrainMemory:
    params_per_device: int
    weights_gb: float
    grads_gb: float
    optim_gb: float
    activations_gb: float
    total_gb: float
    device_gb: float

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class InferenceMemory:
    weights_gb: float
    kv_budget_gb: float
    kv_tokens: int  # tokens of KV cache that fit per instance
    kv_tokens_needed: int  # concurrent rollouts per instance × max sequence length
    device_gb: float

    def to_dict(self) -> dict:
        return asdict(self)


def device_memory_gb(device: str, gpu_memory_gb: float, devices_per_node: int) -> float:
    """Memory of one device: the GPU's, or on CPU this host's RAM split over its processes."""
    if device == "cuda":
        return float(gpu_memory_gb)
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 16 * GiB
    return ram / GiB / max(1, devices_per_node)


def dtype_bytes(dtype: str) -> int:
    return 2 if dtype in ("bfloat16", "float16", "bf16", "fp16") else 4


def train_memory(f: ModelFacts, sharding, par, ffn_tp: int, dtype: str, mb_tokens: int, n_mb: int,
                 grad_ckpt: bool, device_gb: float) -> TrainMemory:
    """Per-device training memory for one component with ParallelStrategy ``par``; ``sharding``
    (:class:`areal_cli.engines.Sharding`, from the backend's registry entry) says what the backend
    shards over the d×c ranks. Tensor and pipeline parallelism divide everything by t×p."""
    pb = dtype_bytes(dtype)
    dense = f.dense_params() / (par.tp * par.pp)
    experts = f.expert_params() / (par.ep * ffn_tp * par.pp) if f.experts > 0 else 0.0
    local = dense + experts
    shard = par.dp * par.cp
    sw, sg, so = (shard if on else 1 for on in (sharding.weights, sharding.grads, sharding.optimizer))
    # What the d×c sharding divides. When e is cut out of d×c (archon), an expert shard is sharded over the
    # d×c/e remaining ranks only: experts end up over d×c ranks in all, not e × d×c.
    stored = dense + experts * par.ep if getattr(sharding, "experts_share_dc", False) else local
    # LoRA: gradients and Adam states exist for the adapter only; the frozen base keeps its weights.
    trainable = f.lora_params() / (par.tp * par.pp) if f.lora_rank > 0 else stored
    weights = stored * pb / sw + (trainable * pb / sw if f.lora_rank > 0 else 0.0)
    if sharding.gathers_layers:
        # One or two layers are gathered unsharded at a time (prefetch).
        weights += 2 * (local / max(1, f.layers // par.pp)) * pb
    grads = trainable * pb / sg
    adam = 8 + (4 if pb == 2 else 0)  # fp32 m, v (+ fp32 master weights for 16-bit params)
    optim = trainable * adam / so
    layers_stage = math.ceil(f.layers / par.pp)
    in_flight = min(par.pp, max(1, n_mb))
    tokens = mb_tokens / par.cp
    if grad_ckpt:
        per_layer = tokens * f.hidden * pb
        act = per_layer * layers_stage * in_flight + tokens * f.hidden * 34 * pb / 2 / par.tp
    else:
        act = tokens * f.hidden * 34 * (pb / 2) / par.tp * layers_stage * in_flight
    act += 2 * tokens * f.vocab * 4 / par.tp  # fp32 logits and their gradient (last stage)
    total = weights + grads + optim + act
    return TrainMemory(int(local), weights / GiB, grads / GiB, optim / GiB, act / GiB, total / GiB,
                       device_gb)


def companion_states(m: TrainMemory, *, reference: bool, critic: bool,
                     teacher: float = 0.0, reward_model: float = 0.0) -> tuple[float, float, float]:
    """GB of (weights, gradients, optimizer states) that live in the actor's process beside ``m``: a frozen KL
    reference (weights only), a frozen distillation teacher (weights only, ``teacher`` times the actor's: its
    size ratio, plan/distill.py), a frozen reward model scoring samples (weights only, ``reward_model`` times
    the actor's, plan/reward_model.py) and a critic (all three, the actor's shape). Auto-sizing and
    ``areal plan`` both count them, so a micro-batch chosen to fit fits with them."""
    w = (m.weights_gb if reference else 0.0) + (m.weights_gb if critic else 0.0) + m.weights_gb * teacher
    w += m.weights_gb * reward_model
    return w, m.grads_gb if critic else 0.0, m.optim_gb if critic else 0.0


def server_mem_fraction(backend: str) -> float:
    """The fraction of device memory ``backend``'s server claims (its spec's ``mem_fraction``)."""
    from areal_cli.inference.backends import backend_spec

    return backend_spec(backend).mem_fraction


def inference_memory(f: ModelFacts, backend: str, tp: int, pp: int, ep: int, device: str,
                     device_gb: float, concurrent: int, seq_len: int) -> InferenceMemory:
    pb = 2 if device == "cuda" else 4  # servers run bf16 on GPUs, fp32 on CPU
    dense = f.dense_params() / (tp * pp)
    experts = f.expert_params() / (tp * pp * max(1, ep)) if f.experts > 0 else 0.0
    weights = (dense + experts) * pb
    budget = device_gb * GiB * server_mem_fraction(backend) - weights
    per_token = f.kv_bytes_per_token(pb, tp, pp)
    kv_tokens = max(0, int(budget // per_token)) if per_token else 0
    return InferenceMemory(weights / GiB, max(0.0, budget) / GiB, kv_tokens, concurrent * seq_len,
                           device_gb)
