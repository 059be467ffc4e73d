"""MoE under the Megatron engine: a tiny Qwen3-MoE (4 experts, top-2, renormalised) trains the same global batch to
the same loss and updated weights as the one-process HF model (fp32, 1e-5) under expert parallelism, and the HF
export of every expert is bit-exact.

Layouts, in the allocation language (e borrows from d, as in torchtitan): megatron d2e2 (2 processes), d2t2e2
(experts also cut over t), the hybrid form (attn:d2t2|ffn:d2t1e2) (whole experts, attention over t), and p2e2
(experts and pipeline stages: mcore's pp-last rank order). Skips when megatron-core 0.16.1 is not installed.
Behind the `megatron` marker with the engine tests (`pytest -m megatron tests/integration`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_reference import assert_matches_reference, close  # noqa: E402
from fsdp_worker import launch  # noqa: E402

from areal_cli.engines.megatron import compat  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.skipif(compat.installed_version() != compat.SUPPORTED_VERSION,
                                 reason=f"megatron-core {compat.SUPPORTED_VERSION} is not installed "
                                        "(scripts/install_test_deps.sh installs it)")]
TOL = 1e-5
STEPS = {"steps": 2, "optim": {"eps": 1e-2}}  # eps: see test_archon_engine.py


def _mg(name, parallel, mb=10_000):
    return {"name": name, "cls": "megatron", "parallel": parallel, "engine": {"max_tokens_per_mb": mb},
            "fwd": True, **STEPS}


@pytest.fixture(scope="module")
def runs(moe_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron_moe_runs")
    w1 = [{"name": "ref", "engine": {"max_tokens_per_mb": 10_000}, "fwd": True, **STEPS}]
    aux = _mg("d2e2_aux", {"dp": 2, "ep": 2})
    aux["engine"]["megatron"] = {"moe_aux_loss_coeff": 0.1}
    w2 = [_mg("d2e2", {"dp": 2, "ep": 2}), aux,
          {"name": "rt_d2e2", "cls": "megatron", "parallel": {"dp": 2, "ep": 2}, "steps": 0}]
    w4 = [_mg("d2t2e2", {"dp": 2, "tp": 2, "ep": 2}), _mg("hybrid", {"dp": 2, "tp": 2, "ep": 2, "etp": 1}),
          _mg("p2e2", {"dp": 2, "pp": 2, "ep": 2}, mb=1),
          {"name": "rt_d2t2e2", "cls": "megatron", "parallel": {"dp": 2, "tp": 2, "ep": 2}, "steps": 0}]
    for world, variants in ((1, w1), (2, w2), (4, w4)):
        launch({"model_dir": moe_model, "out": str(out), "variants": variants}, world, timeout=600)
    return {p.stem: torch.load(p, weights_only=False) for p in out.glob("*.pt")}


def _per_expert(d: dict) -> dict:
    """transformers' in-memory fused experts (what the fsdp reference streams) in the checkpoint's per-expert
    names (what megatron exports, and vLLM/SGLang load)."""
    out = {}
    for k, v in d.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            for e in range(v.shape[0]):
                gate, up = v[e].chunk(2, 0)
                out[k.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate
                out[k.replace("gate_up_proj", f"{e}.up_proj.weight")] = up
        elif k.endswith("mlp.experts.down_proj"):
            for e in range(v.shape[0]):
                out[k.replace("down_proj", f"{e}.down_proj.weight")] = v[e]
        else:
            out[k] = v
    return out


def _close(a: dict, b: dict) -> None:
    close(a, b, names=_per_expert)


@pytest.mark.parametrize("name", ["d2e2", "d2t2e2", "hybrid", "p2e2"])
def test_expert_parallel_layout_matches_the_one_process_reference(runs, name):
    got = runs[name]
    assert_matches_reference(runs["ref"], got, names=_per_expert)
    assert {k for k in got["weights"] if "experts.3.down_proj" in k}  # every expert, gathered over e


def test_load_balancing_loss_is_logged_and_trains(runs):
    """engine.megatron.moe_aux_loss_coeff > 0: the router's load-balancing loss is in the step's stats, and its
    gradient moves the weights away from the coefficient-0 run (the router and the layers under it)."""
    aux, plain = runs["d2e2_aux"], runs["d2e2"]
    values = [s["moe_aux_loss"] for s in aux["stats"]]
    # Switch-style loss: 1 when the top-2 of 4 experts are used evenly, and above when they are not
    assert all(0.5 < v < 4.0 for v in values), values
    assert "moe_aux_loss" not in plain["stats"][0]
    moved = [k for k in plain["weights"] if not torch.equal(plain["weights"][k], aux["weights"][k])]
    assert any("mlp.gate.weight" in k for k in moved), moved


@pytest.mark.parametrize("name", ["rt_d2e2", "rt_d2t2e2"])
def test_experts_round_trip_bit_exact(runs, moe_model, name):
    from safetensors.torch import load_file

    init = load_file(str(Path(moe_model) / "model.safetensors"))
    got = runs[name]["weights"]
    assert got.keys() == init.keys(), set(got) ^ set(init)
    for k in init:
        assert torch.equal(got[k], init[k]), k


def test_hybrid_spec_reaches_the_engine_as_expert_tensor_parallel_size(moe_model):
    """`megatron:(attn:d2t2|ffn:d2t1e2)` validates against the MoE model and carries etp=1 to the trainer."""
    from areal_cli.plan.compose import load_config
    from areal_cli.plan.validate import validate

    plan = validate(load_config([f"model.path={moe_model}", "engine=megatron", "cluster.n_gpus_per_node=5",
                                 "allocation_mode=hf:d1+megatron:(attn:d2t2|ffn:d2t1e2)"]))
    par = plan.train.parallel
    assert (par.dp, par.tp, par.ep, par.etp) == (2, 2, 2, 1)
