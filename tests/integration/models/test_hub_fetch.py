"""Hub ids in model.path against a local hub (tests/support/hub_server.py: a real HTTP server speaking the
hub's file API) with the real huggingface_hub client, in real processes: what is fetched, how often, and the
one-line errors of the real CLI.

The served repo is a tiny model this project builds (make_tiny_model: save_pretrained weights + tokenizer),
with 6 heads and 3 KV heads (the ``tiny`` preset has 4 and 2, so facts read from its config.json are
recognisable),
plus a ``pytorch_model.bin`` and an ``original/consolidated.pth`` that must never be downloaded.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hub_server import LocalHub

pytestmark = pytest.mark.timeout(300)

REPO = "org/hubtiny"
ALLOWED = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
}
FETCH = (
    "import sys\n"
    "from areal_cli.models.hub import ensure_hub_model\n"
    "print(ensure_hub_model(sys.argv[1], sys.argv[2] or None))\n"
)


def _with_duplicates(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    (dst / "pytorch_model.bin").write_bytes(b"\0" * 4096)  # the weights again, in a format nothing here reads
    (dst / "original").mkdir()
    (dst / "original" / "consolidated.pth").write_bytes(b"\0" * 4096)
    return dst


@pytest.fixture(scope="module")
def hub_models(tmp_path_factory, tiny_model_dir) -> tuple[Path, Path]:
    """Two commits of one architecture (seeds 0 and 1), as repo dirs."""
    from areal_cli.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("hub_models")
    dirs = []
    for seed in (0, 1):
        built = make_tiny_model(
            root / f"built{seed}",
            tokenizer_dir=tiny_model_dir,
            seed=seed,
            hidden_size=96,
            num_heads=6,
            num_kv_heads=3,
        )
        dirs.append(_with_duplicates(built, root / f"repo{seed}"))
    return dirs[0], dirs[1]


@pytest.fixture
def hub(hub_models):
    h = LocalHub()
    h.commits = h.add_repo(REPO, *hub_models, tags={"v1": 0})
    h.add_repo("org/private", hub_models[0], access="private", token="hf_secret")
    h.add_repo("org/gated", hub_models[0], access="gated", token="hf_secret")
    h.start()
    yield h
    h.stop()


def env_for(tmp_path: Path, endpoint: str, *, offline: bool = False, **extra: str) -> dict[str, str]:
    """A fresh HOME and HF_HOME per test: no real token, no real cache."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(
        {
            "HOME": str(tmp_path / "home"),
            "HF_HOME": str(tmp_path / "hf"),
            "HF_ENDPOINT": endpoint,
            "HF_HUB_OFFLINE": "1" if offline else "0",
            "TRANSFORMERS_OFFLINE": "0",
            "NO_COLOR": "1",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        }
    )
    env.pop("AREAL_DEBUG", None)
    env.update(extra)
    return env


