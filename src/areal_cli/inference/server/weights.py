"""Receiving new weights: from a safetensors dir on disk, or by broadcast from trainer rank 0.

Both paths first build a complete ``{name: tensor}`` dict and validate every name and shape
against the live model; only then the engine thread copies it in between two decode steps. A bad
update is rejected whole and never half-applied.
"""

from __future__ import annotations

import datetime
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch


class WeightUpdateRejected(ValueError):
    """The update does not match the model; nothing was applied."""


_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}


def parse_dtype(name: str) -> torch.dtype:
    key = str(name).replace("torch.", "")
    if key not in _DTYPES:
        raise WeightUpdateRejected(f"unknown dtype {name!r}; expected one of {sorted(set(_DTYPES))}")
    return _DTYPES[key]


def model_params(model) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by HF checkpoint name (tied weights appear once per name)."""
    return dict(model.state_dict(keep_vars=True))


def validate(model, tensors: dict[str, torch.Tensor]) -> None:
    live = model_params(model)
    unknown = [n for n in tensors if n not in live]
    if unknown:
        raise WeightUpdateRejected(f"unknown parameter names (first 5): {unknown[:5]}")
    bad = [(n, list(t.shape), list(live[n].shape)) for n, t in tensors.items() if t.shape != live[n].shape]
    if bad:
        n, got, want = bad[0]
        raise WeightUpdateRejected(f"shape mismatch for {n}: got {got}, model has {want} "
                                   f"({len(bad)} tensor(s) mismatched); nothing was applied")


def apply(model, tensors: dict[str, torch.Tensor]) -> int:
    """Copy validated tensors into the model (call from the engine thread only)."""
    live = model_params(model)
    with torch.no_grad():
        for n, t in tensors.items():
            live[n].data.copy_(t.to(device=live[n].device, dtype=live[n].dtype))
    return len(tensors)


def default_allowed_roots(model_path: str) -> list[str]:
    return [str(Path(model_path).resolve().parent), str(Path(tempfile.gettempdir()).resolve())]


def check_allowed(path: str, roots: list[str]) -> Path:
    p = Path(path).resolve()
    for r in roots:
        rp = Path(r).resolve()
        if p == rp or rp in p.parents:
            return p
    raise PermissionError(f"{path} is outside the allowed weight roots {roots}; "
                          "start the server with --allowed-weight-roots to widen them")


def load_from_disk(model, path: str, roots: list[str]) -> dict[str, torch.Tensor]:
    """Read every ``*.safetensors`` file of an HF-layout dir (or one file) and validate it."""
    from safetensors.torch import load_file

    p = check_allowed(path, roots)
    if p.is_dir():
        files = sorted(p.glob("*.safetensors"))
    elif p.suffix == ".safetensors":
        files = [p]
    else:
        files = []
    if not p.exists():
        raise FileNotFoundError(f"{path} does not exist")
    if not files:
        raise WeightUpdateRejected(f"no *.safetensors files in {path}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    validate(model, tensors)
    return tensors


@dataclass
class DistributedReceiver:
    """Membership in the trainer's weight-update group (built without the default group)."""

    group_name: str
    rank: int
    world_size: int
    backend: str
    pg: object
    store: object

    @classmethod
    def join(cls, master_address: str, master_port: int, rank_offset: int, world_size: int,
             group_name: str, backend: str = "gloo", timeout_s: float = 120.0) -> "DistributedReceiver":
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(master_address, int(master_port), int(world_size), is_master=False,
                              timeout=timeout)
        prefix = dist.PrefixStore(group_name, store)
        if backend == "gloo":
            pg = dist.ProcessGroupGloo(prefix, int(rank_offset), int(world_size), timeout)
        elif backend == "nccl":
            if not torch.cuda.is_available():
                raise WeightUpdateRejected("backend 'nccl' needs CUDA; this server runs on CPU — use 'gloo'")
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg = dist.ProcessGroupNCCL(prefix, int(rank_offset), int(world_size), opts)
        else:
            raise WeightUpdateRejected(f"unknown backend {backend!r}; expected gloo or nccl")
        return cls(group_name, int(rank_offset), int(world_size), backend, pg, store)

    def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> dict[str, torch.Tensor]:
        """One ``broadcast(root=0)`` per tensor, in order (SGLang's protocol)."""
        device = "cuda" if self.backend == "nccl" else "cpu"
        out: dict[str, torch.Tensor] = {}
        for n, dt, shp in zip(names, dtypes, shapes):
            buf = torch.empty(list(shp), dtype=parse_dtype(dt), device=device)
            self.pg.broadcast(buf, 0).wait()  # (tensor, root) overload; a list needs BroadcastOptions
            out[n] = buf
        return out

    def close(self) -> None:
        try:
            import torch.distributed as dist

            if hasattr(dist, "destroy_process_group") and hasattr(self.pg, "shutdown"):
                self.pg.shutdown()
        except Exception:
            pass


def broadcast_from_root(pg, tensor: torch.Tensor) -> None:
    """``broadcast([tensor], root=0)`` on a bare c10d process group (no default group needed)."""
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    pg.broadcast([tensor], opts).wait()


def check_update_request(model, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> str | None:
    """Why this distributed update would be rejected, or None. Checked before receiving."""
    if not (len(names) == len(dtypes) == len(shapes)):
        return f"names/dtypes/shapes lengths differ: {len(names)}/{len(dtypes)}/{len(shapes)}"
    live = model_params(model)
    for n, dt, shp in zip(names, dtypes, shapes):
        try:
            parse_dtype(dt)
        except WeightUpdateRejected as e:
            return str(e)
        if n not in live:
            return f"unknown parameter name {n!r}"
        if list(live[n].shape) != [int(x) for x in shp]:
            return f"shape mismatch for {n}: got {list(shp)}, model has {list(live[n].shape)}"
    return None

