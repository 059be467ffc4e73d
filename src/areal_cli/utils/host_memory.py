"""Host (CPU) memory of a training rank: keep freed tensors from staying resident.

glibc serves an allocation below its *dynamic* mmap threshold from a heap, and the threshold climbs to
32 MiB once a large block has been freed. Layer-sized tensors (a few MiB to 32 MiB) then come from the
heap, and a pattern every sharded engine has (allocate a full tensor, keep a slice of it, free the full
one: ZeRO-3 partitioning, gathered buckets, row reads, export gathers) leaves the freed space in holes
under the survivors, which the heap cannot give back. Measured on a 0.36B model, DeepSpeed ZeRO-3 at d2:
1.3 GiB of the 4.2 GiB initialisation peak per rank was such holes (``benchmarks/engine_memory.py
--peak``; ``docs/training.md``, "Engines at scale").

So each rank fixes the threshold at :data:`MMAP_THRESHOLD` (blocks at least that big are mapped on
their own and unmapped when freed) and trims the heap (:func:`release`) after the phases that churn
through large host tensors: initialisation, a load, an export, a weight push. A user who set glibc's
own ``MALLOC_MMAP_THRESHOLD_`` keeps it; ``AREAL_MMAP_THRESHOLD=0`` leaves glibc's default behaviour.
Not glibc (musl, macOS): nothing to do, every call is a no-op.

The fixed threshold has a price: every block above it is mapped fresh and its pages faulted in at
each use, so a step's activations above 1 MiB cost page faults they would not cost from the heap.
For a model whose whole checkpoint is under :data:`SMALL_MODEL_BYTES` the holes the threshold
prevents are a few copies of a small model at worst, while the faults made the embedded default's
train step 1.12x slower (0.073 against 0.065 s, one thread); :func:`fit_model` then moves the
threshold to :data:`SMALL_MODEL_THRESHOLD`.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

MMAP_THRESHOLD = 1 << 20  # 1 MiB: above small per-op temporaries, below every layer-sized tensor
SMALL_MODEL_BYTES = 256 << 20  # a checkpoint this small keeps its activations on the heap
SMALL_MODEL_THRESHOLD = 32 << 20  # glibc's own ceiling for its dynamic threshold
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)
_libc: ctypes.CDLL | None | bool = False  # False: not looked up yet


def _glibc() -> ctypes.CDLL | None:
    global _libc
    if _libc is False:
        _libc = None
        try:
            if os.confstr("CS_GNU_LIBC_VERSION"):
                _libc = ctypes.CDLL("libc.so.6")
        except (ValueError, OSError, AttributeError):
            _libc = None
    return _libc  # type: ignore[return-value]


def threshold() -> int:
    """The threshold this process asks for: ``AREAL_MMAP_THRESHOLD`` (bytes; 0 = leave glibc's), else
    :data:`MMAP_THRESHOLD`; 0 too when glibc's own ``MALLOC_MMAP_THRESHOLD_`` is set."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return 0
    raw = os.environ.get("AREAL_MMAP_THRESHOLD", "").strip()
    if not raw:
        return MMAP_THRESHOLD
    try:
        value = int(raw)
    except ValueError:
        from areal_cli.errors import ConfigError

        raise ConfigError("AREAL_MMAP_THRESHOLD", f"not a byte count: {raw!r}",
                          "set it to an integer number of bytes (0 leaves glibc's default)") from None
    return max(0, value)


def configure() -> bool:
    """Fix glibc's mmap threshold for this process (idempotent); True when it was set."""
    libc, value = _glibc(), threshold()
    if libc is None or value == 0:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(value)))


def release() -> None:
    """Give the heap's free pages back to the OS (glibc's ``malloc_trim``, which also returns whole free
    pages in the middle of the heap)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(ctypes.c_size_t(0))


def checkpoint_bytes(model_dir: str | Path) -> int:
    """Bytes of the model's weight files in ``model_dir`` (safetensors, else PyTorch ``.bin``); 0 if none."""
    d = Path(model_dir)
    if not d.is_dir():
        return 0
    files = list(d.glob("*.safetensors")) or list(d.glob("*.bin"))
    return sum(f.stat().st_size for f in files)


def fit_model(model_dir: str | Path) -> bool:
    """After :func:`configure`: for a model whose weight files are under :data:`SMALL_MODEL_BYTES`, raise
    the threshold to :data:`SMALL_MODEL_THRESHOLD` (see the module docstring). A threshold the user
    chose stays. True when it was raised."""
    libc = _glibc()
    if libc is None or threshold() != MMAP_THRESHOLD:
        return False
    size = checkpoint_bytes(model_dir)
    if not 0 < size < SMALL_MODEL_BYTES:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(SMALL_MODEL_THRESHOLD)))
