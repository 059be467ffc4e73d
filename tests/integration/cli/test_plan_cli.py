"""``areal plan --json`` as a user runs it: a real subprocess on the embedded default and on the user's
2×8 example, with --suggest, importing no torch (and with --caps, no transformers either: reading the
dataset's prompt lengths needs a tokenizer, and only that)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

EXAMPLE = ["algo=grpo", "engine=megatron", "allocation_mode=sglang.d4+megatron.d2t2p2", "cluster=gpu_2x8",
           "model=qwen2_5_7b"]
PROBE = (
    "import sys, json\n"
    "from areal_cli.cli.main import main\n"
    "code = main(sys.argv[1:])\n"
    "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))\n"
    "sys.stderr.write('\\nHEAVY=' + json.dumps(heavy) + '\\n')\n"
    "sys.exit(code)\n"
)


def plan_json(tmp_path, *args: str) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1", "AREAL_HARDWARE_DIR": str(tmp_path / "hw")}
    env.pop("AREAL_DEBUG", None)
    p = subprocess.run([sys.executable, "-c", PROBE, "plan", "--json", "--suggest", *args], check=False,
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    heavy = json.loads([ln for ln in p.stderr.splitlines() if ln.startswith("HEAVY=")][-1][len("HEAVY="):])
    assert not [m for m in heavy if m.split(".")[0] == "torch"]
    if "--caps" in args:
        assert heavy == []
    return json.loads(p.stdout)


def test_plan_reads_the_prompt_lengths_of_the_embedded_dataset(tmp_path):
    """The embedded default's prompts, rendered with its chat template, are far shorter than half the
    cap; --caps plans at the caps. Both agree on everything but the lengths' consequences."""
    from areal_cli.cli.common import compose_and_validate

    d = plan_json(tmp_path)
    caps = plan_json(tmp_path, "--caps")
    cfg, _ = compose_and_validate([])
    got = d["lengths"]
    assert caps["lengths"] is None and caps["workload"]["prompt_tokens"] == cfg.dataset.max_prompt_len // 2
    assert got["source"] == "builtin:arith" and got["rows"] > 100
    assert 0 < got["mean"] <= got["max"] <= cfg.dataset.max_prompt_len
    assert d["workload"]["prompt_tokens"] == pytest.approx(got["mean"])
    assert d["step"]["train_s"] != caps["step"]["train_s"]


@pytest.mark.parametrize("args,hw,spec", [([], "cpu", "hf:d1+fsdp:d1"),
                                          (EXAMPLE, "h100", "sglang:d4+megatron:d2t2p2")])
def test_plan_json_on_the_default_and_the_two_node_example(tmp_path, args, hw, spec):
    d = plan_json(tmp_path, *args)
    assert d["valid"] and d["spec"] == spec and d["hardware"]["name"] == hw
    s = d["step"]
    assert s["mode"] == "async" and 0 < s["step_s"] <= s["sync_step_s"]
    assert d["samples_per_s"] == pytest.approx(d["workload"]["samples"] / s["step_s"])
    assert {c["kind"] for c in d["components"]} == {"inference", "train"}
    assert all(c["memory"]["process_gb"] >= d["hardware"]["process_base_gb"] for c in d["components"])
    sug = d["suggest"]
    assert sug["current"]["spec"] == spec and sug["gain"] >= 1.0
    assert sug["override"] == "allocation_mode=" + sug["best"]["spec"]
