"""Typed form of an ``allocation_mode`` spec string."""

from __future__ import annotations

from dataclasses import dataclass, field

from areal_cli.api.io_struct import ParallelStrategy
from areal_cli.engines import engine_names as train_backends  # noqa: F401  (the registries name the backends)
from areal_cli.inference.backends import backend_names as inference_backends  # noqa: F401

DIM_LETTERS = "dtpce"
DIM_NAMES = {"d": "data", "t": "tensor", "p": "pipeline", "c": "context", "e": "expert"}


@dataclass
class Dims:
    """Parallel sizes of one component; ``span`` is where each letter sits in the spec text."""

    d: int = 1
    t: int = 1
    p: int = 1
    c: int = 1
    e: int = 1
    given: tuple[str, ...] = ()  # letters written explicitly, in order
    span: dict[str, int] = field(default_factory=dict)  # letter -> column in the spec text

    def get(self, letter: str) -> int:
        return getattr(self, letter)

    def text(self) -> str:
        return "".join(f"{k}{self.get(k)}" for k in self.given) or "d1"


@dataclass
class Component:
    """One part of the allocation: an inference server fleet or a training job."""

    kind: str  # "inference" | "train"
    backend: str | None  # None: train backend left to the ``engine`` group
    name: str | None
    dims: Dims  # for hybrid MoE: the attention dims
    ffn: Dims | None = None  # hybrid MoE only: the expert/FFN dims
    column: int = 0  # start column in the spec text
    group: int = 0  # index of the '+'-separated group (colocated parts share it)

    @property
    def hybrid(self) -> bool:
        return self.ffn is not None

    @property
    def label(self) -> str:
        """Name used in messages and the plan: ``name`` or the backend (``train`` if unknown)."""
        return self.name or self.backend or self.kind

    @property
    def world_size(self) -> int:
        d = self.dims
        if self.kind == "inference":
            return d.d * d.t * d.p
        return d.d * d.t * d.p * d.c

    def parallel(self) -> ParallelStrategy:
        d = self.dims
        ep = self.ffn.e if self.ffn is not None else d.e
        # the hybrid form's ffn part sets the experts' own tensor-parallel size
        etp = self.ffn.t if self.ffn is not None else 0
        return ParallelStrategy(dp=d.d, tp=d.t, pp=d.p, cp=d.c, ep=ep, etp=etp)

    def dims_text(self) -> str:
        if self.ffn is not None:
            return f"(attn:{self.dims.text()}|ffn:{self.ffn.text()})"
        return self.dims.text()


@dataclass
class AllocationSpec:
    """A parsed spec: components in text order; ``groups`` lists colocated component indices."""

    text: str
    components: list[Component]

    @property
    def groups(self) -> list[list[int]]:
        out: dict[int, list[int]] = {}
        for i, c in enumerate(self.components):
            out.setdefault(c.group, []).append(i)
        return [out[k] for k in sorted(out)]

    @property
    def inference(self) -> list[Component]:
        return [c for c in self.components if c.kind == "inference"]

    @property
    def train(self) -> list[Component]:
        return [c for c in self.components if c.kind == "train"]

    @property
    def colocated(self) -> bool:
        return any(len(g) > 1 for g in self.groups)

    @property
    def train_backend(self) -> str | None:
        """The single named train backend, or None when the spec leaves it to ``engine``."""
        names = {c.backend for c in self.train if c.backend}
        return next(iter(names)) if len(names) == 1 else None

    def canonical(self) -> str:
        parts = []
        for g in self.groups:
            items = []
            for i in g:
                c = self.components[i]
                head = c.backend or ""
                if c.name:
                    head += f"[{c.name}]"
                items.append(f"{head}:{c.dims_text()}" if head else c.dims_text())
            parts.append("|".join(items))
        return "+".join(parts)
