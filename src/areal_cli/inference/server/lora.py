"""LoRA adapters in the ``hf`` server: loaded and unloaded at run time, chosen per request.

The HTTP surface follows SGLang (``srt/entrypoints/http_server.py``, ``srt/managers/io_struct.py``):

- ``POST /load_lora_adapter {"lora_name", "lora_path", "pinned"}`` — a peft adapter dir
  (``adapter_config.json`` + ``adapter_model.safetensors``) under the allowed weight roots;
- ``POST /unload_lora_adapter {"lora_name"}``;
- ``/generate``'s ``lora_path``: the adapter *name* per request (a string, or one per prompt of a batch;
  ``null`` = the base model), as SGLang's ``GenerateReqInput.lora_path``.

Answers are SGLang's ``LoRAUpdateOutput`` (``success``, ``error_message``, ``loaded_adapters``), 200 or 400,
plus 403 for a path outside the allowed roots and 404 for a missing dir. The hf-only
``POST /load_lora_adapter_from_distributed`` takes the adapter from the trainer's weight-update group
(the same group and flattened-bucket broadcast as ``/update_weights_from_distributed``) with its peft
config in the request; SGLang's ``/load_lora_adapter_from_tensors`` instead carries pickled tensors
in the HTTP body, which this server does not unpickle.

The base weights are never changed. Each targeted projection computes ``x·Wᵀ + s·(x·Aᵀ)·Bᵀ`` for the
rows that asked for the adapter (``s = alpha / r``, folded into ``B`` at load), which equals the
merged model's ``x·(W + s·B·A)ᵀ`` up to rounding. Loads and unloads run on the engine thread between
two decode steps; a running request whose adapter is unloaded is aborted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch

from areal_cli.inference.server.weights import WeightUpdateRejected, check_allowed
from areal_cli.weight_sync.adapter_files import ADAPTER_CONFIG, ADAPTER_FILE

PREFIX = "base_model.model."
MAX_ADAPTERS = 8


class AdapterRejected(WeightUpdateRejected):
    """The adapter does not fit the served model (answered with 400; nothing is loaded)."""


@dataclass
class Adapter:
    name: str
    path: str
    rank: int
    alpha: float
    # module name (HF, e.g. "model.layers.0.self_attn.q_proj") -> (A [r, in], B·s [out, r])
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]
    fused: Any = field(default=None, repr=False)  # the fast path's per-layer fused form, built on first use

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def _linears(model) -> dict[str, torch.nn.Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def config_rank_alpha(cfg: Any) -> tuple[int, float]:
    if not isinstance(cfg, dict):
        raise AdapterRejected("adapter config must be a JSON object (peft's adapter_config.json)")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterRejected(f"peft_type {cfg.get('peft_type')!r} is not LORA")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise AdapterRejected(f"adapter config r must be a positive integer, got {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not alpha > 0:
        raise AdapterRejected(f"adapter config lora_alpha must be a positive number, got {alpha!r}")
    neutrals = (("use_dora", False), ("use_rslora", False), ("fan_in_fan_out", False), ("bias", "none"))
    for key, neutral in neutrals:
        if cfg.get(key, neutral) not in (neutral, None):
            raise AdapterRejected(f"adapter config {key}={cfg[key]!r} is not supported by the hf server "
                                  f"(only {neutral!r})")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise AdapterRejected("per-module rank_pattern/alpha_pattern is not supported by the hf server")
    return r, float(alpha)


def build_adapter(model, name: str, path: str, cfg: dict, tensors: dict[str, torch.Tensor],
                  max_rank: int) -> Adapter:
    """Check an adapter against the served model and put it in serving form (the model's device and
    dtype)."""
    r, alpha = config_rank_alpha(cfg)
    if r > max_rank:
        raise AdapterRejected(f"adapter rank {r} exceeds the server's --max-lora-rank {max_rank}")
    lin = _linears(model)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        body = key[len(PREFIX):] if key.startswith(PREFIX) else key
        for which in ("lora_A", "lora_B"):
            tag = f".{which}."
            if tag in body:
                mod, leaf = body.split(tag, 1)
                if leaf not in ("weight", "default.weight"):
                    raise AdapterRejected(f"unexpected adapter tensor {key!r}")
                parts.setdefault(mod, {})[which] = t
                break
        else:
            raise AdapterRejected(f"adapter tensor {key!r} is neither lora_A nor lora_B (only LoRA weights "
                                  "are served; modules_to_save and embeddings are not)")
    if not parts:
        raise AdapterRejected("the adapter has no lora_A/lora_B tensors")
    p0 = next(iter(model.parameters()))
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for mod, ab in parts.items():
        if mod not in lin:
            raise AdapterRejected(f"adapter targets {mod!r}, which is not a linear layer of the served model")
        if set(ab) != {"lora_A", "lora_B"}:
            raise AdapterRejected(f"adapter module {mod!r} has {sorted(ab)} but needs both lora_A and lora_B")
        a, b = ab["lora_A"], ab["lora_B"]
        w = lin[mod].weight
        if tuple(a.shape) != (r, w.shape[1]) or tuple(b.shape) != (w.shape[0], r):
            raise AdapterRejected(f"shape mismatch for {mod}: lora_A {list(a.shape)} and lora_B "
                                  f"{list(b.shape)}, "
                                  f"rank {r} on a [{w.shape[0]}, {w.shape[1]}] weight needs lora_A "
                                  f"[{r}, {w.shape[1]}] and lora_B [{w.shape[0]}, {r}]")
        modules[mod] = (a.to(device=p0.device, dtype=p0.dtype).contiguous(),
                        (b.float() * (alpha / r)).to(device=p0.device, dtype=p0.dtype).contiguous())
    # One fused norm over every tensor instead of two checks per module (an adapter push is mostly fixed
    # costs); only when it is not finite are the modules searched for the culprit.
    if not torch.isfinite(torch.nn.utils.get_total_norm([t for ab in modules.values() for t in ab],
                                                        foreach=True)):
        bad = [m for m, (a, b) in modules.items() if not (torch.isfinite(a).all() and torch.isfinite(b).all())]
        raise AdapterRejected(f"adapter module {bad[0]!r} has non-finite values" if bad else
                              "the adapter's values overflow (their norm is not finite)")
    return Adapter(name, path, r, alpha, modules)


def read_adapter_dir(path: str, roots: list[str]) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(config, tensors)`` of a peft adapter dir; PermissionError outside the roots, FileNotFoundError if
    absent."""
    from safetensors.torch import load_file

    p = check_allowed(path, roots)
    if not p.is_dir():
        raise FileNotFoundError(f"{path} is not a directory")
    cfg_file, w_file = p / ADAPTER_CONFIG, p / ADAPTER_FILE
    if not cfg_file.is_file() or not w_file.is_file():
        raise FileNotFoundError(f"{path} has no {ADAPTER_CONFIG} and {ADAPTER_FILE} (a peft adapter dir)")
    try:
        cfg = json.loads(cfg_file.read_text())
        tensors = load_file(str(w_file))
    except Exception as e:
        raise AdapterRejected(f"could not read the adapter in {path}: {e}") from None
    return cfg, tensors


