"""Fused C kernels for :class:`~areal_cli.inference.server.fastpath.FastRunner`: causal GQA attention
over the KV slabs, RMSNorm and SiLU-gating.

Why C: on CPU the forward of a small model is bound by cache misses and per-op overhead outside the
weight GEMMs, not by FLOPs. With torch ops a layer's decode attention costs a RoPE (five elementwise
ops), two ``bmm`` calls of ``rows x kv_heads`` tiny GEMMs, a mask add, a softmax and an ``index_put``
for the new K/V column; a prefill adds padding, masks and copies. :meth:`Kernels.attention` does it
in one pass per (token, KV head) straight from the QKV GEMM's output — optional per-head q/k RMSNorm
(Qwen3), RoPE, write the new K/V column, scores for the head's query group over the row's own
columns only (no mask, no padding work), softmax, weighted sum of V — and prefetches the next block
while computing the current one; the same call serves decode (one token per row) and prefill (a
packed batch of prompts, each token attending to its row's prefix). RMSNorm and ``silu(gate) * up``
are one call each into preallocated buffers: ``F.rms_norm`` took ~25 us per ``[64, 256]`` call, the
C one ~4 us (ctypes' ~1.5 us included). Measured on the 12-layer benchmark model, 1 thread, batch 64:
decode attention ~0.4 ms/layer (the previous kernel, K transposed and its next block fetched up
front: ~0.5 ms), prefill of 64 prompts 340 ms (torch ops: 440 ms). What is left of attention is
reading the cache: ~47 MB per step at batch 64 (context ~60), mostly from L3.

It is compiled on first use with the system C compiler (``$CC``, else ``cc``/``gcc``; ~1 s) into
``$AREAL_KERNEL_CACHE`` (default ``~/.cache/areal_cli/kernels``), keyed by source, flags, compiler and
CPU, and loaded with :mod:`ctypes`. No compiler, a failed build, non-fp32 weights, a head size that is
not a multiple of 16 or more than one intra-op thread (the kernels are single-threaded; torch's ops
are not) → the torch ops are used; :func:`load` / :func:`usable` say why.

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

/* 16 floats, any alignment: GCC/Clang vector extensions lower this to AVX-512, AVX2 or SSE. */
typedef float v16 __attribute__((vector_size(64), aligned(4)));
#define LD(p) (*(const v16*)(p))

/* HF's RMSNorm in fp32: (x * rsqrt(mean(x^2) + eps)) * w. */
static inline void rms_row(const float* restrict x, const float* restrict w, float eps, int64_t n,
                           float* restrict out)
{
    float ss = 0.f;
    for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
    const float r = 1.f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; ++i) out[i] = (x[i] * r) * w[i];
}

void rms_norm(int64_t T, int64_t n, const float* x, int64_t x_rs, const float* w, float eps,
              float* out, int64_t o_rs)
{
    for (int64_t t = 0; t < T; ++t) rms_row(x + t * x_rs, w, eps, n, out + t * o_rs);
}

/* out[t] = silu(gu[t, :n]) * gu[t, n:] (the fused gate/up projection's output). */
void silu_mul(int64_t T, int64_t n, const float* restrict gu, float* restrict out)
{
    for (int64_t t = 0; t < T; ++t) {
        const float* g = gu + t * 2 * n;
        const float* u = g + n;
        float* o = out + t * n;
        for (int64_t i = 0; i < n; ++i) o[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}

/* Optional per-head RMSNorm (Qwen3's q_norm/k_norm), then HF's rotate-half RoPE. */
static inline void norm_rope(const float* restrict x, const float* restrict nw, float eps,
                             const float* restrict c, const float* restrict sn, int64_t D,
                             float* restrict tmp, float* restrict out)
{
    if (nw) { rms_row(x, nw, eps, D, tmp); x = tmp; }
    const int64_t half = D / 2;
    for (int64_t i = 0; i < half; ++i) {
        out[i] = x[i] * c[i] - x[i + half] * sn[i];
        out[i + half] = x[i + half] * c[i + half] + x[i] * sn[i + half];
    }
}

/* Causal GQA attention of B tokens from the raw fused QKV output (token t at qkv + t*rs: H*G query
   heads, H key heads, H value heads, D each; the softmax scale already folded into q).
   K and V slabs [R, H, C, D], contiguous, D a multiple of 16: a (row, head) block's used columns are
   one contiguous run, which the prefetcher streams (a transposed K, [D, C], was D short strided
   runs and slower from L3). Token t belongs to slab row rows[t] (NULL: row t) at position pos[t]:
   it normalises/rotates its key, writes it and its value at that column, and attends over columns
   0..pos[t]. Tokens run in order, so a prompt's tokens (increasing positions of one row) see exactly
   their prefix: the same kernel serves prefill (a packed batch of prompts) and decode (one token per
   row). out [B, H*G*D] contiguous; s: G*C + (G+1)*D floats of scratch. */
typedef float v8 __attribute__((vector_size(32), aligned(4)));
static inline float hsum(v16 a)  /* a tree, not 15 dependent adds */
{
    v8 lo, hi;
    __builtin_memcpy(&lo, &a, 32);
    __builtin_memcpy(&hi, (const char*)&a + 32, 32);
    lo += hi;
    return ((lo[0] + lo[4]) + (lo[1] + lo[5])) + ((lo[2] + lo[6]) + (lo[3] + lo[7]));
}

void decode_attention(int64_t B, int64_t H, int64_t G, int64_t D, int64_t C,
                      const float* restrict qkv, int64_t rs, const float* restrict cosb,
                      const float* restrict sinb, const float* restrict qn, const float* restrict kn,
                      float eps, float* restrict K, float* restrict V, const int64_t* restrict rows,
                      const int64_t* restrict pos, float* restrict out, float* restrict s)
{
    float* restrict ql = s + G * C;      /* the head group's rotated queries, G x D */
    float* restrict tmp = ql + G * D;    /* a normalised head (per-head norm) */
    const int64_t QW = H * G * D;
    for (int64_t r = 0; r < B; ++r) {
        const int64_t p = pos[r], L = p + 1, sr = rows ? rows[r] : r;
        const float* c = cosb + r * D;
        const float* sn = sinb + r * D;
        for (int64_t h = 0; h < H; ++h) {
            /* The next (row, head) block is fetched while this one computes: one of its K rows and
               one of its V rows per key processed here, the rest after. (Fetching it all up front
               stalled on the line-fill buffers before any compute could overlap.) */
            const int64_t nr = (h + 1 < H) ? r : r + 1, nh = (h + 1 < H) ? h + 1 : 0;
            const int64_t nL = nr < B ? pos[nr] + 1 : 0;
            const int64_t nsr = nr < B ? (rows ? rows[nr] : nr) : 0;
            const float* nK = K + (nsr * H + nh) * C * D;
            const float* nV = V + (nsr * H + nh) * C * D;
            float* restrict Kh = K + (sr * H + h) * C * D;
            float* restrict Vh = V + (sr * H + h) * C * D;
            const float* row = qkv + r * rs;
            norm_rope(row + QW + h * D, kn, eps, c, sn, D, tmp, Kh + p * D);
            const float* vh = row + QW + H * D + h * D;
            for (int64_t d = 0; d < D; ++d) Vh[p * D + d] = vh[d];
            for (int64_t g = 0; g < G; ++g)
                norm_rope(row + (h * G + g) * D, qn, eps, c, sn, D, tmp, ql + g * D);
            /* scores: each key row is read once for the whole query group */
            for (int64_t j = 0; j < L; ++j) {
                if (j < nL)
                    for (int64_t x = 0; x < D; x += 16) {
                        __builtin_prefetch(nK + j * D + x, 0, 3);
                        __builtin_prefetch(nV + j * D + x, 0, 3);
                    }
                const float* kr = Kh + j * D;
                for (int64_t g = 0; g < G; ++g) {
                    const float* qv = ql + g * D;
                    v16 a = LD(qv) * LD(kr);
                    for (int64_t d0 = 16; d0 < D; d0 += 16) a += LD(qv + d0) * LD(kr + d0);
                    s[g * C + j] = hsum(a);
                }
            }
            for (int64_t x = L * D; x < nL * D; x += 16) {
                __builtin_prefetch(nK + x, 0, 3);
                __builtin_prefetch(nV + x, 0, 3);
            }
            for (int64_t g = 0; g < G; ++g) {
                float* restrict sg = s + g * C;
                float m = -FLT_MAX;
                for (int64_t j = 0; j < L; ++j) m = sg[j] > m ? sg[j] : m;
                float sum = 0.f;
                for (int64_t j = 0; j < L; ++j) { sg[j] = expf(sg[j] - m); sum += sg[j]; }
                const float inv = 1.f / sum;
                float* restrict o = out + r * QW + (h * G + g) * D;
                /* P V: 16 output dims at a time, two columns per iteration (two FMA chains) */
                for (int64_t d0 = 0; d0 < D; d0 += 16) {
                    v16 a = {0}, b = {0};
                    const float* vr = Vh + d0;
                    int64_t j = 0;
                    for (; j + 1 < L; j += 2) {
                        a += sg[j] * LD(vr + j * D);
                        b += sg[j + 1] * LD(vr + (j + 1) * D);
                    }
                    if (j < L) a += sg[j] * LD(vr + j * D);
                    a = (a + b) * inv;
                    for (int64_t i = 0; i < 16; ++i) o[d0 + i] = a[i];
                }
            }
        }
    }
}
"""
# -ffast-math only when compiling: linking with it would pull in crtfastmath.o, which switches the whole
# process to flush-denormals-to-zero when the library loads.
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fPIC"]
_I, _P, _F = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_SIGNATURES = {
    "decode_attention": [_I, _I, _I, _I, _I, _P, _I, _P, _P, _P, _P, _F, _P, _P, _P, _P, _P, _P],
    "rms_norm": [_I, _I, _P, _I, _P, _F, _P, _I],
    "silu_mul": [_I, _I, _P, _P],
}


