"""`areal eval` and `areal export` against real finished runs of the embedded default (shortened).

One full-weight run (a short SFT warm start, so greedy answers differ from item to item, then two RL steps,
an HF export and a recover state at step 1) and one LoRA run are shared by the module. `areal eval` must
give the figures the run's own held-out evaluations logged (greedy: the same weights, prompts and
generation settings give the same completions); `areal export` must give dirs whose logits are the
checkpoint's (full weights), or peft's base + adapter (LoRA, with and without --merge-lora).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from train_runs import _env, _env_with_reward

pytestmark = [pytest.mark.runs, pytest.mark.timeout(900)]

SHORT = ["trainer.total_steps=2", "trainer.save_every=1", "trainer.recover_every=1", "trainer.eval_every=1",
         "algo.batch_size=2", "rollout.group_size=2", "dataset.train_size=1000", "dataset.test_size=24",
         "stats.live=false"]


def _areal(*args: str, env: dict | None = None) -> None:
    res = subprocess.run([sys.executable, "-m", "areal_cli.cli.main", *args], check=False, capture_output=True,
                         text=True, env=env or _env(), timeout=600)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    """The CLI in this process (no interpreter start per call); the servers it starts are real processes."""
    from areal_cli.cli.main import main

    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def _ok(capsys, *args: str) -> str:
    code, out, err = _cli(capsys, *args)
    assert code == 0, (out + err)[-4000:]
    return out


def _train(root: Path, name: str, *overrides: str, env: dict | None = None) -> Path:
    _areal("train", f"cluster.fileroot={root}", f"experiment_name={name}", "trial_name=t0", *SHORT, *overrides,
           env=env)
    return root / "runs" / name / "t0"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    # 25 SFT steps teach the answer format: completions end at different lengths and some are right,
    # so equal eval figures mean equal completions (an untrained model answers 32 tokens of noise).
    return _train(tmp_path_factory.mktemp("evx"), "evx", "trainer.sft_warmup_steps=25")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    # The untrained model never answers right: with the task's reward every advantage would be 0 and the
    # adapter would stay at peft's zero init (merged = base). A reward that varies with the completion and a
    # large lr make the adapter matter after two steps.
    root = tmp_path_factory.mktemp("lorax")
    return _train(root, "lorax", "model.lora.rank=8", "trainer.sft_warmup_steps=0", "trainer.eval_every=0",
                  "workflow.reward=resume_reward.varied_reward", "algo.optim.lr=0.01", "dataset.test_size=4",
                  env=_env_with_reward(root))


def _eval_record(run_dir: Path, step: int) -> dict:
    from areal_cli.trainer.stats import read_metrics

    evals = [r for r in read_metrics(run_dir) if r.get("kind") == "eval" and r["step"] == step
             and r.get("phase") == "rl"]
    return evals[-1]


def _same_figures(res: dict, rec: dict) -> None:
    for key in ("eval/pass@1", "eval/reward_mean", "eval/mean_len", "eval/n_items"):
        assert res["metrics"][key] == pytest.approx(rec[key], abs=1e-9), (key, res["metrics"], rec)


def test_eval_run_gives_the_runs_final_held_out_figures(run, capsys):
    # Greedy completions of the same weights on the same prompts: equal figures. (The hf server's logits
    # depend on co-batching in their last bits, ~1e-6, docs/train.md "Checkpoints and resume"; a greedy
    # near-tie that close is far rarer than one sampled token in 3200, so exact equality is the check.)
    res = json.loads(_ok(capsys, "eval", "evx/t0", "--fileroot", str(run.parents[2]), "--json"))
    rec = _eval_record(run, 2)
    assert res["checkpoint"] == str(run / "checkpoints" / "final") and res["step"] == 2
    assert 0 < rec["eval/mean_len"] < 32, "the warm start did not teach the format; the comparison is void"
    _same_figures(res, rec)
    assert res["accuracy_pct"] == pytest.approx(100 * rec["eval/pass@1"], abs=0.01)
    samples = json.loads(Path(res["samples_file"]).read_text())["samples"]
    assert len(samples) == res["n"] == 24
    assert sum(s["correct"] for s in samples) == round(rec["eval/pass@1"] * 24)


def test_eval_against_a_running_server(run, tmp_path_factory, capsys):
    from hf_server_helpers import start_hf_server

    ckpt = run / "checkpoints" / "step_000001"
    with start_hf_server(str(ckpt), tmp_path_factory, extra=["--num-threads", "1"]) as server:
        res = json.loads(_ok(capsys, "eval", str(run), "--step", "1", "--server", server.address, "--json"))
    assert res["checkpoint"] == str(ckpt) and res["backend"] == "sglang" and res["server"] == server.address
    _same_figures(res, _eval_record(run, 1))


def _logits(model_dir, ids):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def _ids(model_dir):
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return torch.tensor([tok("Mia has 14 balls and buys 3 more. How many balls does Mia have now?")["input_ids"]])


def test_export_writes_a_dir_transformers_loads(run, tmp_path, capsys):
    import torch

    out = tmp_path / "model"
    _ok(capsys, "export", str(run), "--to", str(out))
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "model.safetensors"):
        assert (out / name).is_file(), name
    ids = _ids(out)
    assert torch.equal(_logits(out, ids), _logits(run / "checkpoints" / "final", ids))
    code, _, err = _cli(capsys, "export", str(run), "--to", str(out))
    assert code == 1 and "is not empty" in err and "--force" in err
    # a recover state (engine DCP, fp32) exported on the CPU: the weights of that step's HF export
    _ok(capsys, "export", str(run / "recover" / "step_000001"), "--to", str(out), "--force")
    assert torch.equal(_logits(out, ids), _logits(run / "checkpoints" / "step_000001", ids))


def test_export_of_a_missing_step_lists_what_exists(run, tmp_path, capsys):
    code, _, err = _cli(capsys, "export", str(run), "--step", "7", "--to", str(tmp_path / "x"))
    assert code == 1 and err.count("\n") == 1, err
    assert "no checkpoint at step 7" in err and "steps: 1, final (step 2)" in err and "recover" in err
    assert not (tmp_path / "x").exists()


def test_lora_export_adapter_and_merged(lora_run, tmp_path, capsys):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    _ok(capsys, "export", str(lora_run), "--to", str(adapter))
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md"} <= {p.name for p in adapter.iterdir()}
    base_path = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert Path(base_path).is_dir()
    _ok(capsys, "export", str(lora_run), "--to", str(merged), "--merge-lora")
    ids = _ids(merged)
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32).eval()
    with torch.no_grad():
        plain = base(ids).logits
        peft_logits = PeftModel.from_pretrained(base, str(adapter)).eval()(ids).logits
    assert not torch.allclose(plain, peft_logits, atol=1e-4), "the adapter changes nothing; the test is void"
    # merged weights W + s·B·A against peft's W·x + s·B·(A·x): equal up to fp32 rounding
    torch.testing.assert_close(_logits(merged, ids), peft_logits, atol=1e-4, rtol=1e-4)
    # the run's own HF export holds the engine's merge: the same weights
    assert torch.equal(_logits(merged, ids), _logits(lora_run / "checkpoints" / "final", ids))
    # a LoRA recover state holds the adapter alone: merged onto the run's base, it is that step's export
    recovered = tmp_path / "recovered"
    _ok(capsys, "export", str(lora_run / "recover" / "step_000001"), "--to", str(recovered), "--merge-lora")
    assert torch.equal(_logits(recovered, ids), _logits(lora_run / "checkpoints" / "step_000001", ids))
