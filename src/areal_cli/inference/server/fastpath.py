"""A hand-written forward for Llama-family decoders (Qwen2, Qwen3, Llama, Mistral) over a ragged KV cache.

Why not ``model(...)``: profiling the decode step of a ~10M-param model at batch 32 on one CPU thread
showed HF's forward spends about half its time outside the weight matmuls — K/V ``torch.cat`` into the
cache and ``repeat_kv`` copies every step, the SDPA flash kernel on one-token queries, 4-D mask
building, and a few hundred small ops per step. This runner keeps the same weights and the same math
(RMSNorm, RoPE from the model's own ``rotary_emb``, GQA attention, SiLU MLP) with:

- fused QKV and gate/up projections with weights stored pre-transposed (``mm(x, w_t)``), the softmax
  scale folded into the query projection (fp32);
- a preallocated K/V slab per layer: row ``i`` holds its tokens at ``0..len_i-1`` (padding after them),
  a decode step writes one column per row in place;
- with the C kernels (:mod:`~areal_cli.inference.server.decode_kernel`; fp32 on CPU, one thread, head
  size a multiple of 16) a forward is, per layer, four GEMMs writing into preallocated buffers (the
  residual projections accumulate into the hidden state in place) and three kernel calls: RMSNorm,
  attention (q/k norm, RoPE, K/V write, scores over each row's own columns, softmax, PV in one pass
  per (row, KV head)), and ``silu(gate) * up``. Prefill runs the same forward on the admitted prompts'
  tokens packed without padding (each token attends to its row's prefix, written just before it);
- without them, torch ops: decode attention as two batched matmuls with queries grouped per KV head
  (no K/V copies); prefill packed for the linear layers, attention one batched causal attention per
  layer over the right-padded batch.

Weights are re-fused whenever any model parameter was modified in place (``_version`` counters), so
weight updates (which ``copy_`` into the parameters between steps) take effect at the next step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from areal_cli.inference.server import decode_kernel, lora
from areal_cli.utils import host_memory

log = logging.getLogger("areal_cli.hf_server")

SUPPORTED = {"qwen2", "qwen3", "llama", "mistral"}


def unsupported_reason(model) -> str | None:
    """``None`` when :class:`FastRunner` can run ``model``; else why not (the engine then uses HF's forward)."""
    cfg = model.config
    if getattr(cfg, "model_type", None) not in SUPPORTED:
        return f"model_type {getattr(cfg, 'model_type', None)!r} not in {sorted(SUPPORTED)}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r}"
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
        return "sliding-window layers"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return "sliding-window attention"
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "layers") or not hasattr(base, "rotary_emb"):
        return "no model.layers / model.rotary_emb"
    a, m = base.layers[0].self_attn, base.layers[0].mlp
    if not all(hasattr(a, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")):
        return "unexpected attention module"
    if not all(hasattr(m, n) for n in ("gate_proj", "up_proj", "down_proj")):
        return "unexpected MLP module"
    if getattr(a.o_proj, "bias", None) is not None or getattr(m.down_proj, "bias", None) is not None:
        return "biased o_proj/down_proj"
    return None


class _Linear:
    """``y = x @ w.T + b`` with ``w.T`` stored contiguous: MKL's ``sgemm`` on a pre-transposed weight is
    10-20% faster at decode batch sizes than ``F.linear``'s transposed view (measured, 1 thread)."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None):
        self.wt = w.t().contiguous()
        self.b = None if b is None else b.contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.b is None:
            return torch.mm(x, self.wt)
        return torch.addmm(self.b, x, self.wt)

    def into(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``linear(x)`` written into ``out``."""
        if self.b is None:
            return torch.mm(x, self.wt, out=out)
        return torch.addmm(self.b, x, self.wt, out=out)

    def residual(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``h + linear(x)`` in one GEMM call (bias-free projections only)."""
        return torch.addmm(h, x, self.wt)


@dataclass
class _Layer:
    ln1: torch.Tensor
    qkv: _Linear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: _Linear
    ln2: torch.Tensor
    gate_up: _Linear
    down: _Linear
    li: int = 0


class FastRunner:
    """Owns the KV cache of the running batch; ``prefill`` appends rows, ``decode`` advances all rows."""

    # Prefill score elements (32 MiB fp32) up to which attention runs as two matmuls (else flash SDPA).
    MATMUL_ATTENTION_MAX = 1 << 23
    # Longest prompt a prefill runs through the C kernels. Their attention handles a prompt token by
    # token (a matrix-vector product per token and head): faster than padding, masks and batched
    # matmuls for short prompts (64 prompts of 8-48 tokens: 340 vs 440 ms), slower past ~700 tokens
    # (one 1536-token prompt: 835 vs 502 ms; 4000: 2.9x), where the torch ops' GEMMs win.
    KERNEL_PREFILL_MAX_LEN = 512

    def __init__(self, model, device: torch.device, attention: str = "auto"):
        """``attention``: ``"kernel"`` (the C kernels of :mod:`~areal_cli.inference.server.decode_kernel`
        for attention, RMSNorm and SiLU; error if they cannot run), ``"torch"`` (torch ops), or ``"auto"``
        (the kernels when they build and apply: fp32 on CPU, one intra-op thread, head size % 16 == 0)."""
        cfg = model.config
        base = model.model
        a0 = base.layers[0].self_attn
        self.model, self.device = model, device
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim, self.scaling = a0.head_dim, float(a0.scaling)
        self.eps = float(cfg.rms_norm_eps)
        self.inter = base.layers[0].mlp.gate_proj.weight.shape[0]
        self.hidden = cfg.hidden_size
        self.dtype = next(model.parameters()).dtype
        self.fold_scale = self.dtype == torch.float32
        self._params = list(model.parameters())
        self._kernel = self._pick_kernel(attention, device)
        self._weights_key = None
        # LoRA (inference/server/lora.py): the adapter of each row of the next forward, set by the engine.
        self.row_adapters: list = []
        self._groups: list = []
        self._refresh()
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        self.lens: list[int] = []
        self._bufs: dict[str, torch.Tensor] = {}  # the fused decode step's activations (see _buffers)

    def _pick_kernel(self, attention: str, device: torch.device):
        if attention not in ("auto", "kernel", "torch"):
            raise ValueError(f"attention must be auto, kernel or torch, got {attention!r}")
        if attention == "torch":
            return None
        reason = decode_kernel.usable(self.dtype, device, check_threads=attention == "auto",
                                      head_dim=self.head_dim)
        if reason is None:
            return decode_kernel.load()[0]
        if attention == "kernel":
            raise ValueError(f"the fused decode-attention kernel cannot run here: {reason}")
        log.info("decode attention: torch ops (%s)", reason)
        return None

    @property
    def attention(self) -> str:
        """The decode attention in use: ``"kernel"`` or ``"torch"``."""
        return "torch" if self._kernel is None else "kernel"

    # ------------------------------------------------------------------ weights
    def _version_key(self) -> tuple[int, ...]:
        return tuple((p._version, p.data_ptr()) for p in self._params)

    @torch.no_grad()
    def _refresh(self) -> None:
        """(Re)build the fused, pre-transposed weights when any parameter changed since the last build."""
        key = self._version_key()
        if key == self._weights_key:
            return
        base = self.model.model
        layers = []
        for layer in base.layers:
            a, m = layer.self_attn, layer.mlp
            # The softmax scale is folded into the query projection (or Qwen3's q_norm weight): RoPE and
            # the norm are linear in their output, so ``scale * q`` costs nothing per step.
            # (fp32 only: in bf16/fp16 the folded weight would round differently, so q is scaled at run time.)
            qn, kn = getattr(a, "q_norm", None), getattr(a, "k_norm", None)
            q_scale = 1.0 if (qn is not None or not self.fold_scale) else self.scaling
            projs = (a.q_proj, a.k_proj, a.v_proj)
            w = torch.cat([a.q_proj.weight * q_scale, a.k_proj.weight, a.v_proj.weight]).detach()
            bias = None
            if any(p.bias is not None for p in projs):
                parts = [p.bias if p.bias is not None else torch.zeros(p.weight.shape[0], dtype=p.weight.dtype,
                                                                        device=p.weight.device) for p in projs]
                bias = torch.cat([parts[0] * q_scale, parts[1], parts[2]]).detach()
            layers.append(_Layer(
                ln1=layer.input_layernorm.weight.detach(),
                qkv=_Linear(w, bias),
                q_norm=None if qn is None else (qn.weight * (self.scaling if self.fold_scale else 1.0)).detach(),
                k_norm=None if kn is None else kn.weight.detach(),
                o=_Linear(a.o_proj.weight.detach(), None),
                ln2=layer.post_attention_layernorm.weight.detach(),
                gate_up=_Linear(torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach(), None),
                down=_Linear(m.down_proj.weight.detach(), None), li=len(layers)))
        self.layers = layers
        self.embed = base.embed_tokens.weight.detach()
        self.norm = base.norm.weight.detach()
        head = self.model.get_output_embeddings()
        self.lm_head = _Linear(head.weight.detach(), getattr(head, "bias", None))
        self._weights_key = key
        host_memory.release()  # the previous fused copy, freed under live tensors (utils/host_memory.py)

    # ------------------------------------------------------------------ cache bookkeeping
    @property
    def rows(self) -> int:
        return len(self.lens)

    def _ensure(self, rows: int, length: int) -> None:
        """Grow the slabs (doubling) to hold ``rows`` rows of ``length`` tokens.

        K and V are ``[rows, kv_heads, capacity, D]``: a (row, head)'s cached tokens are one contiguous
        run, which the decode kernel streams (the capacity is a multiple of 16, its vector width).
        """
        cap_r = self._v[0].shape[0] if self._v else 0
        cap_l = self._v[0].shape[2] if self._v else 0
        if rows <= cap_r and length <= cap_l:
            return
        new_r = cap_r if rows <= cap_r else max(rows, 2 * cap_r, 8)
        new_l = cap_l if length <= cap_l else -(-max(length, 2 * cap_l, 64) // 16) * 16  # the kernel's unit
        n, used = self.rows, max(self.lens, default=0)
        for li in range(len(self.layers)):
            k = torch.zeros((new_r, self.n_kv, new_l, self.head_dim), dtype=self.dtype, device=self.device)
            v = torch.zeros((new_r, self.n_kv, new_l, self.head_dim), dtype=self.dtype, device=self.device)
            if li < len(self._k):
                k[:n, :, :used] = self._k[li][:n, :, :used]
                v[:n, :, :used] = self._v[li][:n, :, :used]
                self._k[li], self._v[li] = k, v
            else:
                self._k.append(k)
                self._v.append(v)
        # The smaller slabs just freed came from the heap (below glibc's dynamic mmap threshold) and would
        # stay resident under later allocations: give their pages back.
        host_memory.release()

    @torch.inference_mode()
    def keep(self, idx: list[int]) -> None:
        """Keep only rows ``idx`` (in that order), compacting the slabs."""
        if idx == list(range(len(idx))):
            self.lens = self.lens[: len(idx)]
            return
        used = max(self.lens[i] for i in idx) if idx else 0
        it = torch.tensor(idx, dtype=torch.long, device=self.device)
        for k, v in zip(self._k, self._v):
            k[: len(idx), :, :used] = k[it, :, :used]
            v[: len(idx), :, :used] = v[it, :, :used]
        self.lens = [self.lens[i] for i in idx]

    @torch.inference_mode()
    def fork(self, src: list[int], lengths: list[int]) -> None:
        """Append rows holding copies of the first ``lengths[i]`` cached tokens of rows ``src[i]`` (a
        shared prompt's KV: bit-identical to prefilling it again, without the forward)."""
        n, r0, width = len(src), self.rows, max(lengths)
        self._ensure(r0 + n, max(width, max(self.lens, default=0)) + 1)
        it = torch.tensor(src, dtype=torch.long, device=self.device)
        for k, v in zip(self._k, self._v):
            k[r0:r0 + n, :, :width] = k[it, :, :width]
            v[r0:r0 + n, :, :width] = v[it, :, :width]
        self.lens.extend(lengths)

    def clear(self) -> None:
        self.lens = []

    @torch.inference_mode()
    def export(self, row: int, n: int) -> torch.Tensor:
        """A copy of row ``row``'s first ``n`` cached tokens' K and V: ``[layers, 2, kv_heads, n, D]``
        (what :class:`~areal_cli.inference.server.prefix_cache.PrefixCache` stores)."""
        return torch.stack([torch.stack([k[row, :, :n], v[row, :, :n]]) for k, v in zip(self._k, self._v)])

    # ------------------------------------------------------------------ math
    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self._kernel is not None and x.dim() == 2 and x.stride(1) == 1:
            return self._kernel.rms_norm(x, w, self.eps, torch.empty_like(x))
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), w, self.eps)
        xf = x.float()  # HF's RMSNorm: statistics in fp32, cast back before the weight
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def _rope_tables(self, h: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.model.model.rotary_emb(h, pos.unsqueeze(0))
        return cos[0].unsqueeze(1), sin[0].unsqueeze(1)  # [T, 1, D]

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return torch.addcmul(x * cos, rot, sin)

    def _qkv(self, layer: _Layer, x: torch.Tensor, cos, sin):
        """Returns ``(q, k, v)`` as ``[T, heads, D]``; ``q`` already carries the softmax scale."""
        t, nh, nkv = x.shape[0], self.n_heads, self.n_kv
        qkv = self._lora(layer, "qkv", x, layer.qkv(x)).view(t, nh + 2 * nkv, self.head_dim)
        if layer.q_norm is not None:
            q, k, v = qkv.split([nh, nkv, nkv], dim=1)
            q = self._rope(self._rms(q, layer.q_norm), cos, sin)
            return (q if self.fold_scale else q * self.scaling), self._rope(self._rms(k, layer.k_norm), cos, sin), v
        qk = self._rope(qkv[:, : nh + nkv], cos, sin)  # one RoPE pass for queries and keys
        q = qk[:, :nh] if self.fold_scale else qk[:, :nh] * self.scaling
        return q, qk[:, nh:], qkv[:, nh + nkv:]

    def _mlp(self, layer: _Layer, h: torch.Tensor) -> torch.Tensor:
        x = self._rms(h, layer.ln2)
        gu = self._lora(layer, "gate_up", x, layer.gate_up(x))
        if self._kernel is not None:
            act = self._kernel.silu_mul(gu, gu.new_empty((gu.shape[0], self.inter)))
        else:
            act = F.silu(gu[:, : self.inter]) * gu[:, self.inter:]
        return self._lora(layer, "down", act, layer.down.residual(h, act))

    def _lora(self, layer: _Layer, key: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` plus the LoRA term of each row group's adapter for this fused projection."""
        for ad, idx in self._groups:
            if ad.fused is None:
                q_scale = self.scaling if (self.fold_scale and getattr(self.model.model.layers[0].self_attn,
                                                                        "q_norm", None) is None) else 1.0
                ad.fused = lora.fused_layers(ad, self.model, q_scale)
            ab = ad.fused[layer.li].get(key)
            if ab is not None:
                lora.add_delta(out, x, ab[0], ab[1], idx)
        return out

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self._rms(h, self.norm)).float()

    # ------------------------------------------------------------------ steps
    @torch.inference_mode()
    def prefill(self, seqs: list[list[int]], cached: list[tuple[torch.Tensor, int] | None] | None = None
                ) -> torch.Tensor:
        """Append one row per sequence, run it through the model, return last-token logits ``[n, V]``.

        ``cached[i] = (kv, m)``: the first ``m`` tokens of ``seqs[i]`` have K/V ``kv`` (``[layers, 2,
        kv_heads, >= m, D]``, from :meth:`export`): they are copied into the row and only tokens
        ``m..`` go through the model, at their own positions (``m < len(seqs[i])``)."""
        self._refresh()
        full = [len(s) for s in seqs]
        starts = [0 if c is None else c[1] for c in (cached or [None] * len(seqs))]
        n, r0 = len(seqs), self.rows
        self._ensure(r0 + n, max(max(full), max(self.lens, default=0)) + 1)
        for i, st in enumerate(starts):
            if st:
                kv = cached[i][0]
                for li, (k, v) in enumerate(zip(self._k, self._v)):
                    k[r0 + i, :, :st] = kv[li, 0, :, :st]
                    v[r0 + i, :, :st] = kv[li, 1, :, :st]
        lens = [f - st for f, st in zip(full, starts)]  # tokens that go through the model
        width = max(lens)
        dev = self.device
        ids = torch.tensor([t for s, st in zip(seqs, starts) for t in s[st:]], dtype=torch.long, device=dev)
        pos = torch.tensor([j for f, st in zip(full, starts) for j in range(st, f)], dtype=torch.long,
                           device=dev)
        self._groups = lora.row_groups(self.row_adapters[:n], lens, dev)
        if self._kernel is not None and width <= self.KERNEL_PREFILL_MAX_LEN:  # packed; causal per row
            # The kernel attends token t over its row's columns 0..pos[t]: a cached prefix is just
            # columns already written.
            rows = torch.tensor([r0 + i for i, m in enumerate(lens) for _ in range(m)], dtype=torch.long,
                                device=dev)
            h = self._forward_fused(ids, rows, pos, self._buffers(len(pos), keep=False))
        elif any(starts):
            h = self._prefill_torch_after(ids, pos, lens, starts, r0)
        else:
            h = self._prefill_torch(ids, pos, lens, r0)
        self.lens.extend(full)
        last = torch.tensor(lens, dtype=torch.long, device=dev).cumsum(0) - 1
        return self._logits(h.index_select(0, last))

    def _prefill_torch_after(self, ids: torch.Tensor, pos: torch.Tensor, lens: list[int], starts: list[int],
                             r0: int) -> torch.Tensor:
        """:meth:`_prefill_torch` for rows whose first ``starts[r]`` columns already hold cached K/V:
        new tokens are written at their positions, then attend over the row's columns ``0..pos``."""
        dev, n, width = self.device, len(lens), max(lens)
        g, d = self.n_heads // self.n_kv, self.head_dim
        j = torch.tensor([j for m in lens for j in range(m)], dtype=torch.long, device=dev)
        slot = (torch.arange(n, device=dev) * width).repeat_interleave(torch.tensor(lens, device=dev)) + j
        rows = torch.tensor([r0 + r for r, m in enumerate(lens) for _ in range(m)], dtype=torch.long,
                            device=dev)
        total = max(s + m for s, m in zip(starts, lens))
        st = torch.tensor(starts, dtype=torch.long, device=dev).view(n, 1, 1)
        # Query j of row r (position starts[r] + j) sees columns 0..starts[r] + j.
        allowed = torch.arange(total, device=dev).view(1, 1, total) <= st + torch.arange(width, device=dev).view(
            1, width, 1)
        bias = torch.zeros((n, width, total), dtype=torch.float32, device=dev).masked_fill_(
            ~allowed, float("-inf"))
        h = F.embedding(ids, self.embed)
        cos, sin = self._rope_tables(h, pos)
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, self._rms(h, layer.ln1), cos, sin)
            kc, vc = self._k[li], self._v[li]
            kc[rows, :, pos] = k
            vc[rows, :, pos] = v
            qp = self._padded(q, slot, n, width)  # [n, heads, width, D]
            scores = torch.matmul(qp.reshape(n, self.n_kv, g * width, d),
                                  kc[r0:r0 + n, :, :total].transpose(2, 3))  # [n, kv, g*W, total]
            if scores.dtype != torch.float32:
                scores = scores.float()
            scores.view(n, self.n_kv, g, width, total).add_(bias.view(n, 1, 1, width, total))
            o = torch.matmul(torch.softmax(scores, dim=-1).to(vc.dtype), vc[r0:r0 + n, :, :total])
            o = o.view(n, self.n_heads, width, d).transpose(1, 2).reshape(n * width, -1).index_select(0, slot)
            h = self._lora(layer, "o", o, layer.o.residual(h, o))
            h = self._mlp(layer, h)
        return h

    def _prefill_torch(self, ids: torch.Tensor, pos: torch.Tensor, lens: list[int], r0: int) -> torch.Tensor:
        """Prefill with torch ops: attention over the right-padded batch, everything else packed."""
        dev, n, width = self.device, len(lens), max(lens)
        # Packed token i of request r sits at row r*width + j of the right-padded [n, width] batch. Right
        # padding needs no mask under causal attention: a real query only sees earlier, real keys.
        slot = None if n == 1 else (torch.arange(n, device=dev) * width).repeat_interleave(
            torch.tensor(lens, device=dev)) + pos
        h = F.embedding(ids, self.embed)
        cos, sin = self._rope_tables(h, pos)
        causal = None  # additive mask for the matmul path; None → SDPA's flash kernel (long prompts)
        if n * self.n_heads * width * width <= self.MATMUL_ATTENTION_MAX:
            causal = torch.full((width, width), float("-inf"), device=dev).triu_(1)
        for li, layer in enumerate(self.layers):
            q, k, v = (self._padded(x, slot, n, width)  # [n, heads, width, D]
                       for x in self._qkv(layer, self._rms(h, layer.ln1), cos, sin))
            self._k[li][r0:r0 + n, :, :width] = k
            self._v[li][r0:r0 + n, :, :width] = v
            o = self._causal_attention(q, k, v, causal).transpose(1, 2).reshape(n * width, -1)
            o = o if slot is None else o.index_select(0, slot)
            h = self._lora(layer, "o", o, layer.o.residual(h, o))
            h = self._mlp(layer, h)
        return h

    def _causal_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          causal: torch.Tensor | None) -> torch.Tensor:
        """Causal GQA attention, ``q`` ``[n, heads, W, D]`` (scale folded in), ``k``/``v`` ``[n, kv, W, D]``.

        For short prompts, two batched matmuls with each KV head's query group stacked as rows beat
        SDPA's CPU flash kernel about 1.5x (measured, 1 thread); the flash kernel, which never
        materialises the ``W x W`` scores, takes over when they would be large.
        """
        if causal is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0,
                                                  enable_gqa=self.n_heads != self.n_kv)
        n, _, w, d = q.shape
        g = self.n_heads // self.n_kv
        scores = torch.matmul(q.reshape(n, self.n_kv, g * w, d), k.transpose(2, 3))  # [n, kv, g*W, W]
        if scores.dtype != torch.float32:
            scores = scores.float()
        scores.view(n, self.n_kv, g, w, w).add_(causal)
        out = torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)  # [n, kv, g*W, D]
        return out.view(n, self.n_heads, w, d)

    @staticmethod
    def _padded(x: torch.Tensor, slot: torch.Tensor | None, n: int, width: int) -> torch.Tensor:
        """Packed ``[t, heads, D]`` → right-padded ``[n, heads, width, D]`` (zeros in the padding)."""
        if slot is not None:
            x = x.new_zeros((n * width,) + x.shape[1:]).index_copy_(0, slot, x)
        return x.view(n, width, *x.shape[1:]).transpose(1, 2)

    @torch.inference_mode()
    def decode(self, tokens: list[int]) -> torch.Tensor:
        """Feed one token per row (row order), return next-token logits ``[rows, V]``."""
        self._refresh()
        b = self.rows
        length = max(self.lens) + 1
        self._ensure(b, length)
        dev = self.device
        pos = torch.tensor(self.lens, dtype=torch.long, device=dev)
        ids = torch.tensor(tokens, dtype=torch.long, device=dev)
        self._groups = lora.row_groups(self.row_adapters[:b], None, dev)
        if self._kernel is not None:
            h = self._forward_fused(ids, None, pos, self._buffers(b))
        else:
            h = self._decode_torch(ids, pos, length)
        self.lens = [n + 1 for n in self.lens]
        return self._logits(h)

    def _buffers(self, b: int, keep: bool = True) -> dict[str, torch.Tensor]:
        """The fused forward's activations for ``b`` tokens: views of buffers kept across decode steps
        (grown by doubling), so a step allocates almost nothing and every GEMM writes with ``out=``.
        ``keep=False`` (a prefill's packed prompts): fresh buffers, freed after the call."""
        qkv_w = (self.n_heads + 2 * self.n_kv) * self.head_dim
        widths = {"h": self.hidden, "x": self.hidden, "qkv": qkv_w, "attn": self.n_heads * self.head_dim,
                  "gu": 2 * self.inter, "act": self.inter}
        g = self.n_heads // self.n_kv
        scratch = g * self._k[0].shape[2] + (g + 1) * self.head_dim
        if not keep:
            bufs = {k: torch.empty((b, w), dtype=self.dtype, device=self.device) for k, w in widths.items()}
            return {**bufs, "scratch": torch.empty(scratch, dtype=torch.float32, device=self.device)}
        have = self._bufs.get("h")
        if have is None or have.shape[0] < b:
            rows = max(b, 2 * have.shape[0] if have is not None else 8)
            self._bufs = {k: torch.empty((rows, w), dtype=self.dtype, device=self.device)
                          for k, w in widths.items()}
            self._bufs["scratch"] = torch.empty(0, dtype=torch.float32, device=self.device)
        if self._bufs["scratch"].numel() < scratch:
            self._bufs["scratch"] = torch.empty(scratch, dtype=torch.float32, device=self.device)
        return {k: (v if k == "scratch" else v[:b]) for k, v in self._bufs.items()}

    def _forward_fused(self, ids: torch.Tensor, rows: torch.Tensor | None, pos: torch.Tensor,
                       buf: dict[str, torch.Tensor]) -> torch.Tensor:
        """Tokens ``ids`` at positions ``pos`` of slab rows ``rows`` (None: token i is row i, a decode
        step) through the model with the C kernels: per layer four GEMMs (the residual ones accumulate
        into ``h`` in place) and three kernel calls, all into the buffers ``buf``. Returns ``h``."""
        kern, b = self._kernel, ids.shape[0]
        h, x, qkv, attn, gu, act = buf["h"], buf["x"], buf["qkv"], buf["attn"], buf["gu"], buf["act"]
        torch.index_select(self.embed, 0, ids, out=h)
        cos, sin = self._rope_tables(h, pos)
        cos, sin = cos.reshape(b, -1).contiguous(), sin.reshape(b, -1).contiguous()
        for li, layer in enumerate(self.layers):
            kern.rms_norm(h, layer.ln1, self.eps, x)
            layer.qkv.into(x, qkv)
            self._lora(layer, "qkv", x, qkv)
            kern.attention(qkv, self.n_heads, self.n_kv, cos, sin, layer.q_norm, layer.k_norm, self.eps,
                           self._k[li], self._v[li], rows, pos, attn, buf["scratch"])
            h.addmm_(attn, layer.o.wt)
            self._lora(layer, "o", attn, h)
            kern.rms_norm(h, layer.ln2, self.eps, x)
            torch.mm(x, layer.gate_up.wt, out=gu)
            self._lora(layer, "gate_up", x, gu)
            kern.silu_mul(gu, act)
            h.addmm_(act, layer.down.wt)
            self._lora(layer, "down", act, h)
        return h

    def _decode_torch(self, ids: torch.Tensor, pos: torch.Tensor, length: int) -> torch.Tensor:
        """The decode step with torch ops only (bf16/fp16, CUDA, or ``attention="torch"``)."""
        h = F.embedding(ids, self.embed)
        cos, sin = self._rope_tables(h, pos)
        mask = self._decode_mask(pos, length)
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, self._rms(h, layer.ln1), cos, sin)
            attn = self._attend_torch(li, q, k, v, pos, mask, length)
            h = self._lora(layer, "o", attn, layer.o.residual(h, attn))
            h = self._mlp(layer, h)
        return h

    def _decode_mask(self, pos: torch.Tensor, length: int) -> torch.Tensor:
        """Additive ``[b, 1, 1, length]`` bias: row i attends to its own columns ``0..lens[i]`` (the new
        token included); later columns are padding."""
        b, dev = pos.shape[0], pos.device
        bias = torch.zeros((b, 1, 1, length), dtype=torch.float32, device=dev)
        return bias.masked_fill_((torch.arange(length, device=dev).unsqueeze(0) > pos.unsqueeze(1))
                                 .view(b, 1, 1, length), float("-inf"))

    def _attend_torch(self, li: int, q, k, v, pos: torch.Tensor, mask: torch.Tensor,
                      length: int) -> torch.Tensor:
        b = q.shape[0]
        kc, vc = self._k[li], self._v[li]
        rows = torch.arange(b, device=pos.device)
        kc[rows, :, pos] = k
        vc[rows, :, pos] = v
        qg = q.reshape(b, self.n_kv, self.n_heads // self.n_kv, self.head_dim)
        scores = torch.matmul(qg, kc[:b, :, :length].transpose(2, 3))  # [b, kv, groups, length]
        if scores.dtype != torch.float32:
            scores = scores.float()
        probs = torch.softmax(scores.add_(mask), dim=-1).to(vc.dtype)
        out = torch.matmul(probs, vc[:b, :, :length])  # [b, kv, groups, D]
        return out.reshape(b, self.n_heads * self.head_dim)
