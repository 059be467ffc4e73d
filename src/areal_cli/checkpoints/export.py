"""``areal export``: a run's checkpoint as a directory ``transformers``, vLLM and SGLang load.

- an HF export (``checkpoints/<name>``): its files are copied as they are (weights shard by shard,
  with their index, ``config.json``, ``generation_config.json``, tokenizer files);
- under LoRA the adapter in peft's layout (``adapter_config.json`` + ``adapter_model.safetensors``, the
  base named in ``base_model_name_or_path``) with a ``README.md`` saying how to load it, or with
  ``merge_lora`` the base with the adapter merged in (``W + scaling·B·A``, what peft's
  ``merge_and_unload`` computes), written one tensor at a time;
- a recover state when the run has no HF export: the fsdp and archon engines save torch DCP, which
  is read here one shard-sized group of tensors at a time on the CPU; deepspeed and megatron states are
  in their engine's own layout and are refused in one line.

The result is written under ``<DIR>.partial-<pid>`` and renamed when complete.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from areal_cli.checkpoints.locate import CheckpointError, Source, engine_name, policy_base
from areal_cli.errors import ConfigError
from areal_cli.weight_sync.adapter_files import ADAPTER_CONFIG, ADAPTER_FILE

HF_EXTRA_FILES = ("config.json", "generation_config.json")
ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_FILE)


def _saves_dcp(engine: str) -> bool:
    """Whether ``engine``'s recover state is torch DCP under HF parameter names (its spec's ``dcp_checkpoint``)."""
    from areal_cli.engines import engine_names, get_engine_spec

    return engine in engine_names() and get_engine_spec(engine).dcp_checkpoint


def check_destination(to: Path, force: bool, src: Source) -> None:
    if to.exists() and not to.is_dir():
        raise CheckpointError(f"--to {to} is a file — fix: name a directory")
    s, d = src.shown.resolve(), to.resolve()
    if d == s or d in s.parents or (src.run_dir is not None and d == src.run_dir.resolve()):
        raise CheckpointError(f"--to {to} holds the checkpoint being exported — fix: name another directory")
    if to.is_dir() and any(to.iterdir()) and not force:
        raise CheckpointError(f"--to {to} is not empty — fix: name a new or empty directory, or pass --force "
                              "to replace its contents")


def _tmp_dir(to: Path) -> Path:
    tmp = to.parent / f".{to.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def _publish(tmp: Path, to: Path) -> None:
    if to.exists():
        shutil.rmtree(to)
    os.replace(tmp, to)


def _copy_tokenizer_and_config(src: Path, dst: Path, *, config: bool = True) -> None:
    from areal_cli.weight_sync.hf_io import copy_tokenizer

    if config:
        for name in HF_EXTRA_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, dst / name)
    copy_tokenizer(src, dst)


def copy_hf_dir(src: Path, dst: Path) -> list[str]:
    """The model files of an HF export (weights with their index, configs, tokenizer): no adapter subdir,
    no critic value head. Shards are copied one file at a time."""
    from areal_cli.weight_sync.hf_io import INDEX_FILE

    weights = sorted(src.glob("model*.safetensors"))
    if not weights:
        raise CheckpointError(f"{src} has no model*.safetensors — fix: export another checkpoint of the run "
                              "(`areal export RUN --step N`)")
    for f in [*weights, src / INDEX_FILE]:
        if f.is_file():
            shutil.copy2(f, dst / f.name)
    _copy_tokenizer_and_config(src, dst)
    return [f.name for f in weights]


# ------------------------------------------------------------------------------------------------ LoRA
def _adapter_scaling(conf: dict) -> float:
    r, alpha = float(conf["r"]), float(conf.get("lora_alpha", conf["r"]))
    return alpha / (r ** 0.5) if conf.get("use_rslora") else alpha / r


def _adapter_pairs(adapter_dir: Path) -> tuple[dict[str, tuple[Any, Any]], float]:
    """``{base weight name: (A, B)}`` and the scaling, from a peft adapter dir."""
    from safetensors.torch import load_file

    conf = json.loads((adapter_dir / "adapter_config.json").read_text())
    tensors = load_file(str(adapter_dir / "adapter_model.safetensors"))
    pairs: dict[str, list[Any]] = {}
    for key, t in tensors.items():
        for part, slot in ((".lora_A.weight", 0), (".lora_B.weight", 1)):
            if key.endswith(part):
                module = key[:-len(part)].removeprefix("base_model.model.")
                pairs.setdefault(f"{module}.weight", [None, None])[slot] = t
    broken = [k for k, v in pairs.items() if v[0] is None or v[1] is None]
    if broken or not pairs:
        raise CheckpointError(f"{adapter_dir}: not a complete LoRA adapter (no lora_A/lora_B pair for "
                              f"{broken[:3] or 'any module'}) — fix: export another checkpoint of the run")
    return {k: (a, b) for k, (a, b) in pairs.items()}, _adapter_scaling(conf)


def merge_lora(base_dir: Path, adapter_dir: Path, dst: Path) -> list[str]:
    """The base model with the adapter merged in, read and written one tensor at a time: the merge runs in
    fp32 and is cast back to the base tensor's dtype, as the engines merge for their HF export."""
    from transformers import AutoConfig

    from areal_cli.weight_sync.hf_io import HFCheckpoint, stream_hf_dir

    pairs, s = _adapter_pairs(adapter_dir)
    config = AutoConfig.from_pretrained(str(base_dir))
    base = HFCheckpoint(base_dir)
    missing = [k for k in pairs if k not in base]
    if missing:
        raise CheckpointError(f"the adapter in {adapter_dir} adapts {missing[:3]}, which the base {base_dir} "
                              "lacks — fix: the adapter belongs to another base model; pass its run's checkpoint")

    def merged():
        for name in base.names():
            w = base.get(name)
            if name in pairs:
                a, b = pairs[name]
                w = (w.float() + s * (b.float() @ a.float())).to(w.dtype)
            yield name, w

    stream_hf_dir(dst, merged(), config, architectures=list(config.architectures or []) or None)
    _copy_tokenizer_and_config(base_dir, dst, config=False)
    if (base_dir / "generation_config.json").is_file():
        shutil.copy2(base_dir / "generation_config.json", dst / "generation_config.json")
    return sorted(p.name for p in dst.glob("model*.safetensors"))


