"""A table of a new user's mistakes through the real `areal` entry point, each answer matched verbatim.

One style for every answer: ``error: <what is wrong> — fix: <what to do>`` on one line of stderr (a spec
error adds the spec and a caret under the bad character), exit 1 for a wrong config or input, 2 for a
malformed command line, nothing launched and nothing created. The whole table runs in one subprocess
(``main(argv)`` per row, each with its own environment) so the table stays cheap; only tmp paths are
normalised (to ``<tmp>``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

# Runs every row through the real entry point in one process; prints one JSON record per row.
RUNNER = textwrap.dedent("""
    import contextlib, io, json, os, sys
    from areal_cli.cli.main import main
    env0 = dict(os.environ)
    for argv in json.loads(sys.argv[1]):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
        os.environ.clear()
        os.environ.update(env0)  # --config-dir travels in the environment: no row leaks into the next
        print(json.dumps({"argv": argv, "code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}))
""")

SWEEP_FIX = "run the sweep with `areal sweep {}`, or pick one value"
LOCAL_FIX = ("use a launcher that starts every node (launcher=slurm, launcher=ray or launcher=skypilot), "
             "or set cluster.n_nodes=1")

# (argv, exit code, the stderr lines verbatim)
TABLE = [
    (["validate-config", "algo.optim.lr=1e-4,3e-4"], 1,
     ["error: algo.optim.lr: '1e-4,3e-4' is a sweep (comma-separated values): one run takes one value — fix: "
      + SWEEP_FIX.format("algo.optim.lr=1e-4,3e-4")]),
    (["train", "algo=grpo,dapo", "trainer.total_steps=3"], 1,
     ["error: algo: 'grpo,dapo' is a sweep (comma-separated values): one run takes one value — fix: "
      + SWEEP_FIX.format("algo=grpo,dapo trainer.total_steps=3")]),
    (["validate-config", "seed=range(1,4)"], 1,
     ["error: seed: 'range(1,4)' is a sweep (range()): one run takes one value — fix: "
      + SWEEP_FIX.format("'seed=range(1,4)'")]),
    (["validate-config", "cluster.hosts=[a,b]"], 1,
     ["error: cluster.hosts: no launcher reads a host list: launcher=local runs on this machine alone, and "
      "slurm, ray and skypilot find their nodes themselves — fix: drop cluster.hosts; for several nodes use "
      "launcher=slurm, launcher=ray or launcher=skypilot; to check a shared path on given hosts run "
      "`areal check-storage PATH --hosts h1,h2`"]),
    (["validate-config", "cluster.hardware=h900"], 1,
     ["error: cluster.hardware: unknown hardware profile 'h900' — fix: did you mean 'h800'? use one of a100, b200, "
      "cpu, h100, h20, h200, h800, l40s, a profile .json, or measure this machine with `areal plan --calibrate`"]),
    (["validate-config", "cluster=gpu_2x8", "cluster.hardware=cpu"], 1,
     ["error: cluster.hardware: profile cpu is a CPU profile but cluster.device=cuda — fix: set cluster.hardware "
      "to a GPU profile, or cluster.device=cpu"]),
    (["train", "cluster.n_nodes=2"], 1,
     ["error: launcher=local runs on this machine alone, but the plan needs 2 nodes (cluster.n_nodes=2) — fix: "
      + LOCAL_FIX]),
    (["validate-config", "allocation_mode=sglang:d4+megatron:d2t2p2"], 1,
     ["error: allocation_mode.spec: the spec needs 12 devices but the cluster has 2 (cluster.n_nodes=1 × "
      "cluster.n_gpus_per_node=2) — fix: sglang runs on GPUs only: use a GPU cluster, cluster=gpu_2x8 (2×8 "
      "GPUs for the spec's 12), or shrink the dims",
      "  sglang:d4+megatron:d2t2p2",
      "  ^"]),
    (["validate-config", "allocation_mode=hf:d4+fsdp:d8"], 1,
     ["error: allocation_mode.spec: the spec needs 12 devices but the cluster has 2 (cluster.n_nodes=1 × "
      "cluster.n_gpus_per_node=2) — fix: set cluster.n_gpus_per_node=12 (on CPU a device is a process slot), "
      "cluster.n_nodes=6, or shrink the dims",
      "  hf:d4+fsdp:d8",
      "  ^"]),
    (["validate-config", "model=qwen2_5_7b", "trainer.total_steps=-1"], 1,
     ["error: trainer.total_steps: -1 (set on the command line) is out of range: must be in [0, inf) — fix: "
      "set trainer.total_steps in [0, inf); without the override it is 200 (experiment=real_model)"]),
    (["validate-config", "rollout.gconfig.temperature=-2"], 1,
     ["error: rollout.gconfig.temperature: -2.0 (set on the command line) is out of range: must be in "
      "[1e-05, 100] — fix: set rollout.gconfig.temperature in [1e-05, 100]; greedy decoding is greedy=true, "
      "not temperature 0; without the override it is 1.0 (experiment=cpu_default)"]),
    (["validate-config", "trainer.keep_checkpoints=-1"], 1,
     ["error: trainer.keep_checkpoints: -1 (set on the command line) is out of range: must be in [1, inf) — "
      "fix: set trainer.keep_checkpoints in [1, inf); without the override it is 2 (the schema default)"]),
    (["--config-dir", "<tmp>/conf", "validate-config", "experiment=mine"], 1,
     ["error: trainer.total_steps: -5 (set by experiment=mine) is out of range: must be in [0, inf) — fix: "
      "set trainer.total_steps in [0, inf) (on the command line, or in experiment=mine)"]),
    (["train", "--json"], 2,
     ["error: --json prints the plan of a dry run; a launch does not print JSON — fix: add --dry-run "
      "(areal train --dry-run --json ...), or ask a running run with `areal status --json`"]),
    (["sweep", "--dry-run", "rollout.group_size=0,-1", "cluster.fileroot=<tmp>/fileroot"], 1,
     ["error: all 2 trials of the sweep are invalid, so nothing would run; the first one's error: "
      "rollout.group_size: 0 (set on the command line) is out of range: must be in [1, inf) — fix: set "
      "rollout.group_size in [1, inf); without the override it is 8 (experiment=cpu_default)"]),
    (["check-storage", "<tmp>/missing/dir"], 1,
     ["error: <tmp>/missing/dir does not exist (check-storage creates nothing unless asked) — fix: create it "
      "(mkdir -p <tmp>/missing/dir), point at an existing directory (cluster.fileroot=DIR), or pass --create"]),
    (["validate-config", "algo=grop"], 1,
     ["error: algo: unknown algo option 'grop' — fix: did you mean 'grpo'? options: dapo, drgrpo, grpo, gspo, "
      "ppo, reinforce_pp, rloo, rm, sft"]),
    (["validate-config", "rollout.group_sze=4"], 1,
     ["error: rollout.group_sze: unknown config key 'group_sze' in 'rollout' — fix: did you mean "
      "'rollout.group_size'?"]),
    (["validate-config", "algo.lr=1e-6"], 1,
     ["error: algo.lr: unknown config key 'lr' in 'algo' — fix: did you mean 'algo.optim.lr'?"]),
    (["validate-config", "rollout.group_size=abc"], 1,
     ["error: rollout.group_size: expected an integer, got 'abc' — fix: set rollout.group_size to an integer"]),
    (["validate-config", "allocation_mode=sglang:d4+fsdp:x4"], 1, None),  # filled below: the parser's words
    (["validate-config", "engine=fsdp", "allocation_mode=sglang.d4+megatron.d2t2p2"], 1,
     ["error: engine: engine=fsdp disagrees with allocation_mode=sglang.d4+megatron.d2t2p2, which trains with "
      "megatron — fix: drop engine=fsdp (the spec decides), or drop 'megatron' from the spec so the engine "
      "supplies it"]),
    (["validate-config", "dataset.train_path=<tmp>/nope.jsonl"], 1,
     ["error: dataset.train_path: dataset file '<tmp>/nope.jsonl' does not exist — fix: point "
      "dataset.train_path at a .jsonl/.parquet file or a saved datasets dir, or use builtin:arith"]),
    (["validate-config", "model=qwen_9000"], 1,
     ["error: model: unknown model option 'qwen_9000' — fix: options: llama3_8b, qwen2_5_0_5b, qwen2_5_1_5b, "
      "qwen2_5_32b, qwen2_5_7b, qwen2_5_vl_3b, qwen2_5_vl_7b, qwen2_vl_7b, qwen3_30b_a3b, qwen3_8b, tiny, tiny_moe, "
      "tiny_qwen2_vl, tiny_vl"]),
    (["validate-config", "model.revision=abc"], 1,
     ["error: model.revision: model.revision=abc only applies to a hub id, but model.path is 'builtin:tiny' — "
      "fix: drop model.revision, or set model.path to a hub id (org/name)"]),
    (["validate-config", "model.path=builtin:huge"], 1,
     ["error: model.path: unknown built-in model 'builtin:huge' — fix: use one of: builtin:tiny, "
      "builtin:tiny_moe, builtin:tiny_vl, builtin:tiny_qwen2_vl, or a local HF model directory"]),
    (["--config-dir", "<tmp>/none", "validate-config"], 1,
     ["error: --config-dir: '<tmp>/none' is not a directory — fix: point --config-dir at a folder laid out "
      "like conf/ (experiment/, model/, ...)"]),
    (["train", "--dry-runn"], 2,
     ["error: no such option: --dry-runn — fix: did you mean --dry-run? see `areal train -h`"]),
    (["trian"], 2, ["error: no such command 'trian' — fix: did you mean 'train'? see `areal -h`"]),
    (["train", "--cfg", "hydra"], 2,
     ["error: --cfg takes 'job' (print the composed config), got 'hydra' — fix: --cfg job"]),
    (["sweep", "rollout.group_size=2"], 2,
     ["error: nothing to sweep: no override has several values — fix: give at least one sweep override, e.g. "
      "algo.optim.lr=1e-6,3e-6"]),
    (["sweep", "--mode", "best", "seed=1,2"], 2,
     ["error: --mode 'best' is neither max nor min — fix: --mode max or --mode min"]),
]


@pytest.fixture(scope="module")
def answers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad_inputs")
    (tmp / "conf" / "experiment").mkdir(parents=True)
    (tmp / "conf" / "experiment" / "mine.yaml").write_text("# @package _global_\ntrainer:\n  total_steps: -5\n")
    rows = [[a.replace("<tmp>", str(tmp)) for a in argv] for argv, _, _ in TABLE]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1", "COLUMNS": "160", "HOME": str(tmp / "home")}
    env.pop("AREAL_DEBUG", None)
    env.pop("AREAL_CONFIG_DIR", None)
    env.pop("AREAL_HARDWARE_DIR", None)  # calibrated profiles: only the built-in ones are listed
    env.pop("XDG_CONFIG_HOME", None)
    p = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(rows)], capture_output=True, text=True,
                       env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    out = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert len(out) == len(TABLE), p.stdout[-3000:]
    for rec in out:
        for k in ("stdout", "stderr"):
            rec[k] = rec[k].replace(str(tmp), "<tmp>")
    return tmp, out


@pytest.mark.parametrize("i", range(len(TABLE)), ids=[" ".join(r[0]) for r in TABLE])
def test_bad_input_answer_verbatim(answers, i):
    tmp, out = answers
    argv, code, expected = TABLE[i]
    rec = out[i]
    lines = rec["stderr"].splitlines()
    assert "Traceback" not in rec["stderr"] + rec["stdout"]
    assert rec["code"] == code, rec
    if expected is None:  # a spec parse error: its own words, in the same shape
        assert len(lines) == 3 and lines[0].startswith("error: allocation_mode") and " — fix: " in lines[0]
        assert lines[1] == "  sglang:d4+fsdp:x4" and lines[2] == " " * lines[1].index("x") + "^"
        return
    assert lines == expected


def test_every_answer_has_one_style(answers):
    _, out = answers
    for rec in out:
        first = rec["stderr"].splitlines()[0]
        assert first.startswith("error: ") and first.count(" — fix: ") == 1, first
        assert "Error:" not in rec["stderr"] and "; fix:" not in rec["stderr"], rec["stderr"]


def test_nothing_was_created(answers):
    tmp, _ = answers
    assert not (tmp / "missing").exists()  # check-storage reported it; it did not make it
    assert not (tmp / "fileroot").exists()  # the all-invalid sweep wrote no manifest
    assert not (tmp / "home" / ".cache" / "areal" / "runs").exists()  # nothing launched
