"""Storage probes on real filesystems: a good dir, a read-only mount, a nearly full tmpfs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from areal_cli.config.model import ModelConfig
from areal_cli.storage import estimate_checkpoint_bytes, param_count, run_storage_check
from areal_cli.storage.path_checks import check_filesystem, find_mount

SMALL_TP = 1024 * 1024  # keep throughput probes cheap on the shared 2-core machine


def _can_mount() -> bool:
    return os.geteuid() == 0 and os.path.exists("/usr/bin/mount")


needs_mount = pytest.mark.skipif(not _can_mount(), reason="needs root to mount tmpfs")


@pytest.fixture
def tmpfs(tmp_path):
    """Mount a tmpfs (options given by the test) and always unmount it."""
    mounted = []

    def make(opts: str) -> str:
        d = tmp_path / f"mnt-{uuid.uuid4().hex[:6]}"
        d.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "areal-test", str(d)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount tmpfs here: {r.stderr.strip()}")
        mounted.append(str(d))
        return str(d)

    yield make
    for d in reversed(mounted):
        subprocess.run(["umount", "-l", d], check=False)


def _by_check(report):
    return {r.check: r for r in report.results}


def test_good_dir_passes_every_check(tmp_path):
    path = str(tmp_path / "fileroot" / "new")  # does not exist yet: creatable
    rep = run_storage_check([path], required_bytes=1024, throughput_bytes=SMALL_TP)
    checks = _by_check(rep)
    assert rep.ok, rep.summary()
    for name in ("filesystem", "exists", "writable", "free space", "fsync latency", "write throughput",
                 "read throughput", "atomic rename", "file locking"):
        assert name in checks, name
        assert checks[name].status in ("pass", "warn"), (name, checks[name])
    assert checks["exists"].figure == "created"
    assert checks["free space"].value > 1024
    assert checks["fsync latency"].value > 0
    assert rep.exit_code() == 0
    # Probe files are cleaned up.
    assert os.listdir(path) == []


@needs_mount
def test_read_only_mount_fails_writable(tmpfs):
    ro = tmpfs("ro,size=1m")
    rep = run_storage_check([ro], throughput_bytes=SMALL_TP)
    checks = _by_check(rep)
    assert not rep.ok
    assert checks["writable"].status == "fail"
    assert "Read-only" in checks["writable"].figure
    assert "read-only" in checks["writable"].fix
    assert rep.exit_code() == 1
    # A path below it cannot even be created.
    rep2 = run_storage_check([os.path.join(ro, "sub")], throughput_bytes=SMALL_TP)
    assert _by_check(rep2)["exists"].status == "fail"


@needs_mount
def test_nearly_full_fs_fails_free_space(tmpfs):
    d = tmpfs("size=4m")
    with open(os.path.join(d, "filler"), "wb") as f:
        f.write(b"\0" * (3 * 1024 * 1024))
    need = estimate_checkpoint_bytes(ModelConfig(), keep=2)  # the tiny default model: a few MiB
    assert need > 1024 * 1024
    rep = run_storage_check([d], required_bytes=need, throughput_bytes=SMALL_TP)
    fs = _by_check(rep)["free space"]
    assert fs.status == "fail", fs
    assert fs.value < need
    assert "keep_checkpoints" in fs.fix
    # The same fs passes when the run is small enough.
    rep_small = run_storage_check([d], required_bytes=1024, throughput_bytes=64 * 1024)
    assert _by_check(rep_small)["free space"].status == "pass"


@needs_mount
def test_filesystem_type_from_proc_mounts(tmpfs):
    d = tmpfs("size=1m")
    m = find_mount(os.path.join(d, "not", "yet"))
    assert m is not None and m.mount_point == d and m.fstype == "tmpfs" and not m.network
    r = check_filesystem(d, multi_node=True)
    assert r.status == "warn" and "multi-node" in r.fix and "tmpfs (local)" in r.figure
    assert check_filesystem(d, multi_node=False).status == "pass"


def test_find_mount_parses_network_types(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text(
        "/dev/vda / ext4 rw,relatime 0 0\n"
        "nas:/export /shared nfs4 rw,vers=4.2 0 0\n"
        "JuiceFS:vol /shared/juice fuse.juicefs rw 0 0\n"
        "lustre@tcp:/fs /scratch\\040space lustre rw 0 0\n")
    assert find_mount("/shared/areal", str(mounts)).fstype == "nfs4"
    assert find_mount("/shared/areal", str(mounts)).network
    juice = find_mount("/shared/juice/x", str(mounts))
    assert juice.fstype == "fuse.juicefs" and juice.network
    assert find_mount("/scratch space/run", str(mounts)).fstype == "lustre"
    assert not find_mount("/home/u", str(mounts)).network


def test_param_count_matches_tiny_model_weights(tiny_model_dir):
    """Facts from the model's config.json vs. the tensors actually stored in its safetensors file."""
    import glob
    import struct

    facts = json.loads(open(os.path.join(tiny_model_dir, "config.json")).read())
    fields = set(ModelConfig.__dataclass_fields__)
    m = ModelConfig(**{k: v for k, v in facts.items() if k in fields})
    stored = 0
    for f in glob.glob(os.path.join(tiny_model_dir, "*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                numel = 1
                for d in meta["shape"]:
                    numel *= d
                stored += numel
    assert stored > 0 and param_count(m) == stored


@pytest.mark.slow  # imports transformers (tens of seconds on a loaded 2-core box)
def test_param_count_matches_hf_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    for kw in (dict(), dict(tie_word_embeddings=False, num_hidden_layers=3, vocab_size=1000),
               dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3, intermediate_size=200)):
        m = ModelConfig(**kw)
        hf = Qwen2Config(vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
                         num_hidden_layers=m.num_hidden_layers, num_attention_heads=m.num_attention_heads,
                         num_key_value_heads=m.num_key_value_heads, tie_word_embeddings=m.tie_word_embeddings)
        import torch

        with torch.device("meta"):  # shapes only: no weight init
            model = Qwen2ForCausalLM(hf)
        want = sum(p.numel() for p in model.parameters())
        assert param_count(m) == want, kw


def test_checkpoint_estimate_scales_with_keep_and_dtype():
    m = ModelConfig(hidden_size=128, intermediate_size=512)
    n = param_count(m)
    assert estimate_checkpoint_bytes(m, 1, dtype="bfloat16", with_optimizer=False) == 2 * n * 2
    assert estimate_checkpoint_bytes(m, 3, dtype="float32") == (4 * n + 4 * n + 8 * n) * 4
    # bf16: a bf16 export, but the recover state holds the fp32 masters (engines/precision.py)
    assert estimate_checkpoint_bytes(m, 1, dtype="bfloat16") == (2 * n + 4 * n + 8 * n) * 2
    # A 7B-class config lands in the right order of magnitude (tens of GB per checkpoint).
    big = ModelConfig(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                      num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)
    assert 7.0e9 < param_count(big) < 8.0e9


def test_a_run_is_charged_for_the_checkpoints_it_can_hold_not_for_keep_alone():
    from areal_cli.plan.compose import load_config
    from areal_cli.storage import estimate_run_bytes

    def need(*overrides):
        return estimate_run_bytes(load_config(["trainer.recover_every=0", *overrides]))

    cfg = load_config([])
    one = estimate_checkpoint_bytes(cfg.model, 1, dtype=cfg.engine.dtype, with_optimizer=False)  # 2 exports
    # 60 steps, an export every 5: 12 exports and the final one at most, whatever keep_checkpoints allows
    assert need("trainer.total_steps=60", "trainer.save_every=5", "trainer.keep_checkpoints=1000") == \
        need("trainer.total_steps=60", "trainer.save_every=5", "trainer.keep_checkpoints=13") == 14 * one // 2
    assert need("trainer.total_steps=60", "trainer.save_every=5", "trainer.keep_checkpoints=3") == 4 * one // 2
    assert need("trainer.total_steps=60", "trainer.save_every=0", "trainer.keep_checkpoints=5") == one  # final only
    # a length in epochs is not known here: keep_checkpoints stands
    assert need("trainer.total_epochs=2", "trainer.save_every=5", "trainer.keep_checkpoints=50") == 51 * one // 2


@needs_mount
def test_cli_json_and_exit_codes(tmpfs, tmp_path):
    ro = tmpfs("ro,size=1m")
    good = str(tmp_path / "good")
    r = subprocess.run([sys.executable, "-m", "areal_cli.cli.main", "check-storage", good, ro, "--json",
                        "--required-gb", "0", "--throughput-mb", "1", "--create"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    out = json.loads(r.stdout)
    assert out["ok"] is False
    failed = {(x["path"], x["check"]) for x in out["results"] if x["status"] == "fail"}
    assert (ro, "writable") in failed
    assert not any(p == good for p, _ in failed)
    r2 = subprocess.run([sys.executable, "-m", "areal_cli.cli.main", "check-storage", good,
                         "--required-gb", "0", "--throughput-mb", "1"], capture_output=True, text=True, timeout=120)
    assert r2.returncode == 0, r2.stdout + r2.stderr
    assert "file locking" in r2.stdout and "pass" in r2.stdout


def test_nodes_creating_the_same_path_at_once_all_pass(tmp_path):
    """The probes of several nodes check a new path at the same moment (real processes, 40 fresh paths):
    each must see a directory, created by itself or by another. A check that asked ``isdir`` and then
    ``exists`` once took another node's fresh directory for a file (CI, test_storage_crossnode)."""
    import multiprocessing as mp

    from areal_cli.storage.path_checks import check_exists

    paths = [str(tmp_path / f"p{i}" / "shared") for i in range(40)]
    with mp.get_context("fork").Pool(4) as pool:
        results = pool.map(_exists_status, [p for p in paths for _ in range(4)])
    assert all(status == "pass" for status, _ in results), [r for r in results if r[0] != "pass"][:3]
    assert {fig for _, fig in results} <= {"created", "directory exists"}
    assert check_exists(paths[0]).figure == "directory exists"
    f = tmp_path / "a_file"
    f.write_text("x")
    bad = check_exists(str(f))
    assert bad.status == "fail" and bad.figure == "exists but is not a directory"
    assert check_exists(str(tmp_path / "nope"), create=False).figure == "missing"


def _exists_status(path: str) -> tuple[str, str]:
    from areal_cli.storage.path_checks import check_exists

    r = check_exists(path)
    return r.status, r.figure


def test_runs_checking_one_fileroot_at_once_all_pass(tmp_path):
    """Runs started at the same moment on one fileroot check it at once (real processes): one run's cleanup
    must not remove the probe directory another run is writing in (two `areal train` on one fileroot once
    failed with "atomic rename: No such file or directory")."""
    import multiprocessing as mp

    path = str(tmp_path / "fileroot")
    os.makedirs(path)
    ctx = mp.get_context("fork")
    start, out = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_local_failures, args=(path, start, out)) for _ in range(4)]
    for p in procs:
        p.start()
    failed = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join()
    assert failed == [[]] * 4, [f[:3] for f in failed]
    assert os.listdir(path) == []  # every probe cleaned up


def _local_failures(path: str, start, out) -> None:
    from areal_cli.storage.path_checks import run_local_checks

    start.wait()
    out.put([f"{r.check}: {r.figure}" for _ in range(50)
             for r in run_local_checks(path, throughput_bytes=0) if r.failed])
