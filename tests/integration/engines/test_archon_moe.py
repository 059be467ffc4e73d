"""Expert parallelism under the Archon engine: a tiny Qwen3-MoE (4 experts, top-2, renormalised; routing fixed
by the weights' seed) trains the same global batch to the same loss and updated weights as the one-process HF
model (fsdp engine, fp32, 1e-5), and its forward logprobs match, under archon d2e2 (2 processes: e borrows
from d) and d4e2 (4 processes: experts cut over 2 ranks and FSDP-sharded over the other 2).

Also: the load-balancing loss (engine.archon.moe_aux_loss_coeff) is logged as moe_aux_loss with megatron's
meaning, does not depend on how the experts are cut (d2 equals d2e2), and trains the router; the HF export
streams every expert in the checkpoint's per-expert names, bit-exact after a load, from any layout.

The multi-process tests (~3.5 min on 2 cores) are behind the `moe` marker (`pytest -m moe tests/integration`,
a CI phase of their own); the config checks run in the default suite, the areal-train run under `slow`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from engine_reference import assert_matches_reference, max_diff  # noqa: E402
from fsdp_worker import launch  # noqa: E402
from support_paths import SUPPORT

TOL = 1e-5
STEPS = {"steps": 2, "optim": {"eps": 1e-2}}  # eps: see test_archon_engine.py


def _ar(name, parallel, **engine):
    return {"name": name, "cls": "archon", "parallel": parallel, "fwd": True,
            "engine": {"max_tokens_per_mb": 96, **engine}, **STEPS}


@pytest.fixture(scope="module")
def runs(moe_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("archon_moe_runs")
    aux = {"archon": {"moe_aux_loss_coeff": 0.1}}
    w1 = [{"name": "ref", "engine": {"max_tokens_per_mb": 96}, "fwd": True, **STEPS},
          _ar("d1", {})]
    w2 = [{**_ar("d2e2", {"dp": 2, "ep": 2}), "export": str(out / "export_d2e2")},
          _ar("d2_aux", {"dp": 2}, **aux), _ar("d2e2_aux", {"dp": 2, "ep": 2}, **aux),
          {"name": "rt_d2e2", "cls": "archon", "parallel": {"dp": 2, "ep": 2}, "steps": 0}]
    w4 = [_ar("d4e2", {"dp": 4, "ep": 2}),
          {"name": "load_d4e2", "cls": "archon", "parallel": {"dp": 4, "ep": 2}, "steps": 0,
           "load_hf": str(out / "export_d2e2")}]
    for world, variants in ((1, w1), (2, w2), (4, w4)):
        launch({"model_dir": moe_model, "out": str(out), "variants": variants}, world, timeout=600)
    return {p.stem: torch.load(p, weights_only=False) for p in out.glob("*.pt")}


def _per_expert(d: dict) -> dict:
    """transformers' in-memory fused experts (what the fsdp reference streams) in the checkpoint's per-expert
    names (what archon streams, and vLLM/SGLang load)."""
    from areal_cli.engines.archon.expert_parallel import per_expert_names

    return {n: t for k, v in d.items() for n, t in per_expert_names(k, v)}


def _max_diff(a: dict, b: dict) -> float:
    return max_diff(a, b, names=_per_expert)


@pytest.mark.moe
@pytest.mark.parametrize("name", ["d1", "d2e2", "d4e2"])
def test_expert_parallel_layout_matches_the_one_process_reference(runs, name):
    got = runs[name]
    assert_matches_reference(runs["ref"], got, names=_per_expert)
    # every expert, gathered over e
    assert any(k.endswith("experts.3.down_proj.weight") for k in got["weights"])
    moved = _max_diff(runs["rt_d2e2"]["weights"], got["weights"])
    assert moved > 1e-3, "training did not change the weights"


@pytest.mark.moe
def test_load_balancing_loss_is_logged_independent_of_e_and_trains(runs):
    """engine.archon.moe_aux_loss_coeff > 0: the router's load-balancing loss (before the coefficient,
    averaged over layers, micro-batches and data-parallel ranks) is in the step's stats; cutting the experts
    over e changes neither it nor the gradients; its gradient moves the router away from the coefficient-0
    run."""
    d2, e2, plain = runs["d2_aux"], runs["d2e2_aux"], runs["d2e2"]
    values = [s["moe_aux_loss"] for s in e2["stats"]]
    assert all(0.9 < v < 4.0 for v in values), values  # 1 when the top-2 of 4 experts are used evenly
    for a, b in zip(d2["stats"], e2["stats"], strict=True):
        assert abs(a["moe_aux_loss"] - b["moe_aux_loss"]) <= TOL and abs(a["loss"] - b["loss"]) <= TOL
    assert _max_diff(d2["weights"], e2["weights"]) <= TOL
    assert "moe_aux_loss" not in plain["stats"][0]
    p, a = _per_expert(plain["weights"]), _per_expert(e2["weights"])
    moved = [k for k in p if (p[k] - a[k]).abs().max() > 1e-6]
    assert any("mlp.gate.weight" in k for k in moved), moved


@pytest.mark.moe
def test_experts_round_trip_bit_exact_across_layouts(runs, moe_model):
    """Streamed at d2e2 (per-expert names, expert by expert) the model dir comes back bit-exact; the trained
    d2e2 model's HF export, loaded into d4e2 (another cut of the experts), streams back bit-exact too."""
    from safetensors.torch import load_file

    init = load_file(str(Path(moe_model) / "model.safetensors"))
    for name, want in (("rt_d2e2", init), ("load_d4e2", runs["d2e2"]["weights"])):
        got = runs[name]["weights"]
        assert got.keys() == want.keys(), set(got) ^ set(want)
        for k in want:
            assert torch.equal(got[k], want[k]), (name, k)


