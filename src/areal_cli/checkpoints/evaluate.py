"""``areal eval``: held-out evaluation of one checkpoint, the way the run evaluated itself.

The run's saved config (``config.yaml``) supplies the workflow, the reward, the eval split
(``dataset.*``, ``dataset.eval_size``) and the generation settings (``rollout.eval_gconfig``,
``trainer.eval_n_samples``); command-line overrides change them (``dataset.test_size=500``,
``dataset=gsm8k``, ``rollout.eval_gconfig.max_new_tokens=64``; ``eval_gconfig.X`` is short for
``rollout.eval_gconfig.X``). A checkpoint outside any run takes the composed default config plus the
overrides. The scoring is the trainer's own (``trainer/evaluation.py``), so the figures mean the same.

Where it generates: a server this command starts on the checkpoint (``--backend``, the built-in ``hf``
by default; its command line is the run's own server command, ``launchers/local.server_argv``), stopped
afterwards; or a server that is already running (``--server URL``: a GPU vLLM or SGLang server, or
any server of those protocols), which must serve the checkpoint being scored. A recover state is first
exported to a temporary HF dir (``export.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from areal_cli.checkpoints.locate import CheckpointError, Source
from areal_cli.errors import ConfigError, InferenceError

if TYPE_CHECKING:
    from areal_cli.config.schema import ExperimentConfig

ALIASES = {"eval_gconfig.": "rollout.eval_gconfig."}
SWAPPABLE_GROUPS = ("dataset", "workflow")  # groups whose option an evaluation may replace


def load_eval_config(src: Source, overrides: list[str]) -> Any:
    """The run's saved config with ``overrides`` applied (or the default config for a lone HF dir)."""
    overrides = [_alias(o) for o in overrides]
    if src.run_dir is None:
        from areal_cli.plan.compose import load_config

        return load_config(overrides)
    from areal_cli.config.io import load_config_file

    return apply_overrides(load_config_file(src.run_dir / "config.yaml"), overrides)


def _alias(o: str) -> str:
    for short, full in ALIASES.items():
        if o.startswith(short):
            return full + o[len(short):]
    return o


