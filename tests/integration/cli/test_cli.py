"""The `areal` CLI through real subprocesses: exit codes, one-line errors, no tracebacks, no torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1", "COLUMNS": "160"}
ENV.pop("AREAL_DEBUG", None)
USER_EXAMPLE = ["algo=grpo", "engine=megatron", "allocation_mode=sglang.d4+megatron.d2t2p2",
                "cluster.n_nodes=2", "cluster.n_gpus_per_node=8"]
# Runs the real entry point, then reports which heavy modules got imported.
PROBE = (
    "import sys, json\n"
    "from areal_cli.cli.main import main\n"
    "code = main(sys.argv[1:])\n"
    "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'datasets'))\n"
    "sys.stderr.write('\\nHEAVY=' + json.dumps(heavy) + '\\n')\n"
    "sys.exit(code)\n"
)


def areal(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["areal", *args], capture_output=True, text=True, env=ENV, timeout=timeout)


def probe(*args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    p = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, env=ENV,
                       timeout=120)
    line = [ln for ln in p.stderr.splitlines() if ln.startswith("HEAVY=")][-1]
    return p, json.loads(line[len("HEAVY="):])


def test_help_lists_groups_and_imports_no_torch():
    p, heavy = probe("--help")
    assert p.returncode == 0 and heavy == []
    for word in ("validate-config", "train", "algo", "grpo", "engine", "megatron", "allocation_mode",
                 "local_cpu", "model", "qwen3_30b_a3b", "experiment", "cpu_default"):
        assert word in p.stdout


def test_validate_config_user_example_passes_without_torch():
    p, heavy = probe("validate-config", *USER_EXAMPLE)
    assert p.returncode == 0, p.stderr
    assert heavy == []
    assert "valid configuration" in p.stdout and "sglang:d4+megatron:d2t2p2" in p.stdout
    assert "node0:[4-7] node1:[0-3]" in p.stdout  # megatron placement spans both nodes
    assert "Traceback" not in p.stderr


def test_validate_config_help_lists_groups():
    p = areal("validate-config", "--help")
    assert p.returncode == 0
    assert "--json" in p.stdout and "allocation_mode" in p.stdout and "gpu8_sglang_fsdp" in p.stdout


def test_validate_config_json():
    p = areal("validate-config", "--json", *USER_EXAMPLE)
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["valid"] and d["train"][0]["parallel"] == {"dp": 2, "tp": 2, "pp": 2, "cp": 1, "ep": 1,
                                                        "etp": 0, "world_size": 8}
    assert d["inference"][0]["placement"] == [{"node": 0, "devices": [0, 1, 2, 3]}]
    assert d["train"][0]["memory"]["total_gb"] > 0 and d["train"][0]["micro_batch"]["sequences"] > 0


WRONG = [
    (["allocation_mode=sglang.d4+megatron.d2t2p2", "engine=fsdp"], "engine: engine=fsdp disagrees"),
    (["rollout.group_sze=4"], "did you mean 'rollout.group_size'?"),
    (["algo=grop"], "did you mean 'grpo'?"),
    (["rollout.group_size=abc"], "rollout.group_size: expected an integer, got 'abc'"),
    (["allocation_mode=sglang:d4+fsdp:d4", "cluster.n_gpus_per_node=4"], "needs 8 devices but the cluster has 4"),
    (["model=qwen2_5_7b", "cluster=gpu_1x8", "allocation_mode=sglang:d1t3+fsdp:d4"],
     "t=3 does not divide model.num_attention_heads=28"),
    (["engine=fsdp", "cluster=gpu_2x8", "allocation_mode=sglang.d4+d2p2"],
     "engine fsdp does not support pipeline parallelism (p2)"),
    (["cluster=gpu_1x8", "allocation_mode=sglang:d2+fsdp:d3", "algo.batch_size=8"], "algo.batch_size: 8 prompts"),
    (["allocation_mode=vllm:d2t2|fsdp:d2"], "colocated components need the same number of devices"),
    (["model=llama3_8b", "cluster=gpu_2x8", "allocation_mode=sglang:d2+megatron:d2p3"],
     "p=3 does not divide model.num_hidden_layers=32"),
    (["allocation_mode=sglang:d4+fsdp:x4"], "unknown dimension 'x'"),
]


@pytest.mark.parametrize("overrides,needle", WRONG, ids=[" ".join(w[0]) for w in WRONG])
def test_wrong_configs_exit_1_with_one_line(overrides, needle):
    p = areal("validate-config", *overrides)
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert "Traceback" not in p.stderr and "Traceback" not in p.stdout
    lines = p.stderr.strip().splitlines()
    assert lines[0].startswith("error: ") and needle in lines[0], lines[0]
    assert " — fix: " in lines[0]
    extra = lines[1:]
    assert extra == [] or (len(extra) == 2 and extra[1].strip() == "^")  # caret lines only


def test_parse_error_caret_points_at_bad_character():
    p = areal("validate-config", "allocation_mode=sglang:d4+fsdp:x4")
    _, text, caret = p.stderr.strip("\n").splitlines()
    assert text.strip() == "sglang:d4+fsdp:x4"
    assert text[caret.index("^")] == "x"


def test_json_error_and_usage_exit_codes():
    p = areal("validate-config", "--json", "algo=grop")
    assert p.returncode == 1 and json.loads(p.stdout)["error"]["path"] == "algo"
    assert areal("validate-config", "--no-such-flag").returncode == 2
    assert areal("no-such-command").returncode == 2


def test_train_cfg_job_and_dry_run():
    p = areal("train", "--cfg", "job", "rollout.group_size=6")
    assert p.returncode == 0, p.stderr
    assert "group_size: 6" in p.stdout and "spec: hf:d1+d1" in p.stdout
    p = areal("train", "--dry-run", "--json", *USER_EXAMPLE)
    assert p.returncode == 0 and json.loads(p.stdout)["spec"] == "sglang:d4+megatron:d2t2p2"
    p = areal("train", "--dry-run", "algo=grop")
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert areal("train", "--cfg", "hydra").returncode == 2

