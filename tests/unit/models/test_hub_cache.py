"""models/hub.py without a hub: which model.path values are hub ids, reading the HF cache layout by hand
(huggingface_hub's own ``models--org--name/refs/<rev>`` → ``snapshots/<commit>``), the download command,
and validation reading a cached snapshot's config.json. The network side is
tests/integration/models/test_hub_fetch.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from areal_cli.plan.compose import load_config
from areal_cli.errors import ConfigError, LaunchError, StorageError
from areal_cli.job.status import error_from_record, error_record, read_node_error, record_node_error
from areal_cli.models.hub import (
    cached_commit,
    cached_config,
    cached_snapshot,
    download_command,
    ensure_local_model,
    hub_cache_dir,
    is_hub_id,
    snapshot_complete,
)

COMMIT = "a" * 40
OTHER = "b" * 40


def cache_with(
    cache: Path, repo: str, model_dir: str | Path, commit: str = COMMIT, ref: str | None = "main"
) -> Path:
    """A snapshot laid out as huggingface_hub writes it (blobs linked from the snapshot dir)."""
    folder = cache / ("models--" + repo.replace("/", "--"))
    snap = folder / "snapshots" / commit
    snap.mkdir(parents=True)
    (folder / "blobs").mkdir(exist_ok=True)
    for f in Path(model_dir).iterdir():
        if f.is_file():
            blob = folder / "blobs" / f"{commit[:8]}-{f.name}"
            shutil.copyfile(f, blob)
            (snap / f.name).symlink_to(blob)
    if ref:
        (folder / "refs").mkdir(exist_ok=True)
        (folder / "refs" / ref).write_text(commit)
    return snap


@pytest.mark.parametrize(
    "path,expected",
    [
        ("Qwen/Qwen2.5-0.5B-Instruct", True),
        ("gpt2", True),
        ("org/name.v2_x", True),
        ("builtin:tiny", False),
        ("/abs/dir", False),
        ("./rel", False),
        ("../up", False),
        ("~/m", False),
        ("a/b/c", False),
        ("has space/x", False),
        ("org--x/y", False),
        ("org/..", False),
        ("", False),
    ],
)
def test_is_hub_id(path, expected):
    assert is_hub_id(path) is expected


def test_existing_local_path_is_not_a_hub_id(tmp_path, monkeypatch):
    (tmp_path / "org" / "model").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert not is_hub_id("org/model")
    assert ensure_local_model("org/model") == "org/model"  # a local dir passes through, never fetched


def test_hub_cache_dir_follows_the_environment_now(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "c"))
    assert hub_cache_dir() == tmp_path / "c"


def test_cached_snapshot_reads_refs_and_checks_completeness(tmp_path, tiny_model_dir):
    cache = tmp_path / "hub"
    assert cached_snapshot("org/m", cache_dir=cache) is None
    snap = cache_with(cache, "org/m", tiny_model_dir)
    assert cached_snapshot("org/m", cache_dir=cache) == str(snap)
    assert cached_snapshot("org/m", "main", cache) == str(snap) and cached_snapshot(
        "org/m", COMMIT, cache
    ) == str(snap)
    assert cached_commit("org/m", "main", cache) == COMMIT
    assert cached_snapshot("org/m", "v1", cache) is None  # a ref the cache never recorded
    assert cached_snapshot("org/m", OTHER, cache) is None
    # An interrupted download: the weights' blob never landed, so its link is missing.
    (snap / "model.safetensors").unlink()
    assert cached_snapshot("org/m", cache_dir=cache) is None and not snapshot_complete(snap)


def test_a_config_json_alone_is_enough_for_the_facts_not_for_the_weights(tmp_path, tiny_model_dir, monkeypatch):
    """What a submitter holds after ``hf download org/m config.json``: validation reads the real architecture,
    while every fetcher (cached_snapshot) still sees the weights as missing."""
    from areal_cli.models.tiny import make_tiny_model

    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    three = make_tiny_model(tmp_path / "three", tokenizer_dir=tiny_model_dir, num_layers=3)
    only = tmp_path / "only_config"
    only.mkdir()
    shutil.copyfile(Path(three) / "config.json", only / "config.json")
    assert cached_config("org/m", cache_dir=cache) is None
    snap = cache_with(cache, "org/m", only)
    assert cached_config("org/m", cache_dir=cache) == str(snap) and cached_snapshot("org/m", cache_dir=cache) is None
    m = load_config(["model.path=org/m", "experiment=cpu_default"]).model
    assert (m.name, m.num_hidden_layers) == ("m", 3)
    from areal_cli.plan.validate import validate

    validate(load_config(["model.path=org/m", "experiment=cpu_default"]))  # the facts are known: no refusal
    with pytest.raises(ConfigError) as e:
        validate(load_config(["model.path=org/other", "experiment=cpu_default"]))
    assert "download org/other config.json" in e.value.hint


def test_sharded_snapshot_needs_every_shard_of_its_index(tmp_path, tiny_model_dir):
    d = tmp_path / "sharded"
    shutil.copytree(tiny_model_dir, d)
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    (d / "model.safetensors.index.json").write_text(
        json.dumps(
            {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
        )
    )
    assert not snapshot_complete(d)
    shutil.copyfile(d / "model-00001-of-00002.safetensors", d / "model-00002-of-00002.safetensors")
    assert snapshot_complete(d)


def test_download_command_names_the_installed_cli():
    from importlib import metadata

    names = {ep.name for ep in metadata.distribution("huggingface_hub").entry_points}
    exe = "hf" if "hf" in names else "huggingface-cli"
    assert download_command("org/m") == f"{exe} download org/m"
    assert download_command("org/m", "v1") == f"{exe} download org/m --revision v1"
    assert download_command("org/m", None, "config.json") == f"{exe} download org/m config.json"


def test_validation_reads_a_cached_snapshot_and_honours_revision(tmp_path, tiny_model_dir, monkeypatch):
    from areal_cli.models.tiny import make_tiny_model

    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    preset = load_config(["model.path=org/m"]).model  # not cached: the tiny preset's facts stand
    assert (preset.name, preset.num_hidden_layers) == ("tiny", 2)
    three = make_tiny_model(tmp_path / "three", tokenizer_dir=tiny_model_dir, num_layers=3)
    four = make_tiny_model(tmp_path / "four", tokenizer_dir=tiny_model_dir, num_layers=4)
    cache_with(cache, "org/m", three, COMMIT, ref="main")
    cache_with(cache, "org/m", four, OTHER, ref="v2")
    m = load_config(["model.path=org/m"]).model
    assert (m.name, m.num_hidden_layers, m.hidden_size) == ("m", 3, 64)
    assert load_config(["model.path=org/m", "model.revision=v2"]).model.num_hidden_layers == 4
    assert load_config(["model.path=org/m", f"model.revision={OTHER}"]).model.num_hidden_layers == 4
    assert load_config(["model.path=org/m", "model.num_hidden_layers=6"]).model.num_hidden_layers == 6


def test_revision_without_a_hub_id_is_an_error(tiny_model_dir):
    for path in ("builtin:tiny", tiny_model_dir):
        with pytest.raises(ConfigError) as e:
            load_config([f"model.path={path}", "model.revision=main"])
        assert e.value.path == "model.revision" and "only applies to a hub id" in e.value.reason
    with pytest.raises(ConfigError) as e:
        load_config(["model.path=has space/x"])
    assert "neither a local directory nor a hub id" in e.value.reason


def test_user_errors_cross_processes_as_records(tmp_path):
    err = ConfigError("model.path", "there is no model repo org/nope on X", "check the id")
    back = error_from_record(json.loads(json.dumps(error_record(err))))
    assert type(back) is ConfigError and str(back) == str(err) and back.path == "model.path"
    storage = error_from_record(error_record(StorageError("cannot write the cache")))
    assert type(storage) is StorageError and str(storage) == "cannot write the cache"
    other = error_from_record(error_record(RuntimeError("boom")), where="node 3: ")
    assert type(other) is LaunchError and str(other) == "node 3: boom"
    assert read_node_error(tmp_path) is None
    record_node_error(tmp_path, 10, StorageError("node ten"))
    record_node_error(tmp_path, 2, err)
    assert str(read_node_error(tmp_path)) == str(err)  # the lowest node's


def test_an_offline_submitter_plans_from_the_named_preset(tmp_path, monkeypatch):
    """A cluster launcher's submitter fetches config.json alone; offline, a named preset's facts still plan
    the run, while an id no preset names is refused in one line."""
    from areal_cli.cli.launch import fetch_hub_model

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = load_config(["launcher=slurm", "model=qwen2_5_0_5b", "model.path=Qwen/Qwen2.5-0.5B-Instruct",
                       "experiment=cpu_default"])
    assert fetch_hub_model(cfg) is False
    with pytest.raises(ConfigError) as e:
        fetch_hub_model(load_config(["launcher=slurm", "model.path=org/unknown", "experiment=cpu_default"]))
    assert "offline" in e.value.reason