def apply_overrides(cfg: ExperimentConfig, overrides: list[str]) -> ExperimentConfig:
    """``key.path=value`` onto a typed config; ``group=option`` for :data:`SWAPPABLE_GROUPS` replaces that
    section by the option's file (on the schema's defaults, as composing it would)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from areal_cli.plan.compose import split_override
    from areal_cli.plan.groups import GROUPS, find_option, group_options
    from areal_cli.errors import did_you_mean

    conf = OmegaConf.structured(cfg)
    dotted: list[str] = []
    for o in overrides:
        prefix, key, value = split_override(o)
        if prefix:
            raise ConfigError(key, f"'{o}': areal eval takes plain key=value overrides",
                              f"write {key}={value}")
        if "." in key:
            dotted.append(f"{key}={value}")
            continue
        if key in GROUPS and key not in SWAPPABLE_GROUPS:
            raise ConfigError(key, f"an evaluation keeps the run's {key} (it decides what the checkpoint is)",
                              f"override only {', '.join(SWAPPABLE_GROUPS)} groups or key.path=value settings")
        if key in SWAPPABLE_GROUPS:
            f = find_option(key, value)
            if f is None:
                opts = group_options().get(key, [])
                raise ConfigError(key, f"unknown option {value!r}", f"{did_you_mean(value, opts)}use one of: "
                                  f"{', '.join(opts)}")
            data = OmegaConf.load(str(f))
            data = {k: v for k, v in OmegaConf.to_container(data).items() if k != "defaults"}
            try:
                fresh = OmegaConf.merge(OmegaConf.structured(type(getattr(cfg, key))), data)
            except OmegaConfBaseException as e:
                raise ConfigError(key, f"option {value!r} does not fit: {e}", "check the option file") from e
            conf[key] = fresh
            continue
        dotted.append(f"{key}={value}")
    try:
        conf = OmegaConf.merge(conf, OmegaConf.from_dotlist(dotted))
    except OmegaConfBaseException as e:
        path = getattr(e, "full_key", "") or (dotted[0].split("=")[0] if dotted else "override")
        raise ConfigError(path, f"{str(e).splitlines()[0]}", "check the key's spelling and type "
                          "(`areal train --cfg job` shows every key)") from e
    return OmegaConf.to_object(conf)


def detect_backend(address: str) -> str:
    """``sglang`` (SGLang or the built-in hf server: SGLang's protocol, ``/model_info``) or ``vllm``
    (``/v1/models`` only)."""
    import httpx

    base = address if address.startswith(("http://", "https://")) else f"http://{address}"
    try:
        if httpx.get(f"{base}/model_info", timeout=10).status_code == 200:
            return "sglang"
        if httpx.get(f"{base}/v1/models", timeout=10).status_code == 200:
            return "vllm"
    except httpx.HTTPError as e:
        raise InferenceError(f"--server {address}: no answer ({type(e).__name__}) — fix: start the server first, "
                             "or check the address (host:port)") from e
    raise InferenceError(f"--server {address} answers neither /model_info (SGLang, hf) nor /v1/models (vLLM) — "
                         "fix: pass --backend sglang|vllm|hf")


class _Server:
    """A server on the checkpoint, started like the run's own (``launchers/local.server_argv``)."""

    def __init__(self, cfg: ExperimentConfig, model_dir: str, backend: str, log_dir: str):
        from areal_cli.job.layout import ServerSpec
        from areal_cli.launchers.local import base_env, server_argv
        from areal_cli.utils.network import find_free_port
        from areal_cli.utils.procs import ManagedProcess

        port = find_free_port("127.0.0.1")
        argv, env = server_argv(cfg, ServerSpec(index=0, backend=backend), port, model_dir, "127.0.0.1", log_dir)
        full = base_env(cfg.cluster.device)
        full.update(env)
        full.update({k: str(v) for k, v in cfg.launcher.server_env.items()})
        self.address = f"127.0.0.1:{port}"
        self.log_path = os.path.join(log_dir, f"eval_{backend}_server.log")
        self.proc = ManagedProcess(name="eval-server", argv=argv, log_path=self.log_path, env=full).start()
        self.timeout_s = float(cfg.launcher.server_startup_timeout_s)

    def wait(self) -> None:
        from areal_cli.inference.launch import wait_until_ready

        wait_until_ready(self.address, self.timeout_s, self.proc, self.log_path)

    def stop(self) -> None:
        self.proc.stop(timeout=10)


def eval_items(cfg: ExperimentConfig, tokenizer: Any) -> list[dict]:
    from areal_cli.data.datasets import load_split

    split = load_split(cfg.dataset, tokenizer, "test", seed=cfg.seed)
    if split is None:
        raise ConfigError("dataset.test_path", "the dataset has no held-out split to evaluate on",
                          "set dataset.test_path=FILE, or dataset.test_fraction=0.05 to hold out train rows")
    items = split[0]
    return items[: cfg.dataset.eval_size] if cfg.dataset.eval_size else items


def run_eval(target: str, overrides: list[str], *, step: int | None = None, server: str | None = None,
             backend: str | None = None, output: str | None = None, fileroot: str | None = None,
             progress: Any = None) -> dict[str, Any]:
    """Evaluate the checkpoint ``target`` means; returns the result (also written to the samples file).
    ``progress(done, total)`` is called as completions are scored."""
    from areal_cli.checkpoints.locate import pinned

    work = tempfile.mkdtemp(prefix="areal_eval_")
    try:
        with pinned(target, step=step, fileroot=fileroot) as src:  # a running run may prune it meanwhile
            cfg = load_eval_config(src, overrides)
            model_dir = src.path
            if src.kind == "recover":
                from areal_cli.checkpoints.export import export_source

                model_dir = Path(work) / "model"
                export_source(src, str(model_dir), merge=int(cfg.model.lora.rank) > 0)
            elif src.adapter_dir == src.path:
                raise CheckpointError(f"{src.shown} is a LoRA adapter alone — fix: evaluate its run's checkpoint "
                                      "(which holds the merged model), or `areal export --merge-lora` it first")
            result = _evaluate(cfg, src, str(model_dir), server, backend, work, progress)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    path = Path(output) if output else default_output(src)
    path.parent.mkdir(parents=True, exist_ok=True)
    samples = result.pop("samples")
    result["samples_file"] = str(path)
    path.write_text(json.dumps({**result, "samples": samples}, indent=1, default=str))
    return result


def default_output(src: Source) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = src.name.replace("/", "_") or src.shown.name
    if src.run_dir is not None:
        return src.run_dir / "evals" / f"{name}-{stamp}.json"
    return Path.cwd() / f"areal_eval_{src.shown.name}-{stamp}.json"


def _evaluate(cfg: ExperimentConfig, src: Source, model_dir: str, server: str | None, backend: str | None,
              work: str, progress: Any) -> dict[str, Any]:
    from areal_cli.rollout import build
    from areal_cli.trainer.evaluation import evaluate_on_servers

    tokenizer = build.build_tokenizer(model_dir)
    items = eval_items(cfg, tokenizer)
    n_samples = int(cfg.trainer.eval_n_samples)
    total = len(items) * (1 + (n_samples if n_samples > 1 else 0))
    started = None
    if server:
        address, backend = server, backend or detect_backend(server)
    else:
        started = _Server(cfg, model_dir, backend or "hf", work)
        address, backend = started.address, backend or "hf"
    reward_fn = build.build_reward_fn(cfg, [address])
    samples: dict = {}
    try:
        if started is not None:
            started.wait()
        done = [0]

        def scored(_key: Any) -> None:
            done[0] += 1
            if progress is not None:
                progress(done[0], total)

        # base=True: the served model is the checkpoint itself (a LoRA run's export holds it merged), so
        # requests name no adapter.
        metrics = evaluate_on_servers(cfg, [address], "hf" if backend == "hf" else backend, tokenizer, items,
                                      reward_fn=reward_fn, samples=samples, on_scored=scored, base=True)
    finally:
        if started is not None:
            started.stop()
        close = getattr(reward_fn, "close", None)
        if callable(close):
            close()
    acc = metrics.get("eval/pass@1")
    return {"checkpoint": str(src.shown), "kind": src.kind, "run_dir": str(src.run_dir) if src.run_dir else None,
            "step": src.step, "server": server or f"{backend} (started on the checkpoint)", "backend": backend,
            "n": len(items), "accuracy": acc, "accuracy_pct": None if acc is None else round(100 * acc, 2),
            "reward_mean": metrics.get("eval/reward_mean"), "metrics": metrics,
            "samples": [samples[k] for k in sorted(samples)]}
