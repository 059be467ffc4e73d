"""host_memory against glibc itself: the allocation pattern of a sharded load (allocate a layer-sized tensor,
keep a slice of it, free it) leaves the freed space resident under glibc's dynamic threshold, and neither
with the threshold the engines fix nor after a trim."""

import os
import subprocess
import sys
import textwrap

import pytest

from areal_cli.utils import host_memory

MIB = 1 << 20

PATTERN = textwrap.dedent("""
    import sys
    import torch
    from areal_cli.utils import host_memory

    def rss():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))

    host_memory.configure()
    base = rss()
    big = torch.empty(30 << 20, dtype=torch.uint8).fill_(1)
    del big  # a freed 30 MiB block: glibc raises its dynamic mmap threshold past it
    keep = []
    for i in range(60):  # growing sizes: a freed tensor's hole never fits the next one
        full = torch.empty((8 << 20) + i * (64 << 10), dtype=torch.uint8).fill_(1)
        keep.append(full[: 256 << 10].clone())
        del full
    held = rss() - base
    host_memory.release()
    print(held, rss() - base)
""")


def _run(**env) -> tuple[int, int]:
    out = subprocess.run([sys.executable, "-c", PATTERN], env={**os.environ, **env}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    held, trimmed = map(int, out.stdout.split())
    return held, trimmed


@pytest.mark.skipif(host_memory._glibc() is None, reason="glibc only")
def test_freed_layer_tensors_do_not_stay_resident(monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    held_glibc, trimmed_glibc = _run(AREAL_MMAP_THRESHOLD="0")
    held_fixed, _ = _run(AREAL_MMAP_THRESHOLD="")
    # glibc's default keeps most of the ~0.5 GiB freed (the pattern is meaningful) ...
    assert held_glibc > 256 * MIB, held_glibc
    # ... the fixed threshold keeps only the 60 slices (15 MiB) and some pages of the allocator
    assert held_fixed < 48 * MIB, held_fixed
    # ... and a trim gives the holes back even under glibc's default
    assert trimmed_glibc < 48 * MIB, trimmed_glibc


def test_threshold_knob(monkeypatch):
    from areal_cli.errors import ConfigError

    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("AREAL_MMAP_THRESHOLD", raising=False)
    assert host_memory.threshold() == host_memory.MMAP_THRESHOLD
    monkeypatch.setenv("AREAL_MMAP_THRESHOLD", "0")
    assert host_memory.threshold() == 0 and not host_memory.configure()
    monkeypatch.setenv("AREAL_MMAP_THRESHOLD", "4mb")
    with pytest.raises(ConfigError, match="AREAL_MMAP_THRESHOLD"):
        host_memory.threshold()
    monkeypatch.setenv("AREAL_MMAP_THRESHOLD", str(4 * MIB))
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # glibc's own setting wins
    assert host_memory.threshold() == 0


MAPPED = textwrap.dedent("""
    import ctypes, sys
    import torch
    from areal_cli.utils import host_memory

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    host_memory.configure()
    raised = host_memory.fit_model(sys.argv[1])
    before = libc.mallinfo2().hblks
    x = torch.empty(4 << 20, dtype=torch.uint8)  # an activation-sized block: mapped on its own, or heap
    print(int(raised), libc.mallinfo2().hblks - before)
""")


@pytest.mark.skipif(host_memory._glibc() is None, reason="glibc only")
def test_a_small_model_keeps_its_activations_on_the_heap(tmp_path, monkeypatch):
    """glibc's own count of mapped blocks: a 4 MiB tensor is mapped under the fixed 1 MiB threshold (a
    model at scale, or no weight files), and comes from the heap once the model is small."""
    import torch
    from safetensors.torch import save_file

    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("AREAL_MMAP_THRESHOLD", raising=False)
    small, big, empty = tmp_path / "small", tmp_path / "big", tmp_path / "empty"
    for d in (small, big, empty):
        d.mkdir()
    save_file({"w": torch.zeros(1024, 1024)}, str(small / "model.safetensors"))  # 4 MiB
    with open(big / "model.safetensors", "wb") as f:  # sparse: its size, no disk
        f.truncate(host_memory.SMALL_MODEL_BYTES + MIB)
    assert host_memory.checkpoint_bytes(small) > 4 * MIB and host_memory.checkpoint_bytes(empty) == 0

    def mapped(model_dir, **env):
        out = subprocess.run([sys.executable, "-c", MAPPED, str(model_dir)], env={**os.environ, **env},
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        return tuple(map(int, out.stdout.split()))

    assert mapped(small) == (1, 0)
    assert mapped(big) == (0, 1)
    assert mapped(empty) == (0, 1)
    assert mapped(small, AREAL_MMAP_THRESHOLD=str(2 * MIB)) == (0, 1)  # the user's threshold stays
