"""Fused one-token GQA attention for :class:`~areal_cli.inference.server.fastpath.FastRunner`'s decode step.

Why C: on CPU the decode attention of a small model is bound by cache misses and per-call overhead,
not FLOPs. With torch ops a layer costs two ``bmm`` calls of ``rows x kv_heads`` tiny GEMMs, a mask
add, a softmax and an ``index_put`` for the new K/V column. This kernel does all of it in one pass
per (row, KV head) — write the new column, scores for the head's query group over the row's own
``len + 1`` columns only (no mask, no padding work), softmax, weighted sum of V — and prefetches the
next (row, head) block while computing the current one. Measured on the 12-layer benchmark model
(batch 32, 1 thread): ~0.6 ms/layer vs ~0.9 ms/layer for the torch ops, ~12% of a decode step.

It is compiled on first use with the system C compiler (``$CC``, else ``cc``/``gcc``; ~1 s) into
``$AREAL_KERNEL_CACHE`` (default ``~/.cache/areal_cli/kernels``), keyed by source, flags, compiler and
CPU, and loaded with :mod:`ctypes` (which releases the GIL during the call). No compiler, a failed
build, non-fp32 weights or more than one intra-op thread (the kernel is single-threaded; torch's
``bmm`` is not) → the torch ops are used; :func:`load` says why.

Numerics: the same math in a different summation order (``-ffast-math`` reassociates sums; ``expf``
from glibc's vector math library) — logits agree with the torch path to ~1e-6.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger("areal_cli.hf_server")

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <float.h>

/* K slab [R, H, D, C] (transposed), V slab [R, H, C, D], both contiguous; q/k_new/v_new rows with
   heads contiguous (head stride D); q head h*G+g is query g of KV head h. Row r writes column
   pos[r] and attends to columns 0..pos[r]. out [B, H*G, D] contiguous; s >= max(pos)+1 floats. */
void decode_attention(int64_t B, int64_t H, int64_t G, int64_t D, int64_t C,
                      const float* restrict q, int64_t q_rs, const float* restrict kn, int64_t k_rs,
                      const float* restrict vn, int64_t v_rs, float* restrict K, float* restrict V,
                      const int64_t* restrict pos, float* restrict out, float* restrict s)
{
    for (int64_t r = 0; r < B; ++r) {
        const int64_t p = pos[r], L = p + 1;
        for (int64_t h = 0; h < H; ++h) {
            const int64_t nr = (h + 1 < H) ? r : r + 1, nh = (h + 1 < H) ? h + 1 : 0;
            if (nr < B) { /* the slab walk is latency-bound: fetch the next block ahead */
                const int64_t nL = pos[nr] + 1;
                const float* nK = K + (nr * H + nh) * D * C;
                const float* nV = V + (nr * H + nh) * C * D;
                for (int64_t d = 0; d < D; ++d)
                    for (int64_t j = 0; j < nL; j += 16) __builtin_prefetch(nK + d * C + j, 0, 3);
                for (int64_t x = 0; x < nL * D; x += 16) __builtin_prefetch(nV + x, 0, 3);
            }
            float* restrict Kh = K + (r * H + h) * D * C;
            float* restrict Vh = V + (r * H + h) * C * D;
            const float* kh = kn + r * k_rs + h * D;
            const float* vh = vn + r * v_rs + h * D;
            for (int64_t d = 0; d < D; ++d) { Kh[d * C + p] = kh[d]; Vh[p * D + d] = vh[d]; }
            for (int64_t g = 0; g < G; ++g) {
                const float* restrict qv = q + r * q_rs + (h * G + g) * D;
                for (int64_t j = 0; j < L; ++j) s[j] = 0.f;
                for (int64_t d = 0; d < D; ++d) {
                    const float qd = qv[d];
                    const float* restrict kr = Kh + d * C;
                    for (int64_t j = 0; j < L; ++j) s[j] += qd * kr[j];
                }
                float m = -FLT_MAX;
                for (int64_t j = 0; j < L; ++j) m = s[j] > m ? s[j] : m;
                float sum = 0.f;
                for (int64_t j = 0; j < L; ++j) { s[j] = expf(s[j] - m); sum += s[j]; }
                float* restrict o = out + ((r * H + h) * G + g) * D;
                for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
                for (int64_t j = 0; j < L; ++j) {
                    const float pj = s[j];
                    const float* restrict vr = Vh + j * D;
                    for (int64_t d = 0; d < D; ++d) o[d] += pj * vr[d];
                }
                const float inv = 1.f / sum;
                for (int64_t d = 0; d < D; ++d) o[d] *= inv;
            }
        }
    }
}
"""
# -ffast-math only when compiling: linking with it would pull in crtfastmath.o, which switches the whole
# process to flush-denormals-to-zero when the library loads.
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fPIC"]
_I, _P = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES = [_I, _I, _I, _I, _I, _P, _I, _P, _I, _P, _I, _P, _P, _P, _P, _P]