def fetch(env: dict[str, str], repo: str = REPO, revision: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", FETCH, repo, revision],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def areal(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "areal_cli.cli.main", *args],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def one_error_line(p: subprocess.CompletedProcess) -> str:
    """Exit 1 and one ``error:`` line; besides it only ``[areal]`` progress lines (what it tried) and a
    validation error's caret under the spec: no traceback, no warnings of the hub client."""
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error: ")]
    others = [ln for ln in lines if not ln.startswith(("error: ", "[areal] ", "  "))]
    assert p.returncode == 1 and len(errors) == 1 and not others, p.stderr[-3000:]
    return errors[0]


def test_first_fetch_downloads_config_tokenizer_and_safetensors_once(tmp_path, hub, hub_models):
    p = fetch(env_for(tmp_path, hub.endpoint))
    assert p.returncode == 0, p.stderr
    snap = Path(p.stdout.strip())
    assert snap == tmp_path / "hf" / "hub" / "models--org--hubtiny" / "snapshots" / hub.commits[1]
    assert (snap / "config.json").is_file() and json.loads((snap / "config.json").read_text())[
        "num_attention_heads"
    ] == 6
    gets = hub.file_gets(REPO)
    assert set(gets) == ALLOWED and set(gets.values()) == {1}, gets  # no .bin/.pth duplicates, each file once
    assert not (snap / "pytorch_model.bin").exists() and not (snap / "original").exists()
    for name in ALLOWED:  # the bytes the hub served for main (the second commit)
        assert (snap / name).read_bytes() == (hub_models[1] / name).read_bytes(), name
    assert f"downloading {REPO}" in p.stderr


def test_second_process_reuses_the_cache_without_the_network(tmp_path, hub):
    env = env_for(tmp_path, hub.endpoint)
    first = fetch(env)
    assert first.returncode == 0, first.stderr
    hub.clear()
    again = fetch(env)
    assert again.returncode == 0 and again.stdout == first.stdout, again.stderr
    assert hub.file_gets(REPO) == {} and not [c for c in hub.api_calls() if c.startswith("/api/models/")]
    offline = fetch(env_for(tmp_path, hub.endpoint, offline=True))
    assert offline.returncode == 0 and offline.stdout == first.stdout, offline.stderr


def test_concurrent_processes_on_one_node_download_once(tmp_path, hub):
    hub.delay_s = (
        3.0  # each file GET takes a while, so the processes overlap (and wait long enough to say so)
    )
    env = env_for(tmp_path, hub.endpoint)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", FETCH, REPO, ""],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=180) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    assert len({o[0] for o in outs}) == 1  # one snapshot dir for all
    gets = hub.file_gets(REPO)
    assert set(gets) == ALLOWED and set(gets.values()) == {1}, gets
    assert sum(f"downloading {REPO}" in o[1] for o in outs) == 1
    assert sum("waiting for another process" in o[1] for o in outs) >= 1


def test_revision_is_honoured(tmp_path, hub, hub_models):
    env = env_for(tmp_path, hub.endpoint)
    v1 = fetch(env, revision="v1")
    assert v1.returncode == 0, v1.stderr
    snap = Path(v1.stdout.strip())
    assert snap.name == hub.commits[0]
    assert (snap / "model.safetensors").read_bytes() == (hub_models[0] / "model.safetensors").read_bytes()
    by_commit = fetch(env_for(tmp_path, hub.endpoint, offline=True), revision=hub.commits[0])
    assert by_commit.stdout == v1.stdout, by_commit.stderr  # the commit id finds the cached snapshot offline
    main = fetch(env)
    assert Path(main.stdout.strip()).name == hub.commits[1]
    line = one_error_line(
        areal(env, "train", f"model.path={REPO}", "model.revision=v9", f"cluster.fileroot={tmp_path}")
    )
    assert "model.revision: 'v9' is not a branch, tag or commit of org/hubtiny" in line


def test_offline_and_unreachable_with_nothing_cached_are_one_line(tmp_path, hub):
    line = one_error_line(
        areal(
            env_for(tmp_path, hub.endpoint, offline=True),
            "train",
            f"model.path={REPO}",
            f"cluster.fileroot={tmp_path}",
        )
    )
    assert "model.path: org/hubtiny is not in the Hugging Face cache" in line and "HF_HUB_OFFLINE=1" in line
    assert "`hf download org/hubtiny`" in line and "local model dir" in line
    closed = "http://127.0.0.1:9"  # nothing listens on the discard port
    line = one_error_line(
        areal(
            env_for(tmp_path, closed),
            "train",
            f"model.path={REPO}",
            "model.revision=v1",
            f"cluster.fileroot={tmp_path}",
        )
    )
    assert f"the hub at {closed} is unreachable" in line and "`hf download org/hubtiny --revision v1`" in line
    assert hub.file_gets(REPO) == {}
    # The fix the line gives works: its command, run where the hub is reachable, fills the cache areal reads.
    cmd = shlex.split(line.split("`")[1])
    exe = shutil.which(cmd[0])
    argv = (
        [exe, *cmd[1:]]
        if exe
        else [sys.executable, "-c", "from huggingface_hub.cli.hf import main; main()", *cmd[1:]]
    )
    done = subprocess.run(
        argv, check=False, capture_output=True, text=True, env=env_for(tmp_path, hub.endpoint), timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    p = fetch(env_for(tmp_path, hub.endpoint, offline=True), revision="v1")
    assert p.returncode == 0 and Path(p.stdout.strip()).name == hub.commits[0], p.stderr


def test_unknown_private_and_gated_repos_are_one_line(tmp_path, hub):
    env = env_for(tmp_path, hub.endpoint)
    line = one_error_line(areal(env, "train", "model.path=org/nope", f"cluster.fileroot={tmp_path}"))
    assert f"model.path: there is no model repo org/nope on {hub.endpoint}" in line
    line = one_error_line(areal(env, "train", "model.path=org/private", f"cluster.fileroot={tmp_path}"))
    assert "(401 Unauthorized)" in line and "HF_TOKEN" in line
    line = one_error_line(areal(env, "train", "model.path=org/gated", f"cluster.fileroot={tmp_path}"))
    assert "org/gated is gated" in line and "HF_TOKEN" in line
    # With the token in HF_TOKEN the same repos download: the token reaches the hub.
    hub.clear()
    for repo in ("org/private", "org/gated"):
        p = fetch(env_for(tmp_path, hub.endpoint, HF_TOKEN="hf_secret"), repo=repo)
        assert p.returncode == 0 and Path(p.stdout.strip(), "config.json").is_file(), p.stderr
        assert set(hub.file_gets(repo)) == ALLOWED
    assert all(token for _, path, token in hub.requests if "/org/private" in path or "/org/gated" in path)


def test_validate_config_reads_the_cached_snapshot_without_the_network(tmp_path, hub):
    env = env_for(tmp_path, hub.endpoint)
    args = (
        "validate-config",
        f"model.path={REPO}",
        "experiment=cpu_default",  # the served model is a toy: 1024 positions, under real_model's 2048 tokens
        "engine=archon",
        "allocation_mode=hf:d1+archon:d1t4",
        "cluster.n_gpus_per_node=5",
    )
    # not cached, no preset names it: refused rather than checked against the tiny preset's facts
    before = one_error_line(areal(env, *args))
    assert f"the architecture of {REPO} is unknown here" in before and f"download {REPO}" in before
    assert fetch(env).returncode == 0
    hub.clear()
    after = one_error_line(
        areal(env, *args)
    )  # cached: the snapshot's config.json (6 heads), named after the repo
    assert "t=4 does not divide model.num_attention_heads=6 (model hubtiny)" in after
    ok = areal(
        env,
        "validate-config",
        f"model.path={REPO}",
        "experiment=cpu_default",
        "engine=archon",
        "allocation_mode=hf:d1+archon:d1t3",
        "cluster.n_gpus_per_node=4",
    )
    assert ok.returncode == 0, ok.stderr
    assert hub.requests == []  # validate-config never talks to the hub


def test_node_runner_fetches_and_records_its_error(tmp_path, hub):
    """What each slurm/skypilot node runs before its processes start (NodeRunner.fetch_model): the hub id
    becomes this node's snapshot; a failure is recorded for the submitting CLI as the same one line."""
    code = (
        "import sys, json\n"
        "from areal_cli.plan.compose import load_config\n"
        "from areal_cli.job.layout import JobLayout\n"
        "from areal_cli.job.status import read_node_error\n"
        "from areal_cli.launchers.local import NodeRunner\n"
        "from areal_cli.errors import ConfigError\n"
        "cfg = load_config([])\n"
        "r = NodeRunner(cfg, JobLayout(), sys.argv[1], node_rank=1, model_path=sys.argv[2],\n"
        "               model_revision='v1')\n"
        "try:\n"
        "    r.fetch_model()\n"
        "    print(json.dumps({'path': r.model_path}))\n"
        "except ConfigError as e:\n"
        "    print(json.dumps({'raised': str(e), 'read': str(read_node_error(sys.argv[1])),\n"
        "                      'type': type(read_node_error(sys.argv[1])).__name__}))\n"
    )
    env = env_for(tmp_path, hub.endpoint)
    ok = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "run"), REPO],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    assert Path(json.loads(ok.stdout)["path"]).name == hub.commits[0]
    bad = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "run2"), "org/nope"],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    out = json.loads(bad.stdout)
    assert (
        out["type"] == "ConfigError"
        and out["read"] == out["raised"]
        and "no model repo org/nope" in out["read"]
    )
    assert (tmp_path / "run2" / "node_errors" / "1.json").is_file()


