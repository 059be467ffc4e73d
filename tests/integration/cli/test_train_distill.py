"""`areal train` with `algo.distill.teacher_path`: on-policy distillation as a real run (hf server, torchrun
trainer holding the teacher as a second forward-only engine, rollout worker), and a teacher with another
tokenizer refused in one line before anything starts."""

from __future__ import annotations

import subprocess
import sys

import pytest
from train_runs import _env, _overrides, _records

SHORT = {"trainer.total_steps": 2, "trainer.recover_every": 0, "trainer.save_every": 0, "trainer.eval_every": 0,
         "dataset.test_size": 4}


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory, tiny_model_dir) -> str:
    """A teacher of another size (3 layers, wider) with the student's tokenizer."""
    from areal_cli.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("teacher"), tokenizer_dir=tiny_model_dir, seed=5,
                           num_layers=3, hidden_size=96, intermediate_size=192)


def _train(tmp_path, model_dir, timeout=380, **extra) -> subprocess.CompletedProcess:
    args = _overrides(tmp_path, model_dir, **{**SHORT, **extra})
    return subprocess.run([sys.executable, "-m", "areal_cli.cli.main", "train", *args], capture_output=True,
                          text=True, env=_env(), timeout=timeout)


@pytest.mark.runs
@pytest.mark.timeout(400)
@pytest.mark.parametrize("weight", [0.0, 1.0])
def test_train_distils_from_a_bigger_teacher(tmp_path, tiny_model_dir, teacher_dir, weight):
    res = _train(tmp_path, tiny_model_dir, **{"algo.distill.teacher_path": teacher_dir,
                                               "algo.distill.task_reward_weight": weight})
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    steps = [r for r in _records(tmp_path / "runs" / "itest" / "t0") if r["kind"] == "train"]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        # the teacher scored the sampled tokens: its logp is not the student's, and the advantage is the gap
        assert r["distill/teacher_logp"] < 0 and r["distill/student_logp"] < 0
        assert r["distill/teacher_logp"] != pytest.approx(r["distill/student_logp"], abs=1e-4)
        assert r["distill/adv_abs_mean"] > 0 and r["train/adv_abs_mean"] > 0
        if weight == 0.0:  # pure distillation: the trained advantage is the teacher's alone
            assert r["train/adv_abs_mean"] == pytest.approx(r["distill/adv_abs_mean"], rel=1e-4)


def test_train_refuses_a_teacher_with_another_tokenizer(tmp_path, tiny_model_dir):
    from areal_cli.models.tiny import make_tiny_model

    corpus = [f"the quick brown fox {i} jumps over {i * 7} lazy dogs; zebras graze." for i in range(300)]
    foreign = make_tiny_model(tmp_path / "foreign", corpus=corpus, seed=0)
    res = _train(tmp_path, tiny_model_dir, timeout=120, **{"algo.distill.teacher_path": foreign})
    assert res.returncode != 0
    lines = [ln for ln in res.stderr.splitlines() if "algo.distill.teacher_path" in ln]
    assert len(lines) == 1 and "tokenizer" in lines[0] and foreign in lines[0], res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "runs").exists()  # refused before any run dir, server or trainer