LOAD_NOTE = """# LoRA adapter exported by `areal export`

peft's layout: `adapter_config.json` + `adapter_model.safetensors`, for the base model
`{base}`.

transformers + peft:

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from peft import PeftModel
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("{base}"), "{dir}")
    tokenizer = AutoTokenizer.from_pretrained("{dir}")

vLLM: `vllm serve {base} --enable-lora --max-lora-rank {rank} --lora-modules policy={dir}`
(requests name the model `policy`).
SGLang: `python -m sglang.launch_server --model-path {base} --enable-lora --max-lora-rank {rank}
--lora-paths policy={dir}` (requests carry `"lora_path": "policy"`).

One merged model instead: `areal export {run} --to DIR --merge-lora`.
"""


def write_adapter(adapter_dir: Path, base: Path | str, dst: Path, to: Path, run: str) -> list[str]:
    """The adapter files, its base named by absolute path when that exists here, the tokenizer, a note."""
    for name in ADAPTER_FILES:
        shutil.copy2(adapter_dir / name, dst / name)
    conf = json.loads((dst / "adapter_config.json").read_text())
    conf["base_model_name_or_path"] = str(base)
    (dst / "adapter_config.json").write_text(json.dumps(conf, indent=2, sort_keys=True))
    tok_src = adapter_dir.parent if (adapter_dir.parent / "tokenizer_config.json").is_file() else Path(str(base))
    if tok_src.is_dir():
        _copy_tokenizer_and_config(tok_src, dst, config=False)
    (dst / "README.md").write_text(LOAD_NOTE.format(base=base, dir=to, rank=conf.get("r"), run=run))
    return list(ADAPTER_FILES)


def _adapter_base(src: Source, adapter_dir: Path) -> Path:
    """The base the adapter was trained on: its ``base_model_name_or_path`` when that dir exists, else the
    run's policy base (its SFT warm start, or the model it was launched with)."""
    conf = json.loads((adapter_dir / "adapter_config.json").read_text())
    named = conf.get("base_model_name_or_path")
    if named and Path(named).is_dir():
        return Path(named)
    base = policy_base(src.run_dir) if src.run_dir is not None else None
    if base is None:
        raise CheckpointError(f"the base model of the adapter in {adapter_dir} ({named!r}) is not on this "
                              "machine — fix: export on a machine that has it, or without --merge-lora")
    return base


