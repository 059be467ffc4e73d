"""A training engine and an inference backend added as a plugin: the test writes a temporary package with one
folder per backend (its torch-free spec) and one registry line each, names the module holding those lines in
``plugins=[...]``, and nothing in areal_cli changes. `areal validate-config` (the parser, the validator's
capability rules), the memory estimator and `areal train` (launcher, trainer ranks, rollout worker) all see
both backends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(400)

# The engine: a folder whose __init__ is its spec (no torch), and the class it names (FSDP2 that records the
# dims it was given, so the test sees the trainer built it by the plugin's name).
ENGINE_SPEC = '''
from areal_cli.api.backend_spec import FULL_SHARD, EngineSpec

SPEC = EngineSpec("ringfsdp", "demo_backends.ringfsdp.engine:RingEngine", "dc", lambda _: FULL_SHARD, None,
                  "FSDP2 under a plugin's name", lora="")  # declares no LoRA and no routing replay
'''
ENGINE_CLASS = '''
import json
import os

from areal_cli.engines.fsdp import FSDPEngine


class RingEngine(FSDPEngine):
    def initialize(self, parallel, model_path, **kwargs):
        with open(os.environ["AREAL_TEST_BACKEND_MARKER"], "a") as f:
            f.write(json.dumps({"kind": "engine", "pid": os.getpid(), "dp": parallel.dp}) + "\\n")
        return super().initialize(parallel, model_path, **kwargs)
'''
# The inference backend: the built-in hf server's protocol and command under another name, with its own facts.
SERVER_SPEC = '''
import json
import os

from areal_cli.api.backend_spec import InferenceBackendSpec
from areal_cli.inference.backends import hf
from areal_cli.inference.backends.hf import *  # noqa: F403  (it speaks the hf server's protocol)

NAME = "hfish"


def server_cmd(args):
    marker = os.environ.get("AREAL_TEST_BACKEND_MARKER")
    if marker:
        with open(marker, "a") as f:
            f.write(json.dumps({"kind": "server", "port": args.port}) + "\\n")
    return hf.server_cmd(args)


SPEC = InferenceBackendSpec(NAME, __name__, server_cmd, dims="d", summary="the hf server under a plugin's name",
                            mem_fraction=0.5, lora_broadcast=True, batch_generate=True)
'''
REGISTRY_LINES = '''
from areal_cli.engines import ENGINES
from areal_cli.inference.backends import INFERENCE_BACKENDS

ENGINES.declare("ringfsdp", "demo_backends.ringfsdp:SPEC")
INFERENCE_BACKENDS.declare("hfish", "demo_backends.hfish:SPEC")
'''
PROBE = ("import sys\nfrom areal_cli.cli.main import main\ncode = main(sys.argv[1:])\n"
         "sys.stderr.write('\\nTORCH=%s\\n' % ('torch' in sys.modules))\nsys.exit(code)\n")
PLUGIN = "plugins=[demo_backends.registry]"
BASE = [PLUGIN, "engine.name=ringfsdp", "allocation_mode=hfish:d1+ringfsdp:d1c2", "cluster.n_gpus_per_node=3"]


@pytest.fixture()
def plugin_dir(tmp_path: Path) -> Path:
    root = tmp_path / "plugin_src"
    pkg = root / "demo_backends"
    for rel, text in {"__init__.py": "", "registry.py": REGISTRY_LINES, "ringfsdp/__init__.py": ENGINE_SPEC,
                      "ringfsdp/engine.py": ENGINE_CLASS, "hfish/__init__.py": SERVER_SPEC}.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(textwrap.dedent(text).lstrip())
    return root


def _env(plugin_dir: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "NO_COLOR": "1",
           "COLUMNS": "200", "PYTHONPATH": os.pathsep.join([str(plugin_dir), os.environ.get("PYTHONPATH", "")])}
    env.pop("AREAL_PLUGINS", None)
    env.pop("AREAL_DEBUG", None)
    env.update(extra)
    return env


def validate(plugin_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROBE, "validate-config", *args], capture_output=True,
                          text=True, env=_env(plugin_dir), timeout=120, check=False)


def error_line(p: subprocess.CompletedProcess) -> str:
    assert p.returncode == 1, p.stdout + p.stderr
    assert "Traceback" not in p.stdout + p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip() and not ln.startswith("TORCH=")]
    # one line, and for an allocation spec the spec with a caret under the offending character
    assert len(lines) == 1 or (len(lines) == 3 and lines[2].strip() == "^"), p.stderr
    return lines[0]


def test_validate_config_plans_both_plugin_backends_without_torch(plugin_dir):
    p = validate(plugin_dir, *BASE, "--json")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "TORCH=False" in p.stderr
    plan = json.loads(p.stdout)
    assert plan["valid"] and plan["spec"] == "hfish:d1+ringfsdp:d1c2", plan["spec"]
    assert [i["backend"] for i in plan["inference"]] == ["hfish"]
    assert [t["backend"] for t in plan["train"]] == ["ringfsdp"]


@pytest.mark.parametrize("args,path,words", [
    # the parser reads each spec's dims
    (["allocation_mode=hfish:t2+ringfsdp:d1"], "allocation_mode.spec",
     ["hfish does not support tensor parallelism (t2)", "hfish supports d; drop t2"]),
    (["allocation_mode=hfish:d1+ringfsdp:d1t2"], "allocation_mode.spec",
     ["ringfsdp does not support tensor parallelism (t2)"]),
    # capabilities, not names: the plugin engine declares no LoRA and no routing replay
    (["model.lora.rank=8"], "model.lora.rank", ["the ringfsdp engine does not train LoRA adapters"]),
    (["model.num_experts=4", "model.num_experts_per_tok=2", "rollout.routing_replay=true"],
     "rollout.routing_replay", ["the ringfsdp engine cannot replay routing yet"]),
    # the plugin's names are listed among the registered ones
    (["allocation_mode=hfihs:d1+ringfsdp:d1"], "allocation_mode.spec", ["did you mean 'hfish'?", "ringfsdp"]),
    # a server that does not declare images (InferenceBackendSpec.images) is refused for visual data
    (["model=tiny_vl", "dataset.train_path=builtin:count_all", "engine.name=fsdp", "allocation_mode=hfish:d1+fsdp:d1"],
     "allocation_mode", ["hfish servers do not carry images", "use hf, sglang or vllm"]),
])
def test_validate_config_refuses_by_the_plugin_specs(plugin_dir, args, path, words):
    base = [a for a in BASE if not a.startswith("allocation_mode=")] + ["allocation_mode=hfish:d1+ringfsdp:d1c2"]
    overrides = {a.split("=", 1)[0]: a for a in base + args}
    line = error_line(validate(plugin_dir, *overrides.values()))
    assert f"{path}:" in line, line
    for w in words:
        assert w in line, line


@pytest.fixture()
def in_process_plugin(plugin_dir, monkeypatch):
    """The plugin importable here; afterwards its registrations, modules and AREAL_PLUGINS are gone again, so
    later tests in this process see only the built-in backends."""
    from areal_cli import registry
    from areal_cli.engines import ENGINES
    from areal_cli.inference.backends import INFERENCE_BACKENDS

    monkeypatch.syspath_prepend(str(plugin_dir))
    monkeypatch.setenv("AREAL_PLUGINS", "")
    try:
        yield
    finally:
        ENGINES._entries.pop("ringfsdp", None)
        INFERENCE_BACKENDS._entries.pop("hfish", None)
        registry._imported.discard("demo_backends.registry")
        for mod in [m for m in sys.modules if m.split(".")[0] == "demo_backends"]:
            del sys.modules[mod]


def test_the_estimator_reads_the_plugin_specs(in_process_plugin):
    """In process: the KV budget follows the plugin server's memory fraction, the train memory its engine's
    sharding (FULL_SHARD, like fsdp: the same estimate as fsdp on the same dims)."""
    from areal_cli.plan.compose import load_config
    from areal_cli.plan.validate import validate as validate_cfg

    common = ["cluster=gpu_1x8", "model=qwen2_5_1_5b", "algo.batch_size=8"]
    mine = validate_cfg(load_config(common + [PLUGIN, "engine.name=ringfsdp",
                                              "allocation_mode=hfish:d4+ringfsdp:d4"]))
    ref = validate_cfg(load_config(common + ["engine.name=fsdp", "allocation_mode=vllm:d4+fsdp:d4"]))
    m, r = mine.inferences[0].memory, ref.inferences[0].memory
    assert m.weights_gb == pytest.approx(r.weights_gb)
    # budget = device × fraction − weights: 0.5 for the plugin, vLLM's 0.9 for the reference
    assert m.kv_budget_gb + m.weights_gb == pytest.approx((r.kv_budget_gb + r.weights_gb) * 0.5 / 0.9)
    assert mine.trains[0].memory.total_gb == pytest.approx(ref.trains[0].memory.total_gb)


@pytest.mark.slow
def test_areal_train_runs_both_plugin_backends(plugin_dir, tmp_path, tiny_model_dir):
    """Two RL steps with the plugin server and the plugin engine: the launcher starts the server through the
    plugin's command builder, the trainer rank builds the plugin's engine class by name, and the rollout
    worker's client speaks to the server through the plugin's module."""
    marker = tmp_path / "marker.jsonl"
    args = {"cluster.fileroot": tmp_path, "model.path": tiny_model_dir, "experiment_name": "plug",
            "trial_name": "t0", "trainer.total_steps": 2, "trainer.sft_warmup_steps": 0,
            "trainer.eval_every": 0, "trainer.recover_every": 0, "trainer.save_every": 0,
            "algo.batch_size": 2, "rollout.group_size": 2, "rollout.gconfig.max_new_tokens": 6,
            "dataset.train_size": 50, "dataset.test_size": 4, "dataset.max_prompt_len": 256,
            "stats.live": "false", "engine.name": "ringfsdp", "allocation_mode": "hfish:d1+ringfsdp:d1",
            "cluster.n_gpus_per_node": 2}
    p = subprocess.run([sys.executable, "-m", "areal_cli.cli.main", "train", PLUGIN,
                        *(f"{k}={v}" for k, v in args.items())],
                       capture_output=True, text=True, env=_env(plugin_dir, AREAL_TEST_BACKEND_MARKER=str(marker)),
                       timeout=380, check=False)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    metrics = [json.loads(ln) for ln in (tmp_path / "runs/plug/t0/metrics.jsonl").read_text().splitlines()]
    assert len([m for m in metrics if m.get("kind") == "train"]) == 2
    marks = [json.loads(ln) for ln in marker.read_text().splitlines()]
    assert [m["kind"] for m in marks].count("server") >= 1, marks
    # the trainer rank built its engines (the policy, and the KL reference) from the plugin's class
    engines = [m for m in marks if m["kind"] == "engine"]
    assert engines and all(m["dp"] == 1 for m in engines), marks
