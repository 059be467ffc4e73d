"""`areal train experiment=vision_default` end to end on CPU (issue 39): the tiny Qwen2.5-VL (and Qwen2-VL) built
on first use,
the visual task's SFT warm start with the images, then RL through the hf server serving the images and the fsdp
engine training on them; the single-turn RLVR workflow, and the multi-turn one whose feedback turn carries a new
picture. The trained rows had their images: the trainer logs how many rows of each step did."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from train_runs import _env, _overrides, _records

from areal_cli.data.builtin_model import BUILTIN_SPECS

SHORT = {"experiment": "vision_default", "trainer.total_steps": 2, "trainer.sft_warmup_steps": 2,
         "trainer.sft_batch_size": 4, "trainer.recover_every": 0, "trainer.save_every": 0,
         "trainer.eval_every": 2, "dataset.train_size": 32, "dataset.test_size": 4, "dataset.max_prompt_len": 64,
         "algo.batch_size": 2, "rollout.group_size": 2}


@pytest.mark.runs
@pytest.mark.timeout(600)
@pytest.mark.parametrize("model, workflow", [
    ("builtin:tiny_vl", {}),
    ("builtin:tiny_vl", {"workflow": "multi_turn", "workflow.max_turns": 2,
                         "workflow.kwargs.image_feedback": "areal_cli.rollout.workflows.vision_env:frame_shapes"}),
    # the tiny Qwen2-VL under the same experiment (its path picks its tower's layout over the preset's)
    ("builtin:tiny_qwen2_vl", {}),
])
def test_train_vision_default_trains_rows_with_images(tmp_path, model, workflow):
    args = _overrides(tmp_path, model, **{**SHORT, **workflow})
    res = subprocess.run([sys.executable, "-m", "areal_cli.cli.main", "train", *args], capture_output=True,
                         text=True, env=_env(), timeout=560)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    recs = _records(tmp_path / "runs" / "itest" / "t0")
    sft = [r for r in recs if r["kind"] == "sft"]
    assert [r["step"] for r in sft] == [1, 2] and all(r["sft/image_rows"] == 4 for r in sft)
    train = [r for r in recs if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:  # every row of the step (2 prompts x 2 samples) trained with its picture
        assert r["data/image_rows"] == 4
    evals = [r for r in recs if r["kind"] == "eval"]
    assert evals and all(r["eval/n_items"] == 4 for r in evals)
    assert "held-out accuracy: before" in res.stdout + res.stderr  # the run summary
    built = list((tmp_path / "models").glob("builtin-*/config.json"))
    assert len(built) == 1 and json.loads(built[0].read_text())["model_type"] == BUILTIN_SPECS[model[8:]].family


@pytest.mark.runs
@pytest.mark.timeout(600)
def test_train_on_a_local_jsonl_image_dataset(tmp_path):
    """The built-in task's rows written out as PNG files and JSONL rows naming them (relative paths, an <image>
    placeholder in the question): `areal train` reads them as a local image dataset, and the warm start, the RL
    steps and the held-out evaluation carry their pictures as for the built-in task."""
    import json

    from areal_cli.data import builtin_vision as bv

    data = tmp_path / "shapes"
    (data / "img").mkdir(parents=True)
    train, test = bv.generate_splits("count_all", 16, 4, seed=0)
    for split, rows in (("train", train), ("test", test)):
        lines = []
        for i, r in enumerate(rows):
            (data / "img" / f"{split}{i}.png").write_bytes(r["image"])
            lines.append(json.dumps({"question": "<image>" + r["question"], "images": [f"img/{split}{i}.png"],
                                     "answer": r["answer"]}))
        (data / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    extra = {**SHORT, "dataset.train_path": str(data / "train.jsonl"), "dataset.test_path": str(data / "test.jsonl"),
             "dataset.name": "shapes_jsonl"}
    for k in ("dataset.train_size", "dataset.test_size"):
        extra.pop(k)
    args = _overrides(tmp_path, "builtin:tiny_vl", **extra)
    args = [a for a in args if not a.startswith(("dataset.train_size=", "dataset.test_size="))]
    res = subprocess.run([sys.executable, "-m", "areal_cli.cli.main", "train", *args], capture_output=True,
                         text=True, env=_env(), timeout=560, check=False)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    recs = _records(tmp_path / "runs" / "itest" / "t0")
    assert [r["sft/image_rows"] for r in recs if r["kind"] == "sft"] == [4, 4]
    assert [r["data/image_rows"] for r in recs if r["kind"] == "train"] == [4, 4]
    evals = [r for r in recs if r["kind"] == "eval"]
    assert evals and all(r["eval/n_items"] == 4 for r in evals)