def check_name(name: Any) -> str:
    if not isinstance(name, str) or not name or len(name) > 256:
        raise AdapterRejected(f"lora_name must be a non-empty string, got {name!r}")
    return name


class AdapterSet:
    """The loaded adapters of one engine (mutated on the engine thread only); the limits are the server's
    ``--max-loaded-loras`` and ``--max-lora-rank``."""

    def __init__(self, max_adapters: int = MAX_ADAPTERS, max_rank: int = 256):
        self.by_name: dict[str, Adapter] = {}
        self.max_adapters = max_adapters
        self.max_rank = max_rank

    def listing(self) -> dict[str, str]:
        return {n: a.path for n, a in self.by_name.items()}

    def add(self, adapter: Adapter) -> None:
        if adapter.name in self.by_name:
            raise AdapterRejected(f"LoRA adapter {adapter.name!r} is already loaded; unload it first")
        if len(self.by_name) >= self.max_adapters:
            raise AdapterRejected(f"{self.max_adapters} adapters are loaded already (the server's limit); "
                                  "unload one first")
        self.by_name[adapter.name] = adapter

    def remove(self, name: str) -> Adapter:
        if name not in self.by_name:
            raise AdapterRejected(f"LoRA adapter {name!r} is not loaded (loaded: {sorted(self.by_name)})")
        return self.by_name.pop(name)


def parse_request_adapters(body: dict, n_prompts: int, batch: bool, adapters: AdapterSet) -> list[str | None]:
    """``lora_path`` of a ``/generate`` body → one adapter name (or None) per prompt; 400 when unknown."""
    from areal_cli.inference.server.schema import BadRequest

    raw = body.get("lora_path")
    if raw is None:
        return [None] * n_prompts
    if isinstance(raw, str):
        names: list[Any] = [raw] * n_prompts
    elif isinstance(raw, list) and batch and len(raw) == n_prompts:
        names = raw
    else:
        raise BadRequest(f"lora_path must be an adapter name or, for a batch, a list of {n_prompts} names")
    for x in names:
        if x is not None and (not isinstance(x, str) or x not in adapters.by_name):
            raise BadRequest(f"LoRA adapter {x!r} is not loaded (loaded: {sorted(adapters.by_name)}); "
                             "load it with /load_lora_adapter")
    return names