class Kernels:
    """The compiled functions, called on fp32 CPU tensors whose layouts the caller guarantees (only
    pointers and strides cross over)."""

    def __init__(self, path: str):
        # The attention (hundreds of us) releases the GIL like any ctypes call; the elementwise kernels
        # (a few us) keep it (PyDLL): dropping and retaking it twice per call would invite a switch to
        # the HTTP thread in the middle of a step.
        self._attn = ctypes.CDLL(path).decode_attention
        lib = ctypes.PyDLL(path)
        self._rms, self._silu = lib.rms_norm, lib.silu_mul
        for fn, name in ((self._attn, "decode_attention"), (self._rms, "rms_norm"), (self._silu, "silu_mul")):
            fn.argtypes, fn.restype = _SIGNATURES[name], None

    def attention(self, qkv: torch.Tensor, n_heads: int, n_kv: int, cos: torch.Tensor, sin: torch.Tensor,
                  q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float, kslab: torch.Tensor,
                  vslab: torch.Tensor, rows: torch.Tensor | None, pos: torch.Tensor, out: torch.Tensor,
                  scratch: torch.Tensor) -> None:
        """From ``qkv`` (``[B, (heads + 2 kv) * D]`` tokens, unit last stride; the softmax scale folded
        into q): norm (optional) and rotate q/k with ``cos``/``sin`` (``[B, D]`` contiguous), write k/v
        at column ``pos[t]`` of slab row ``rows[t]`` (None: row ``t``; int64) and attend causally over
        that row's columns ``0..pos[t]``: ``out`` ``[B, heads * D]`` contiguous.
        ``scratch``: at least ``G C + (G + 1) D`` floats (``C``: the slab capacity, ``G``: queries per KV
        head). Slabs: ``[R, kv, C, D]`` contiguous."""
        b, d, cap = qkv.shape[0], vslab.shape[3], vslab.shape[2]
        self._attn(b, n_kv, n_heads // n_kv, d, cap, qkv.data_ptr(), qkv.stride(0), cos.data_ptr(),
                   sin.data_ptr(), None if q_norm is None else q_norm.data_ptr(),
                   None if k_norm is None else k_norm.data_ptr(), eps, kslab.data_ptr(), vslab.data_ptr(),
                   None if rows is None else rows.data_ptr(), pos.data_ptr(), out.data_ptr(),
                   scratch.data_ptr())

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor) -> torch.Tensor:
        """HF's RMSNorm of 2-D ``x`` (unit last stride) into ``out`` (the same, may be ``x``)."""
        self._rms(x.shape[0], x.shape[1], x.data_ptr(), x.stride(0), w.data_ptr(), eps, out.data_ptr(),
                  out.stride(0))
        return out

    def silu_mul(self, gu: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``silu(gu[:, :n]) * gu[:, n:]`` into ``out`` ``[T, n]`` (both contiguous)."""
        self._silu(out.shape[0], out.shape[1], gu.data_ptr(), out.data_ptr())
        return out


_lock = threading.Lock()
_loaded: tuple[Kernels | None, str | None] | None = None


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
        so = d / f"fastpath_kernels_{key}.so"
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


def load() -> tuple[Kernels | None, str | None]:
    """``(kernels, None)``, or ``(None, reason)`` when they cannot be built here (cached per process)."""
    global _loaded
    with _lock:
        if _loaded is None:
            cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
            if not cc:
                _loaded = (None, "no C compiler (set $CC or install gcc)")
            else:
                try:
                    _loaded = (Kernels(str(_build(cc))), None)
                except Exception as e:  # a broken toolchain must not stop the server
                    _loaded = (None, f"kernel build failed: {e}")
        return _loaded


def usable(dtype: torch.dtype, device: torch.device, check_threads: bool = True,
           head_dim: int = 16) -> str | None:
    """``None`` when the kernels apply to a runner of this dtype/device/head size; else why not."""
    if device.type != "cpu":
        return f"device {device.type}"
    if dtype != torch.float32:
        return f"dtype {dtype} (the kernel is fp32)"
    if head_dim % 16:
        return f"head_dim {head_dim} (the kernel needs a multiple of 16)"
    if check_threads and torch.get_num_threads() != 1:
        return f"{torch.get_num_threads()} intra-op threads (the kernel is single-threaded)"
    return load()[1]