@pytest.mark.moe
def test_archon_d2e2_sync_into_hf_server(tiny_model_dir, tmp_path):
    """Weight sync from archon d2e2 (experts cut over two ranks, streamed expert by expert in the checkpoint's
    per-expert names) into a running hf server serving another tiny Qwen3-MoE, disk then distributed: after
    each push the server's greedy output equals the trained model's (its HF export run by transformers)."""
    from hf_server_helpers import _check_pushes, prompts
    from transformers import AutoTokenizer

    from areal_cli.inference.launch import launch_server
    from areal_cli.models.tiny import make_tiny_model
    from areal_cli.utils.network import find_free_port

    model = make_tiny_model(tmp_path / "moe", tokenizer_dir=tiny_model_dir, seed=0, family="qwen3_moe")
    served = make_tiny_model(tmp_path / "moe_b", tokenizer_dir=tiny_model_dir, seed=1, family="qwen3_moe")
    ps = prompts(AutoTokenizer.from_pretrained(model), 3)
    server = launch_server("hf", served, log_dir=str(tmp_path), timeout_s=180)
    try:
        spec = {"model_dir": model, "out": str(tmp_path), "address": server.address, "kill": False,
                "server_pid": server.proc.pid, "group_port": find_free_port(), "prompts": ps,
                "engine": "archon", "parallel": {"dp": 2, "ep": 2}}
        launch(spec, 2, timeout=600, script=str(SUPPORT / "sync_worker.py"))
    finally:
        server.stop()
    _check_pushes(json.loads((tmp_path / "sync.json").read_text()), tmp_path, ps)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_areal_train_tiny_moe_archon_d2e2_learns(tmp_path):
    """`areal train model=tiny_moe engine=archon allocation_mode=hf:d1+archon:d2e2` on the embedded default
    task: the built-in Qwen3-MoE is built on first use, served by the hf server, trained with its experts cut
    over two ranks and synced every step; the held-out accuracy must rise (docs/training.md records a run)."""
    import subprocess
    import time

    from train_runs import _env

    t0 = time.time()
    res = subprocess.run([sys.executable, "-m", "areal_cli.cli.main", "train", f"cluster.fileroot={tmp_path}",
                          "model=tiny_moe", "engine=archon", "allocation_mode=hf:d1+archon:d2e2",
                          "cluster.n_gpus_per_node=3"], capture_output=True, text=True, env=_env(),
                         timeout=1700)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    (summary_path,) = (tmp_path / "runs").glob("*/*/summary.json")
    s = json.loads(summary_path.read_text())
    gain = s["accuracy_after"] - s["accuracy_before"]
    print(f"\ntiny_moe archon d2e2: {s['accuracy_before']:.1%} -> {s['accuracy_after']:.1%} ({gain:+.1%}) "
          f"in {time.time() - t0:.0f}s")
    assert gain >= 0.40, s  # as the embedded default's other engine runs (test_train_default.py)


def test_validate_config_accepts_archon_e_for_the_tiny_moe_and_refuses_it_for_dense():
    """model=tiny_moe validates at archon d2e2 (e adds no devices) with the experts' memory sharded over d×c in
    all; e on a dense model, or e not dividing d×c, is a typed error naming allocation_mode."""
    from areal_cli.plan.compose import load_config
    from areal_cli.plan.validate import validate
    from areal_cli.errors import ConfigError

    base = ["engine=archon", "cluster.n_gpus_per_node=3"]
    plan = validate(load_config(["model=tiny_moe", "allocation_mode=hf:d1+archon:d2e2", *base]))
    assert (plan.train.parallel.dp, plan.train.parallel.ep) == (2, 2)
    d2 = validate(load_config(["model=tiny_moe", "allocation_mode=hf:d1+archon:d2", *base]))
    # e borrows from d: the held state (sharded over d×c either way) is the same; only the gather shrinks
    assert plan.train.memory.grads_gb == pytest.approx(d2.train.memory.grads_gb)
    assert plan.train.memory.weights_gb < d2.train.memory.weights_gb
    for bad in (["allocation_mode=hf:d1+archon:d2e2"], ["model=tiny_moe", "allocation_mode=hf:d1+archon:d1e2"]):
        with pytest.raises(ConfigError) as err:
            validate(load_config([*bad, *base]))
        assert err.value.path.startswith("allocation_mode"), err.value
