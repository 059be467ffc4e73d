"""LoRA for the training engines: peft adapters injected into the HF module tree.

The adapters are injected with peft's ``inject_adapter_in_model`` (not ``get_peft_model``), so the
module tree, and with it every parameter name outside the adapted projections, stays the HF one:
FSDP, Archon's pipeline cutting and the checkpoint code see the same model plus, inside each targeted
projection, ``base_layer`` (the frozen HF linear) and ``lora_A``/``lora_B``. Only ``lora_A``/``lora_B``
require gradients, so the optimizer (built over trainable parameters) holds state for them alone.

What the engines use from here:

- :func:`inject` — build the peft ``LoraConfig`` from ``model.lora`` and inject it (called before any
  sharding, so every rank draws the same initial ``lora_A`` under the same seed).
- :func:`merged_stream` — turn the engine's ``(name, full tensor)`` stream into HF names with
  ``W + scaling · B·A`` merged: HF export and full weight pushes write a plain HF model any server loads.
- :func:`adapter_names` / :func:`peft_key` — the adapter's own tensors under peft's file keys
  (``base_model.model.<module>.lora_A.weight``), for adapter-only pushes and the adapter dir.
- :func:`adapters_disabled` and :class:`ReferenceView` — the KL reference is the same model with the
  adapter switched off, not a second copy of the weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from areal_cli.weight_sync.adapter_files import ADAPTER_NAME

if TYPE_CHECKING:
    from areal_cli.config.model import LoRAConfig


def enabled(lora_cfg: LoRAConfig | None) -> bool:
    return lora_cfg is not None and int(getattr(lora_cfg, "rank", 0)) > 0


def is_lora_name(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def peft_config(lora_cfg: LoRAConfig, model_config: Any):
    """peft's ``LoraConfig`` for ``model.lora`` on a model of ``model_config``'s family."""
    from peft import LoraConfig

    from areal_cli.config.model import lora_target_modules

    experts = getattr(model_config, "num_experts", 0) or getattr(model_config, "num_local_experts", 0)
    moe = int(experts or 0) > 0
    targets = lora_target_modules(lora_cfg.target_modules, getattr(model_config, "model_type", None), moe=moe)
    return LoraConfig(r=int(lora_cfg.rank), lora_alpha=float(lora_cfg.alpha),
                      lora_dropout=float(lora_cfg.dropout),
                      target_modules=_targets(targets, model_config), bias="none", task_type="CAUSAL_LM")


def _targets(names: tuple[str, ...], model_config: Any) -> Any:
    """peft's ``target_modules``: the projection names, or for a vision-language model a pattern peft
    full-matches against module paths that holds them to the language model: the tower's MLP has
    ``gate_proj``/``up_proj``/``down_proj`` too, and wrapping it would adapt the vision encoder."""
    from areal_cli.engines.vision import is_vl_config

    if not is_vl_config(model_config):
        return list(names)
    return r"model\.language_model\..*\.(" + "|".join(sorted(names)) + ")"



def inject(model: torch.nn.Module, lora_cfg: LoRAConfig):
    """Inject the adapter into ``model`` in place and freeze everything else. Returns the peft config."""
    from peft import inject_adapter_in_model

    pc = peft_config(lora_cfg, model.config)
    inject_adapter_in_model(pc, model, adapter_name=ADAPTER_NAME)
    n_adapted = 0
    for name, p in model.named_parameters():
        p.requires_grad_(is_lora_name(name))
        n_adapted += is_lora_name(name)
    if n_adapted == 0:
        from areal_cli.errors import ConfigError

        raise ConfigError("model.lora.target_modules", f"no module of {type(model).__name__} matched "
                          f"{sorted(pc.target_modules)}", "name projections this model has, or use auto")
    pc.base_model_name_or_path = getattr(model.config, "_name_or_path", None)
    return pc


def scaling(pc: Any) -> float:
    return float(pc.lora_alpha) / float(pc.r)


def merged_stream(named: Iterator[tuple[str, Any]], pc: Any) -> Iterator[tuple[str, Any]]:
    """``(name, tensor | None)`` with adapters merged into their base weights, under HF names.

    Consumes the engine's stream in its order (gathers are collectives, every rank drives the same
    iteration); for an adapted projection the stream carries ``base_layer.weight``, then ``lora_A``,
    then ``lora_B``, and the merged weight is yielded once ``lora_B`` arrived. Ranks without tensors
    (``None``) yield ``None`` under the same names. The merge runs in fp32 and is cast back."""
    s = scaling(pc)
    pending: dict[str, dict[str, Any]] = {}
    for name, t in named:
        if ".base_layer." in name:
            prefix, leaf = name.split(".base_layer.", 1)
            if leaf != "weight":
                yield f"{prefix}.{leaf}", t
                continue
            pending[prefix] = {"W": t}
        elif ".lora_A." in name:
            pending[name.split(".lora_A.", 1)[0]]["A"] = t
        elif ".lora_B." in name:
            prefix = name.split(".lora_B.", 1)[0]
            part = pending.pop(prefix)
            w, a = part["W"], part["A"]
            if w is None:
                yield f"{prefix}.weight", None
                continue
            merged = w.float() + s * (t.float().to(w.device) @ a.float().to(w.device))
            yield f"{prefix}.weight", merged.to(w.dtype)
        else:
            yield name, t
    if pending:
        raise RuntimeError(f"LoRA merge: no lora_B arrived for {sorted(pending)[:3]} (stream out of order)")


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module):
    """Run ``model`` as its base: every LoRA layer skips its adapter. peft's public ``enable_adapters``
    also flips ``requires_grad`` on the adapter weights, which must not change under FSDP2 after
    sharding; the layers' own switch (``_disable_adapters``, what the public one sets) is used instead."""
    from peft.tuners.lora import LoraLayer

    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    before = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, b in zip(layers, before):
            m._disable_adapters = b


class ReferenceView:
    """The KL reference of a LoRA policy: the policy engine's model with the adapter disabled.

    Implements the part of :class:`~areal_cli.api.engine_api.TrainEngine` a reference is used for
    (``forward``); it owns no weights, so ``destroy`` is a no-op."""

    def __init__(self, engine: Any):
        self.engine = engine

    @torch.no_grad()
    def forward(self, batch, output: str = "logprobs", temperature: float = 1.0):
        with adapters_disabled(self.engine.model):
            return self.engine.forward(batch, output=output, temperature=temperature)

    def destroy(self) -> None:
        return None
