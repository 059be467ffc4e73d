"""``areal plan --suggest``: the split of the cluster between inference and training, and the d/t/p within
each, that maximises predicted samples/s within memory.

Candidates keep the config's backends and use every device of the cluster. Each one is written as a spec
string and run through the real validator (``plan.validate.validate``), so a candidate is only ever
one ``areal train allocation_mode=...`` would accept; a few cheap checks first (t a power of two within a
node, dividing the heads; p dividing the layers; d dividing the batch) skip the ones it would refuse.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from areal_cli.errors import ArealError
from areal_cli.allocation.hardware import HardwareProfile
from areal_cli.planner.model import RunPlan, plan_config

if TYPE_CHECKING:
    from areal_cli.config.schema import ExperimentConfig


@dataclass
class Candidate:
    spec: str
    samples_per_s: float
    step_s: float
    fits: bool
    bottleneck: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class Suggestion:
    current: Candidate
    best: Candidate
    gain: float  # best / current samples/s
    override: str  # what to pass to areal train
    candidates: list[Candidate] = field(default_factory=list)  # the best few, best first
    searched: int = 0  # specs the validator accepted
    refused: int = 0  # specs the validator refused
    elapsed_s: float = 0.0

    def to_dict(self) -> dict:
        return {"current": self.current.to_dict(), "best": self.best.to_dict(), "gain": self.gain,
                "override": self.override, "candidates": [c.to_dict() for c in self.candidates],
                "searched": self.searched, "refused": self.refused, "elapsed_s": self.elapsed_s}


# Predicted gains below this fraction are within the model's noise: the current spec is kept.
TIE = 0.02


def _pow2_upto(n: int) -> list[int]:
    out, k = [], 1
    while k <= n:
        out.append(k)
        k *= 2
    return out


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def candidate_specs(cfg: ExperimentConfig, plan) -> list[str]:
    """Every disaggregated ``<server>:d·t·+<engine>:d·t·p·`` split of the cluster's devices that passes the
    cheap checks, the current spec first."""
    from areal_cli.allocation.parser import backend_dims
    from areal_cli.engines import engine_dims
    from areal_cli.inference.backends import DEFAULT_BACKEND

    m = cfg.model
    per_node, total = cfg.cluster.n_gpus_per_node, cfg.cluster.n_nodes * cfg.cluster.n_gpus_per_node
    inf_backend = plan.inference.backend if plan.inference is not None else DEFAULT_BACKEND
    tr_backend = plan.train.backend
    inf_dims, tr_dims = backend_dims(inf_backend, "inference"), engine_dims(tr_backend)
    heads, kv, layers = m.num_attention_heads, m.num_key_value_heads, m.num_hidden_layers
    t_inf = [t for t in (_pow2_upto(per_node) if "t" in inf_dims else [1])
             if heads % t == 0 and (kv % t == 0 or t % kv == 0)]
    t_tr = [t for t in (_pow2_upto(per_node) if "t" in tr_dims else [1]) if heads % t == 0 and kv % t == 0]
    p_tr = [p for p in (_divisors(layers) if "p" in tr_dims else [1]) if p <= total]
    out = [plan.spec]
    for n_inf in range(1, total):
        n_tr = total - n_inf
        for ti in t_inf:
            if n_inf % ti:
                continue
            inf = f"{inf_backend}:d{n_inf // ti}" + (f"t{ti}" if ti > 1 else "")
            for t in t_tr:
                for p in p_tr:
                    if n_tr % (t * p):
                        continue
                    d = n_tr // (t * p)
                    if cfg.algo.batch_size % d:
                        continue
                    dims = f"d{d}" + (f"t{t}" if t > 1 else "") + (f"p{p}" if p > 1 else "")
                    out.append(f"{inf}+{tr_backend}:{dims}")
    seen, uniq = set(), []
    for s in out:
        if s not in seen:
            seen.add(s)
            uniq.append(s)
    return uniq


def _with_spec(cfg: ExperimentConfig, spec: str) -> ExperimentConfig:
    return dataclasses.replace(cfg, allocation_mode=dataclasses.replace(cfg.allocation_mode, spec=spec))


def _candidate(rp: RunPlan) -> Candidate:
    return Candidate(rp.spec, rp.samples_per_s, rp.step.step_s, rp.fits, rp.bottleneck)


def suggest(cfg: ExperimentConfig, plan, profile: HardwareProfile, *, top: int = 8, **plan_kw) -> Suggestion:
    """The best split found, the current one, and the gain. ``plan_kw`` goes to :func:`plan_config`."""
    from areal_cli.plan.validate import validate

    t0 = time.perf_counter()
    current = _candidate(plan_config(cfg, plan, profile, **plan_kw))
    found: list[Candidate] = []
    searched = refused = 0
    for spec in candidate_specs(cfg, plan):
        try:
            cand_plan = validate(_with_spec(cfg, spec))
        except ArealError:
            refused += 1
            continue
        searched += 1
        found.append(_candidate(plan_config(cfg, cand_plan, profile, **plan_kw)))
    fitting = [c for c in found if c.fits] or found or [current]
    fitting.sort(key=lambda c: -c.samples_per_s)
    best = fitting[0]
    if current.fits and current.samples_per_s * (1 + TIE) >= best.samples_per_s:
        best = current  # a change of layout is only worth suggesting for a real gain
    gain = best.samples_per_s / current.samples_per_s if current.samples_per_s > 0 else float("inf")
    return Suggestion(current, best, gain, f"allocation_mode={best.spec}", fitting[:top], searched, refused,
                      time.perf_counter() - t0)