# --------------------------------------------------------------------------------------------- recover
def _dcp_model_tensors(state_dir: Path) -> dict[str, Any]:
    """``{parameter name: (dtype, shape)}`` of a DCP state's model part."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(state_dir)).read_metadata()
    out = {}
    for key, md in meta.state_dict_metadata.items():
        if key.startswith("model.") and hasattr(md, "size"):
            out[key[len("model."):]] = (md.properties.dtype, tuple(md.size))
    return out


def _dcp_stream(state_dir: Path, names: list[str], specs: dict[str, Any], dtype: Any, batch_bytes: int):
    """``(name, tensor)`` read from DCP in groups of about ``batch_bytes`` (one DCP load per group)."""
    import torch
    import torch.distributed.checkpoint as dcp

    group: list[str] = []
    size = 0

    def load(group: list[str]):
        import warnings

        sd = {"model": {n: torch.empty(specs[n][1], dtype=specs[n][0]) for n in group}}
        with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process is the intent
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(sd, checkpoint_id=str(state_dir), no_dist=True)
        for n in group:
            t = sd["model"][n]
            yield n, (t.to(dtype) if dtype is not None and t.is_floating_point() else t)

    for n in names:
        dt, shape = specs[n]
        nbytes = dt.itemsize * int(torch.Size(shape).numel())
        if group and size + nbytes > batch_bytes:
            yield from load(group)
            group, size = [], 0
        group.append(n)
        size += nbytes
    if group:
        yield from load(group)


def export_recover(src: Source, dst: Path, *, merge: bool, to: Path, run: str) -> dict[str, Any]:
    """An HF dir (or an adapter, under LoRA) from a recover state of the fsdp or archon engine."""
    from areal_cli.engines.lora import is_lora_name
    from areal_cli.weight_sync.adapter_files import peft_key
    from areal_cli.weight_sync.hf_io import MAX_SHARD_BYTES, stream_hf_dir

    engine = engine_name(src.run_dir) or "?"
    if not _saves_dcp(engine):
        raise CheckpointError(
            f"{src.describe()} is in the {engine} engine's own checkpoint layout, which only that engine can "
            f"read back (it exports HF dirs itself) — fix: resume the run (resume=auto) with "
            f"trainer.save_every=N to get an HF export in checkpoints/, then `areal export` that")
    state_dir = src.path / "engine"
    specs = _dcp_model_tensors(state_dir)
    base = policy_base(src.run_dir) if src.run_dir is not None else None
    if base is None:
        raise CheckpointError(f"{src.describe()}: the run's model dir (launch.json model_path) is not on this "
                              "machine; its config and tokenizer are needed — fix: export where the run ran")
    from transformers import AutoConfig

    from areal_cli.engines.parallelize import torch_dtype
    from areal_cli.config.io import load_config_file

    cfg = load_config_file(src.run_dir / "config.yaml")
    dtype = torch_dtype(cfg.engine.dtype)
    lora = [n for n in specs if is_lora_name(n)]
    if lora:  # the state holds the adapter only; the base is the run's policy base
        from safetensors.torch import save_file

        from areal_cli.engines.lora import peft_config
        from areal_cli.weight_sync.adapter_files import config_dict

        adapter = dst / ".adapter"
        adapter.mkdir()
        pc = peft_config(cfg.model.lora, AutoConfig.from_pretrained(str(base)))
        pc.base_model_name_or_path = str(base)
        (adapter / "adapter_config.json").write_text(json.dumps(config_dict(pc), indent=2))
        tensors = dict(_dcp_stream(state_dir, lora, specs, None, MAX_SHARD_BYTES))
        save_file({peft_key(k): v.contiguous() for k, v in tensors.items()},
                  str(adapter / "adapter_model.safetensors"), metadata={"format": "pt"})
        try:
            if merge:
                files = merge_lora(base, adapter, dst)
            else:
                files = write_adapter(adapter, base, dst, to, run)
        finally:
            shutil.rmtree(adapter, ignore_errors=True)
        return {"files": files, "lora": "merged" if merge else "adapter", "base": str(base)}
    if merge:
        raise ConfigError("--merge-lora", f"run {src.run_dir} trained no LoRA adapter (model.lora.rank=0)",
                          "drop --merge-lora")
    config = AutoConfig.from_pretrained(str(base))
    names = list(specs)
    stream_hf_dir(dst, _dcp_stream(state_dir, names, specs, dtype, MAX_SHARD_BYTES), config,
                  architectures=list(config.architectures or []) or None, tokenizer_src=str(base), dtype=dtype)
    if (base / "generation_config.json").is_file():
        shutil.copy2(base / "generation_config.json", dst / "generation_config.json")
    return {"files": sorted(p.name for p in dst.glob("model*.safetensors")), "lora": None}


# ------------------------------------------------------------------------------------------------ main
def export(target: str, to: str, *, step: int | None = None, merge: bool = False, force: bool = False,
           fileroot: str | None = None) -> dict[str, Any]:
    """Write the checkpoint ``target`` means to ``to``; returns what was written."""
    from areal_cli.checkpoints.locate import pinned

    with pinned(target, step=step, fileroot=fileroot) as src:  # a running run may prune it meanwhile
        return export_source(src, to, merge=merge, force=force, run=target)


def export_source(src: Source, to: str, *, merge: bool = False, force: bool = False, run: str = "") -> dict[str, Any]:
    """Write checkpoint ``src`` to ``to``."""
    dest = Path(os.path.expanduser(to)).absolute()
    check_destination(dest, force, src)
    tmp = _tmp_dir(dest)
    try:
        if src.kind == "recover":
            info = export_recover(src, tmp, merge=merge, to=dest, run=run or str(src.shown))
        else:
            info = _export_hf(src, tmp, merge=merge, to=dest, run=run or str(src.shown))
        _publish(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"source": str(src.shown), "source_kind": src.kind, "step": src.step, "run_dir":
            str(src.run_dir) if src.run_dir else None, "to": str(dest), **info}


def _export_hf(src: Source, dst: Path, *, merge: bool, to: Path, run: str) -> dict[str, Any]:
    adapter = src.adapter_dir
    if adapter is None:
        if merge:
            raise ConfigError("--merge-lora", f"{src.shown} holds no LoRA adapter (the run trained every weight, "
                              "model.lora.rank=0)", "drop --merge-lora")
        return {"files": copy_hf_dir(src.path, dst), "lora": None}
    base = _adapter_base(src, adapter)
    if merge:
        return {"files": merge_lora(base, adapter, dst), "lora": "merged", "base": str(base)}
    return {"files": write_adapter(adapter, base, dst, to, run), "lora": "adapter", "base": str(base)}
