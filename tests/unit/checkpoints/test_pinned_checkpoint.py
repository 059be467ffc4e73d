"""checkpoints/locate.py ``pinned``: a checkpoint of a run is read through hard links, so the run pruning it
(trainer.keep_checkpoints) while ``areal eval``/``export`` read it changes nothing they see."""

from __future__ import annotations

import json
import shutil

from areal_cli.checkpoints.locate import PIN_PREFIX, pinned


def _run_with_checkpoint(root):
    run = root / "runs" / "exp" / "t1"
    ck = run / "checkpoints" / "step_000004"
    (ck / "sub").mkdir(parents=True)
    (run / "config.yaml").write_text("trainer:\n  total_steps: 8\n")
    (run / "launch.json").write_text(json.dumps({"launched": 1.0}))
    (ck / "config.json").write_text('{"model_type": "qwen2"}')
    (ck / "model.safetensors").write_bytes(b"w" * 4096)
    (ck / "sub" / "x.bin").write_bytes(b"x")
    (ck / "latest").symlink_to("model.safetensors")
    return run, ck


def test_a_pruned_checkpoint_stays_whole_for_its_reader(tmp_path):
    run, ck = _run_with_checkpoint(tmp_path)
    with pinned("exp/t1", fileroot=str(tmp_path)) as src:
        assert src.origin == ck and src.shown == ck and src.path != ck and src.step == 4
        assert src.path.parent.name.startswith(PIN_PREFIX) and src.path.parent.parent == run
        assert (src.path / "model.safetensors").stat().st_ino == (ck / "model.safetensors").stat().st_ino
        shutil.rmtree(ck)  # the run prunes it now
        assert (src.path / "model.safetensors").read_bytes() == b"w" * 4096
        assert (src.path / "sub" / "x.bin").read_bytes() == b"x"
        assert (src.path / "latest").is_symlink() and (src.path / "latest").read_bytes() == b"w" * 4096
        assert str(src.shown) in src.describe() and PIN_PREFIX not in src.describe()
    assert not any(p.name.startswith(PIN_PREFIX) for p in run.iterdir())  # the links go with the reader


def test_a_model_dir_outside_any_run_is_read_in_place(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    with pinned(str(d)) as src:
        assert src.path == d.resolve() and src.origin is None and src.run_dir is None
