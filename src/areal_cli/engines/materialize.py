"""Sharded model materialisation for the HF-module engines (FSDP, Archon): build on the meta device,
parallelise, then load so that each rank reads and holds only its shard.

The order is torchtitan's: :func:`meta_model` builds the module tree with parameters on the meta device
(buffers are real: rotary ``inv_freq`` and other non-persistent state are computed from the config at
construction, exactly as ``from_pretrained`` computes them); the engine applies TP, pipelining and FSDP to
that tree; :func:`load_sharded` allocates every rank's local shards (``to_empty``) and fills them from the
checkpoint, one parameter at a time:

- a parameter sharded on dim 0 only (FSDP, expert parallelism, column-wise TP, any nesting of those) reads
  only the rows of its local shard from disk, as positioned reads;
- one sharded along another dim (row-wise TP) reads its tensor once, keeps its slice and drops the rest
  (``distribute_tensor(..., src_data_rank=None)``: each rank slices its own copy, no collective).

So a rank's peak is its shards plus one tensor. Parameters the checkpoint does not hold (a LoRA adapter, a
critic's new value head) are initialised on the host before sharding, the same on every rank under the
engine's seed, and loaded like checkpoint tensors. Fused experts (transformers' ``experts.gate_up_proj``
``[E, 2I, H]`` and ``experts.down_proj``) are assembled from the checkpoint's per-expert tensors, only the
experts the rank holds.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Callable

import torch

_EXPERT = re.compile(r"^(.*\.experts\.)(gate_up_proj|down_proj)$")


@contextlib.contextmanager
def _meta_parameters():
    """Parameters go to the meta device as modules register them; buffers stay real."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        yield


