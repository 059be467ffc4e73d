"""Hardware profiles for ``areal plan``: what one device can do, from the vendor's published specs plus an
efficiency factor per kind of work, or measured on this machine by ``areal plan --calibrate``.

Published peaks are never reached: an RL step mixes prefill (compute-bound, high MFU), decode (bound by
reading the weights and KV cache once per token, so by HBM bandwidth) and training (compute-bound, lower MFU
than pretraining: variable lengths, small micro-batches, recompute). The efficiency factors below are the
fractions of peak that tuned stacks report for each kind of work (Megatron-LM and torchtitan MFU tables,
SGLang/vLLM decode roofline studies, nccl-tests bus bandwidth); `docs/plan.md` says where they come from and
how far the model is off against published RL runs.

Torch-free: ``areal plan`` without ``--calibrate`` must start instantly.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

from areal_cli.errors import ConfigError, did_you_mean

if TYPE_CHECKING:
    from areal_cli.config.cluster import ClusterConfig
    from areal_cli.config.schema import ExperimentConfig


@dataclass(frozen=True)
class HardwareProfile:
    """One device kind. Rates are per device; bandwidths are one direction, in GB/s (1e9 bytes)."""

    name: str
    kind: str  # "gpu" | "cpu"
    matmul_tflops: float  # dense 16-bit peak on a GPU; measured fp32 GEMM rate of the whole host on CPU
    mem_gb: float  # device memory (HBM); on CPU the host RAM
    mem_bw_gbs: float  # HBM bandwidth; on CPU measured STREAM-like copy bandwidth
    intra_node_gbs: float  # device-to-device within a node (NVLink/PCIe), per direction
    inter_node_gbs: float  # network per device, per direction
    # Fractions of the peaks above that each kind of work achieves.
    train_mfu: float = 0.35
    prefill_mfu: float = 0.5
    decode_bw_eff: float = 0.6
    comm_eff: float = 0.75
    # Fixed costs the rates do not capture: one decode iteration of the server (kernel launches, scheduling,
    # sampling), one request round trip, one training micro-batch and one optimizer step (Python and launch
    # overheads), and the resident memory of a process before it holds any model (CUDA context or, on CPU,
    # the interpreter with torch imported).
    decode_iter_s: float = 0.004
    request_s: float = 0.002
    train_mb_s: float = 0.01
    optim_step_s: float = 0.01
    process_base_gb: float = 1.0
    # A server process before its weights and KV cache (its HTTP stack, tokenizer, kernels); 0: as a trainer's.
    server_base_gb: float = 0.0
    # Per running row per decode iteration, beyond its FLOPs and KV reads (sampling, bookkeeping): the slope
    # of iteration time in the batch that --calibrate measures on the built-in server. 0 on GPUs (batched).
    decode_row_s: float = 0.0
    # Latency of one small collective (a TP all-reduce of a decode step, one tensor of a weight broadcast):
    # NCCL within a node ~10-20 us; gloo over loopback on CPU ~0.1-0.3 ms.
    collective_s: float = 2e-5
    # Where a disk weight push goes: write then read back (a node's NVMe or a shared filesystem), GB/s.
    disk_gbs: float = 2.0
    # What a tensor-parallel layout costs beyond its FLOPs and bytes, as --calibrate measures it on a CPU
    # host (DTensor's per-operator dispatch and redistribution): a fixed cost per layer per micro-batch
    # pass (forward 1, backward 2), and the fraction of the ideal 1/t per-token speed-up that TP reaches.
    # 0 and 1 on GPUs, where TP is its NVLink traffic (the comm terms).
    tp_layer_s: float = 0.0
    tp_token_eff: float = 1.0
    # CPU hosts, from --calibrate: train_mfu as the engines' RL step reaches it, measured at more than one
    # model width and micro-batch size: [[hidden size, tokens per micro-batch, mfu], ...]. A one-thread
    # step's efficiency depends on both: wider matrices run closer to the GEMM rate, and a micro-batch whose
    # activations outgrow the caches runs further from it. Between measured points the log-linear
    # interpolation, outside them the nearest. Empty: train_mfu everywhere (GPU profiles).
    train_mfu_points: list = field(default_factory=list)
    # CPU hosts: cores the host-wide rates above were measured over (a process with one thread gets
    # matmul_tflops / cores); 0 on GPUs, or this machine's os.cpu_count() when unknown.
    cores: int = 0
    # On a CPU host every process shares the same cores: work of two pools does not overlap in time.
    shared_compute: bool = False
    source: str = ""
    calibrated: dict = field(default_factory=dict)  # what --calibrate measured, raw

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> HardwareProfile:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def train_mfu_at(self, hidden: int, mb_tokens: float) -> float:
        """``train_mfu`` for a model of this hidden size at this micro-batch size (``train_mfu_points``)."""
        if not self.train_mfu_points:
            return self.train_mfu
        by_h: dict[int, list[tuple[float, float]]] = {}
        for h, t, v in self.train_mfu_points:
            by_h.setdefault(int(h), []).append((float(t), float(v)))
        at_h = [(float(h), _log_interp(sorted(pts), mb_tokens)) for h, pts in sorted(by_h.items())]
        return _log_interp(at_h, hidden)

    @property
    def server_base(self) -> float:
        return self.server_base_gb or self.process_base_gb

    def with_memory(self, mem_gb: float) -> HardwareProfile:
        return replace(self, mem_gb=float(mem_gb))


def _log_interp(pts: list[tuple[float, float]], x: float) -> float:
    """``y`` at ``x`` on the line through sorted ``(x, y)`` points, linear in ``log x``; flat outside them."""
    x = max(float(x), 1e-9)
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            return y0 + math.log(x / x0) / math.log(x1 / x0) * (y1 - y0) if x1 > x0 else y1
    return pts[-1][1]


# Datasheet numbers, checked against NVIDIA's datasheets as summarised in these public pages (dense = without
# 2:4 sparsity, the rate dense training and inference get; NVIDIA's headline figures are the sparse ones, 2x):
#   H100/H200: https://glennklockwood.com/garden/processors/h100 (BF16 matrix 989.4 dense / 1978.9 sparse,
#     H100 SXM5 80 GB at 3.35 TB/s, NVLink 900 GB/s); https://lzwjava.github.io/nvidia-h200-gpu-specs-en (H200
#     141 GB HBM3e at 4.8 TB/s, same compute and NVLink as H100 SXM).
#   A100: https://glennklockwood.com/garden/processors/A100 (BF16 312 dense / 624 sparse, 80 GB HBM2e at
#     2,039 GB/s on SXM4, NVLink 300+300 GB/s), from nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf.
#   B200: https://glennklockwood.com/garden/processors/B200 (HGX B200 at 1,000 W: BF16 2,250 dense / 4,500
#     sparse, 8 TB/s, NVLink 5 2x900 GB/s); 180 GB per GPU as DGX B200 lists it (1,440 GB for 8; the chip
#     has 192 GB, https://docs.vultr.com/inference-cookbook/cuda/getting-started/hardware-overview sees 179 GB).
#   L40S: https://www.mullet.se/product.html?product_id=355414 (the L40/L40S datasheet table: BF16 362.05 dense
#     / 733 sparse, 48 GB GDDR6 at 864 GB/s, PCIe Gen4 x16 64 GB/s bidirectional, no NVLink).
#   Network: DGX H100/H200/B200 give each GPU one 400 Gb/s ConnectX-7 port (50 GB/s), DGX A100 one 200 Gb/s
#     HDR port (25 GB/s); L40S servers typically 100 Gb/s Ethernet per GPU (12.5 GB/s, not a datasheet figure).
_NVIDIA = "NVIDIA datasheet"
PROFILES: dict[str, HardwareProfile] = {
    # H100 SXM5: 989 TFLOPS dense BF16, 80 GB HBM3 at 3.35 TB/s, NVLink 4 900 GB/s (450 each way),
    # one 400 Gb/s NDR port per GPU.
    "h100": HardwareProfile("h100", "gpu", 989.0, 80.0, 3350.0, 450.0, 50.0, source=f"{_NVIDIA}: H100 SXM5"),
    # H200 SXM: H100's compute with 141 GB HBM3e at 4.8 TB/s.
    "h200": HardwareProfile("h200", "gpu", 989.0, 141.0, 4800.0, 450.0, 50.0, source=f"{_NVIDIA}: H200 SXM"),
    # A100 SXM4 80 GB: 312 TFLOPS dense BF16, 2.04 TB/s, NVLink 3 600 GB/s (300 each way), 200 Gb/s HDR.
    "a100": HardwareProfile("a100", "gpu", 312.0, 80.0, 2039.0, 300.0, 25.0, source=f"{_NVIDIA}: A100 SXM4 80GB"),
    # B200 (HGX/DGX B200): 2.25 PFLOPS dense BF16, 180 GB HBM3e at 8 TB/s, NVLink 5 1.8 TB/s (900 each way),
    # 400 Gb/s per GPU.
    "b200": HardwareProfile("b200", "gpu", 2250.0, 180.0, 8000.0, 900.0, 50.0,
                            decode_iter_s=0.003, source=f"{_NVIDIA}: HGX/DGX B200"),
    # L40S: 362 TFLOPS dense BF16 (733 is with sparsity), 48 GB GDDR6 at 864 GB/s, no NVLink: PCIe Gen4 x16
    # (32 GB/s each way), typically 100 Gb/s Ethernet per GPU.
    "l40s": HardwareProfile("l40s", "gpu", 362.0, 48.0, 864.0, 32.0, 12.5, source=f"{_NVIDIA}: L40S"),
    # The export variants, common in the clusters AReaL and verl publish from. NVIDIA publishes no datasheet
    # for either; these are the figures partners and the trade press quote. H800 SXM: H100 SXM5 with NVLink
    # cut to 400 GB/s (200 each way). H20: 148 TFLOPS dense BF16, 96 GB HBM3 at 4.0 TB/s, NVLink 900 GB/s.
    "h800": HardwareProfile("h800", "gpu", 989.0, 80.0, 3350.0, 200.0, 50.0,
                            source="H800 SXM (partner/trade-press spec; no NVIDIA datasheet)"),
    "h20": HardwareProfile("h20", "gpu", 148.0, 96.0, 4000.0, 450.0, 50.0,
                           source="H20 (partner/trade-press spec; no NVIDIA datasheet)"),
    # This class of CI box (2 cores, 24 GiB) before calibration: rough; `areal plan --calibrate` measures it.
    # gloo's all-reduce between two processes on such a host measured 0.2-0.9 GB/s (calibrate.py, Nov 2026).
    "cpu": HardwareProfile("cpu", "cpu", 0.1, 24.0, 8.0, 0.5, 0.5, train_mfu=0.5, prefill_mfu=0.5,
                           decode_bw_eff=0.5, comm_eff=0.5, decode_iter_s=0.002, request_s=0.002,
                           train_mb_s=0.01, optim_step_s=0.005, process_base_gb=0.45, shared_compute=True,
                           collective_s=2e-4, disk_gbs=1.0, cores=2,
                           source="uncalibrated guess for a 2-core x86 host; run `areal plan --calibrate`"),
}
# cluster.hardware=auto: the profile a cluster's device kind implies.
AUTO_PROFILE = {"cpu": "cpu", "cuda": "h100"}


def profile_dir() -> Path:
    """Where ``--calibrate`` saves profiles: ``$AREAL_HARDWARE_DIR`` or ``$XDG_CONFIG_HOME/areal/hardware``."""
    env = os.environ.get("AREAL_HARDWARE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "areal" / "hardware"


def save_profile(p: HardwareProfile, path: str | os.PathLike | None = None) -> Path:
    out = Path(path) if path else profile_dir() / f"{p.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(p.to_dict(), indent=1, sort_keys=True) + "\n")
    os.replace(tmp, out)
    return out


def known_profiles() -> list[str]:
    saved = sorted(p.stem for p in profile_dir().glob("*.json")) if profile_dir().is_dir() else []
    return sorted(set(PROFILES) | set(saved))


def get_profile(name: str, key: str = "cluster.gpu") -> HardwareProfile:
    """A saved (calibrated) profile of that name wins over the built-in one; a path to a .json file works too.
    ``key`` is the config path or option the name came from, for the error."""
    raw = str(name).strip()
    if raw.endswith(".json") or os.sep in raw:
        path = Path(raw).expanduser()
        if not path.is_file():
            raise ConfigError(key, f"hardware profile file {raw} does not exist",
                              "run `areal plan --calibrate --save PATH` first, or name a built-in profile")
        return _load(path, key)
    low = raw.lower()
    saved = profile_dir() / f"{low}.json"
    if saved.is_file():
        return _load(saved, key)
    if low in PROFILES:
        return PROFILES[low]
    known = known_profiles()
    raise ConfigError(key, f"unknown hardware profile {raw!r}",
                      f"{did_you_mean(low, known)}use one of {', '.join(known)}, a profile .json, or measure "
                      "this machine with `areal plan --calibrate`")


def _load(path: Path, key: str) -> HardwareProfile:
    try:
        return HardwareProfile.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(key, f"hardware profile {path} cannot be read ({e})",
                          "re-run `areal plan --calibrate`") from e


def hardware_name(cluster) -> str:
    """``cluster.hardware`` with ``auto`` resolved from ``cluster.device``."""
    name = str(cluster.hardware or "auto").strip()
    return AUTO_PROFILE.get(str(cluster.device), "h100") if name.lower() == "auto" else name


def resolve_hardware(cfg: ExperimentConfig | ClusterConfig) -> HardwareProfile:
    """The profile of one device of ``cfg``'s cluster (``cfg``: the experiment config or its ``cluster``):
    ``cluster.hardware`` looked up by :func:`get_profile`, with ``cluster.gpu_memory_gb`` replacing a GPU
    profile's memory when set. A GPU profile on ``cluster.device=cpu`` (or the reverse) is a ConfigError."""
    cluster = getattr(cfg, "cluster", cfg)
    name = hardware_name(cluster)
    p = get_profile(name, key="cluster.hardware")
    if p.kind != ("cpu" if cluster.device == "cpu" else "gpu"):
        auto = " (what auto chose)" if str(cluster.hardware).strip().lower() == "auto" else ""
        raise ConfigError("cluster.hardware", f"profile {name}{auto} is a {p.kind.upper()} profile but "
                          f"cluster.device={cluster.device}",
                          f"set cluster.hardware to a {'CPU' if cluster.device == 'cpu' else 'GPU'} profile, "
                          f"or cluster.device={'cpu' if p.kind == 'cpu' else 'cuda'}")
    if p.kind == "gpu" and cluster.gpu_memory_gb is not None:
        p = p.with_memory(cluster.gpu_memory_gb)
    return p


def gpu_memory_gb(cfg: ExperimentConfig | ClusterConfig) -> float:
    """``cluster.gpu_memory_gb`` when set, else the hardware profile's memory (the GPU's; a CPU profile's is the
    host's RAM, which ``allocation.estimate.device_memory_gb`` measures itself on CPU)."""
    cluster = getattr(cfg, "cluster", cfg)
    if cluster.gpu_memory_gb is not None:
        return float(cluster.gpu_memory_gb)
    return resolve_hardware(cluster).mem_gb