# ---------------------------------------------------------------- applying adapters in a forward

def row_groups(row_adapters: list[Adapter | None], lens: list[int] | None = None,
               device: torch.device | None = None) -> list[tuple[Adapter, torch.Tensor | None]]:
    """Group rows (or, with ``lens``, the packed tokens of each row) by adapter: ``(adapter, index)``
    with ``index=None`` when one adapter covers every row."""
    if not row_adapters or all(a is None for a in row_adapters):
        return []
    first = row_adapters[0]
    if first is not None and all(a is first for a in row_adapters):
        return [(first, None)]
    out = []
    for ad in {id(a): a for a in row_adapters if a is not None}.values():
        rows = [i for i, a in enumerate(row_adapters) if a is ad]
        if lens is None:
            idx = torch.tensor(rows, dtype=torch.long, device=device)
        else:
            starts = [0]
            for n in lens[:-1]:
                starts.append(starts[-1] + n)
            idx = torch.cat([torch.arange(starts[i], starts[i] + lens[i], device=device) for i in rows])
        out.append((ad, idx))
    return out


def add_delta(out: torch.Tensor, x: torch.Tensor, a_t: torch.Tensor, b_t: torch.Tensor,
              idx: torch.Tensor | None) -> torch.Tensor:
    """``out[idx] += (x[idx] @ a_t) @ b_t`` over the leading dim (all rows when ``idx`` is None)."""
    if idx is None:
        return out.addmm_(torch.mm(x, a_t), b_t) if out.dim() == 2 else out.add_(x @ a_t @ b_t)
    return out.index_add_(0, idx, x.index_select(0, idx) @ a_t @ b_t)


class HFHooks:
    """For the HF-forward runner: a forward hook on every adapted linear adds the adapter's term for
    the rows (batch entries) grouped in ``self.groups``, which the runner sets before each forward."""

    def __init__(self, model):
        self.groups: list[tuple[Adapter, torch.Tensor | None]] = []
        self._handles = [m.register_forward_hook(self._hook(name)) for name, m in _linears(model).items()]

    def _hook(self, name: str):
        def hook(_mod, args, out):
            if not self.groups:
                return None
            x = args[0]
            for ad, idx in self.groups:
                ab = ad.modules.get(name)
                if ab is not None:
                    add_delta(out, x, ab[0].t(), ab[1].t(), idx)
            return out
        return hook

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def fused_layers(ad: Adapter, model, q_scale: float) -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """The fast path's form: per layer, ``qkv``/``o``/``gate_up``/``down`` → ``(Aᵀ, Bᵀ)`` matching its fused,
    pre-transposed projections (``B`` block-diagonal over the fused outputs; the query block carries the
    softmax scale the fast path folds into its query weight)."""
    layers = []
    for li, layer in enumerate(model.model.layers):
        pre = f"model.layers.{li}."
        a, m = layer.self_attn, layer.mlp
        groups = {"qkv": [("self_attn.q_proj", a.q_proj, q_scale), ("self_attn.k_proj", a.k_proj, 1.0),
                          ("self_attn.v_proj", a.v_proj, 1.0)],
                  "o": [("self_attn.o_proj", a.o_proj, 1.0)],
                  "gate_up": [("mlp.gate_proj", m.gate_proj, 1.0), ("mlp.up_proj", m.up_proj, 1.0)],
                  "down": [("mlp.down_proj", m.down_proj, 1.0)]}
        fused: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for key, projs in groups.items():
            outs = [p.weight.shape[0] for _, p, _ in projs]
            present = [(i, ad.modules[pre + n], s) for i, (n, _, s) in enumerate(projs)
                       if pre + n in ad.modules]
            if not present:
                continue
            a_t = torch.cat([ab[0] for _, ab, _ in present]).t().contiguous()
            b_t = a_t.new_zeros((a_t.shape[1], sum(outs)))
            r0 = 0
            for i, (_, b), s in present:
                col = sum(outs[:i])
                b_t[r0:r0 + b.shape[1], col:col + outs[i]] = (b * s).t()
                r0 += b.shape[1]
            fused[key] = (a_t, b_t)
        layers.append(fused)
    return layers
