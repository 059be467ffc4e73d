"""``engine.attn_impl``: which attention kernel the training engines run, and where each one can run.

Import-light (no torch): ``validate-config`` and every engine's initialisation apply the same rules, so a
plan the validator accepts is one the engines build, and an engine started some other way refuses the same
way. The kernels themselves are in :mod:`areal_cli.engines.ulysses` (HF-module engines) and
:mod:`areal_cli.engines.megatron.model` (mcore's core attention).
"""

from __future__ import annotations

import importlib.util

from areal_cli.errors import ConfigError, did_you_mean

PATH = "engine.attn_impl"
SDPA, EAGER, FLASH = "sdpa", "eager", "flash_attention_2"
ATTN_IMPLS = (SDPA, EAGER, FLASH)


def _installed(module: str) -> bool:
    # find_spec only looks at the import path: the CLI stays free of the package (and of torch)
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def flash_attn_installed() -> bool:
    return _installed("flash_attn")


def transformer_engine_installed() -> bool:
    return _installed("transformer_engine")


def refusal(impl: str, engine: str, device: str, bf16_compute: bool = True) -> ConfigError | None:
    """Why ``engine`` cannot run ``impl`` on ``device`` ("cpu" or "cuda"), or None. ``bf16_compute``: the
    engine computes in bf16 (megatron: engine.dtype=bfloat16)."""
    if impl not in ATTN_IMPLS:
        return ConfigError(PATH, f"unknown value '{impl}'",
                           f"{did_you_mean(str(impl), ATTN_IMPLS)}choose one of: {', '.join(ATTN_IMPLS)}")
    if impl != FLASH:
        return None
    if device != "cuda":
        return ConfigError(PATH, f"{FLASH} runs on CUDA devices only, and this run's device is {device}",
                           f"set {PATH}={SDPA} (or {EAGER}), or train on CUDA (cluster.device=cuda)")
    if not flash_attn_installed():
        return ConfigError(PATH, f"{FLASH} needs the flash_attn package, which is not installed",
                           f"pip install flash-attn on the training nodes, or set {PATH}={SDPA}")
    if engine == "megatron" and not transformer_engine_installed():
        return ConfigError(PATH, f"engine=megatron runs {FLASH} only through TransformerEngine's layer spec "
                           "(mcore's AttnBackend.flash); its local spec has no flash kernel, and "
                           "transformer_engine is not installed",
                           f"set {PATH}={SDPA} or {EAGER}, or install transformer-engine")
    if engine == "megatron" and not bf16_compute:
        # the HF engines cast around flash-attn; mcore hands TE its activations as they are
        return ConfigError(PATH, f"engine=megatron runs {FLASH} through TransformerEngine's flash backend, which "
                           "takes bf16/fp16 only, and this run computes in fp32",
                           f"set engine.dtype=bfloat16, or {PATH}={SDPA}")
    return None


def check(impl: str, engine: str, device: str, bf16_compute: bool = True) -> None:
    """Raise :func:`refusal`'s error, if any."""
    err = refusal(impl, engine, device, bf16_compute)
    if err is not None:
        raise err