_lock = threading.Lock()
_loaded: tuple[object | None, str | None] | None = None


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features", "model name")):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_dir() -> Path:
    root = os.environ.get("AREAL_KERNEL_CACHE")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "areal_cli" / "kernels"


def _build(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([SOURCE, *CFLAGS, version, _cpu_id()]).encode()).hexdigest()[:16]
    for d in (_cache_dir(), Path(tempfile.gettempdir()) / "areal_cli_kernels"):
        so = d / f"decode_attention_{key}.so"
        if so.exists():
            return so
        try:
            d.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=d) as tmp:
                src, obj, out = Path(tmp, "k.c"), Path(tmp, "k.o"), Path(tmp, "k.so")
                src.write_text(SOURCE)
                for argv in ([cc, *CFLAGS, "-c", str(src), "-o", str(obj)],
                             [cc, "-shared", str(obj), "-o", str(out), "-lm"]):
                    r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
                    if r.returncode != 0:
                        raise RuntimeError(f"{' '.join(argv)} failed: {r.stderr.strip()[-500:]}")
                os.replace(out, so)  # atomic: concurrent servers building the same key are fine
            return so
        except OSError:
            continue  # unwritable cache dir: try the next one
    raise RuntimeError(f"no writable kernel cache directory ({_cache_dir()} or the temp dir)")


def load() -> tuple[object | None, str | None]:
    """``(kernel, None)``, or ``(None, reason)`` when it cannot be built here (cached per process)."""
    global _loaded
    with _lock:
        if _loaded is None:
            cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
            if not cc:
                _loaded = (None, "no C compiler (set $CC or install gcc)")
            else:
                try:
                    fn = ctypes.CDLL(str(_build(cc))).decode_attention
                    fn.argtypes, fn.restype = _ARGTYPES, None
                    _loaded = (fn, None)
                except Exception as e:  # a broken toolchain must not stop the server
                    _loaded = (None, f"kernel build failed: {e}")
        return _loaded


def usable(dtype: torch.dtype, device: torch.device, check_threads: bool = True) -> str | None:
    """``None`` when the kernel applies to a runner of this dtype/device; else why not."""
    if device.type != "cpu":
        return f"device {device.type}"
    if dtype != torch.float32:
        return f"dtype {dtype} (the kernel is fp32)"
    if check_threads and torch.get_num_threads() != 1:
        return f"{torch.get_num_threads()} intra-op threads (the kernel is single-threaded)"
    return load()[1]


def decode_attention(fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kslab: torch.Tensor,
                     vslab: torch.Tensor, pos: torch.Tensor, out: torch.Tensor,
                     scratch: torch.Tensor) -> None:
    """Write ``k``/``v`` (``[B, kv, D]``) at column ``pos`` of each row and attend: ``out[B, heads*D]``.

    ``q`` is ``[B, heads, D]`` with the softmax scale folded in. Layouts are the caller's invariants
    (the runner checks head contiguity per layer), so this only passes pointers.
    """
    b, nh, d = q.shape
    nkv = k.shape[1]
    fn(b, nkv, nh // nkv, d, kslab.shape[3], q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0),
       v.data_ptr(), v.stride(0), kslab.data_ptr(), vslab.data_ptr(), pos.data_ptr(), out.data_ptr(),
       scratch.data_ptr())