def meta_model(hf_config: Any, dtype: torch.dtype, attn_implementation: str):
    """The HF causal LM of ``hf_config`` with meta parameters and real buffers."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from areal_cli.engines.vision import is_vl_config

    # a VL model (vision tower + language model) is an image-text-to-text model, not a causal LM to transformers
    auto = AutoModelForImageTextToText if is_vl_config(hf_config) else AutoModelForCausalLM
    with _meta_parameters():
        model = auto.from_config(hf_config, dtype=dtype, attn_implementation=attn_implementation)
    # The context re-registers every parameter it sees, so the tie made at construction was cut: make it again.
    model.tie_weights()
    return model


def materialise_lora(model: torch.nn.Module, adapter_name: str, init: Any) -> None:
    """Give a LoRA adapter injected into a meta model real host tensors, initialised as peft initialises
    them (peft moved them to the base layer's meta device)."""
    for m in model.modules():
        if hasattr(m, "lora_A") and adapter_name in getattr(m, "lora_A", {}):
            m.lora_A[adapter_name].to_empty(device="cpu")
            m.lora_B[adapter_name].to_empty(device="cpu")
            with torch.no_grad():
                m.reset_lora_parameters(adapter_name, init)


def host_state(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The parameters that already hold values (not meta: initialised here, not in the checkpoint) and every
    buffer, as host copies keyed by name: what :func:`load_sharded` puts back after ``to_empty``."""
    fresh = {n: p.detach().clone() for n, p in model.named_parameters() if not p.is_meta}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers() if not b.is_meta}
    return fresh, buffers


def checkpoint_name(name: str) -> str:
    """The checkpoint's name of a module-tree parameter: LoRA wraps a projection as ``base_layer``."""
    return name.replace(".base_layer.", ".")


class _Source:
    """Reads one parameter's full tensor, or rows of its dim 0, from the checkpoint or the host state."""

    def __init__(self, name: str, ck: Any, fresh: dict[str, torch.Tensor]):
        self.name = name
        self.ck = ck
        self.fresh = fresh.get(name)
        self.key = checkpoint_name(name)
        if self.key not in ck:  # a VL model's module tree names vs the hub checkpoint's (engines/vision.py)
            from areal_cli.engines.vision import hub_name

            if hub_name(self.key) in ck:
                self.key = hub_name(self.key)
        self.expert = _EXPERT.match(self.key) if self.fresh is None and self.key not in ck else None
        if self.fresh is None and self.key not in ck and self.expert is None:
            from areal_cli.errors import ConfigError

            raise ConfigError("model.path", f"{ck.path} has no tensor {self.key!r} for parameter {name!r}",
                              "point model.path at a checkpoint of the same architecture")

    def rows(self, idx: list[int]) -> torch.Tensor:
        if self.fresh is not None:
            return self.fresh[idx]
        if self.expert is not None:
            return torch.stack([self._expert(j) for j in idx])
        runs, out = _runs(idx), []
        for lo, hi in runs:
            out.append(self.ck.get_rows(self.key, lo, hi))
        return out[0] if len(out) == 1 else torch.cat(out)

    def full(self, n_rows: int) -> torch.Tensor:
        if self.fresh is not None:
            return self.fresh
        if self.expert is not None:
            return self.rows(list(range(n_rows)))
        return self.ck.get(self.key)

    def _expert(self, j: int) -> torch.Tensor:
        base, kind = self.expert.group(1), self.expert.group(2)
        if kind == "down_proj":
            return self.ck.get(f"{base}{j}.down_proj.weight")
        return torch.cat([self.ck.get(f"{base}{j}.gate_proj.weight"), self.ck.get(f"{base}{j}.up_proj.weight")])


def _runs(idx: list[int]) -> list[tuple[int, int]]:
    """Sorted contiguous ``[lo, hi)`` runs of an increasing index list."""
    runs: list[tuple[int, int]] = []
    for i in idx:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _dim0_only(placements) -> bool:
    from torch.distributed.tensor import Replicate

    return all(isinstance(p, Replicate) or getattr(p, "dim", None) == 0 for p in placements)


def _fill(p: torch.Tensor, src: _Source) -> None:
    """Copy ``src`` into parameter (or buffer) ``p``: a plain tensor whole, a DTensor its local shard."""
    if not hasattr(p, "to_local"):
        p.copy_(src.full(p.shape[0] if p.dim() else 0).to(p.dtype))
        return
    from torch.distributed.tensor import distribute_tensor

    local = p.to_local()
    if local.numel() == 0:
        return
    if p.dim() and _dim0_only(p.placements):
        # Which rows this rank holds, under any nesting of dim-0 shardings: shard an index vector the same way.
        ids = distribute_tensor(torch.arange(p.shape[0]), p.device_mesh, p.placements, src_data_rank=None)
        rows = ids.to_local().tolist()
        local.copy_(src.rows(rows).to(local.dtype))
        return
    full = src.full(p.shape[0]).to(p.dtype)
    local.copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local())


def _to_empty(mod: torch.nn.Module, device) -> None:
    """``mod.to_empty(device)``, keeping what the module tree had:

    - shared parameters (tied embeddings): a plain meta parameter is replaced by a new ``Parameter`` in each
      module that holds it, which would cut the tie, so every holder gets the first one's again;
    - what was attached to a parameter: a DTensor parameter is swapped with its new storage
      (``torch.utils.swap_tensors``), which takes its ``__dict__`` along, and with it the flags and hooks the
      parallelisation registered on it (TP's gradient re-layout hook is a post-accumulate-grad hook, whose
      C++ half stays with the old storage until the hook dict is assigned again).
    """
    holders: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for m in mod.modules():
        for name, p in m._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((m, name))
    saved = [(p, dict(p.__dict__), p._post_accumulate_grad_hooks) for p in mod.parameters()]
    mod.to_empty(device=device)
    for places in holders.values():
        first = getattr(places[0][0], places[0][1])
        for m, name in places[1:]:
            if getattr(m, name) is not first:
                setattr(m, name, first)
    for old, attrs, hooks in saved:
        m, name = holders[id(old)][0]
        p = getattr(m, name)
        for k, v in attrs.items():
            # accelerate's meta construction leaves a stale "requires_grad" entry in the dict (the flag
            # itself lives on the tensor, and LoRA freezing changed it since): never write it back
            if k not in p.__dict__ and k != "requires_grad":
                setattr(p, k, v)
        if hooks:
            p._post_accumulate_grad_hooks = None
            p._post_accumulate_grad_hooks = hooks


def load_sharded(modules: list[torch.nn.Module], ck: Any, fresh: dict[str, torch.Tensor],
                 buffers: dict[str, torch.Tensor], device: torch.device | str | None = None,
                 names: Callable[[str], bool] | None = None) -> None:
    """Fill ``modules`` (the model, or its pipeline stages, whose parameter names are the HF ones) from
    ``ck`` (an :class:`~areal_cli.weight_sync.hf_io.HFCheckpoint`) and the host state of
    :func:`host_state`. ``device``: allocate the local shards there first (``to_empty``; None: the
    parameters already hold memory, as when loading a new checkpoint into a trained engine). ``names``:
    only the parameters it accepts (the rest keep their values)."""
    with torch.no_grad():
        for mod in modules:
            if device is not None:
                _to_empty(mod, device)
            for name, p in mod.named_parameters():
                if names is None or names(name):
                    _fill(p, _Source(name, ck, fresh))
            if device is not None:
                for name, b in mod.named_buffers():
                    if name in buffers:
                        b.copy_(buffers[name].to(b.dtype))