def test_pin_revision_and_the_ray_node_task(tmp_path, hub):
    """``areal train`` with a launcher whose nodes fetch pins the revision to a commit first; the Ray
    launcher's per-node task returns the snapshot, or the error as a record (ConfigError does not pickle)."""
    code = (
        "import sys, json\n"
        "from areal_cli.models.hub import pin_revision\n"
        "from areal_cli.launchers.ray import _fetch_on_node\n"
        "from areal_cli.job.status import error_from_record\n"
        "out = {'main': pin_revision(sys.argv[1]), 'v1': pin_revision(sys.argv[1], 'v1')}\n"
        "out['node'] = _fetch_on_node(sys.argv[1], out['v1'], {})\n"
        "bad = _fetch_on_node('org/nope', '', {})\n"
        "out['bad'] = str(error_from_record(bad['error']))\n"
        "try:\n"
        "    pin_revision('org/nope')\n"
        "except Exception as e:\n"
        "    out['pin_bad'] = f'{type(e).__name__}: {e}'\n"
        "print(json.dumps(out))\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code, REPO],
        check=False,
        capture_output=True,
        text=True,
        env=env_for(tmp_path, hub.endpoint),
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["main"] == hub.commits[1] and out["v1"] == hub.commits[0]
    assert Path(out["node"]["path"]).name == hub.commits[0]
    assert out["bad"].startswith("model.path: there is no model repo org/nope")
    assert out["pin_bad"].startswith("ConfigError: model.path: there is no model repo org/nope")
    # Offline, a revision the cache knows pins to its commit; one it does not stays as given (the nodes
    # resolve it).
    assert fetch(env_for(tmp_path, hub.endpoint), revision="v1").returncode == 0  # records refs/v1
    pin = (
        "import sys\nfrom areal_cli.models.hub import pin_revision\n"
        "print(pin_revision(sys.argv[1], 'v1'), pin_revision(sys.argv[1], 'v2') or '-')"
    )
    p = subprocess.run(
        [sys.executable, "-c", pin, REPO],
        check=False,
        capture_output=True,
        text=True,
        env=env_for(tmp_path, hub.endpoint, offline=True),
        timeout=60,
    )
    assert p.stdout.split() == [hub.commits[0], "v2"], p.stderr
