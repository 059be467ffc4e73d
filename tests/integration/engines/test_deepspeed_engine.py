"""The DeepSpeed engine against the one-process reference (gloo, CPU, fp32).

ZeRO-1, 2 and 3 at d2 train the same global batch to the same loss, grad norm and updated weights as
the one-process fsdp reference (1e-5), forward logprobs equal the reference's, ZeRO-3 with one
sequence per micro-batch matches both its one-micro-batch run and the reference, a rank with fewer
micro-batches pads with empty ones, and d1c2 (Ulysses under ZeRO-3) and ZeRO-2/3 with optimizer (and
parameter) offload match too; so does ZeRO-3 with the tied table row-sharded outside ZeRO (``engine.tied_head``),
at d2, d1c2, under bf16 compute and with clipping. A ZeRO-3 critic trains like the
one-process critic and reloads from its HF export. Two launches: world 1 (references) and world 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed", reason="deepspeed is installed by scripts/install_test_deps.sh")

from engine_reference import TOL, assert_matches_reference, max_diff  # noqa: E402
from engine_reference import close as _close  # noqa: E402
from fsdp_worker import launch  # noqa: E402
from support_paths import SUPPORT
from test_archon_engine import STEPS  # noqa: E402

# multi-process engine layouts against their references: CI's `engines` phase (pytest -m engines tests/integration)
pytestmark = pytest.mark.engines

BIG, SMALL = 10_000, 1
CLIP = {"grad_clip": 0.05}  # below the first step's norm (~2.5): clipping scales every gradient


def _ds(name, stage, parallel=None, mb=BIG, tied_head="auto", optim=None, **ds):
    # persistence threshold 0: even norms and biases are partitioned, so every tensor goes through the gather
    return {"name": name, "cls": "deepspeed", "parallel": parallel or {"dp": 2}, "fwd": True,
            **STEPS, **({"optim": {**STEPS["optim"], **optim}} if optim else {}),
            "engine": {"max_tokens_per_mb": mb, "dtype": "bfloat16" if "_mp" in name else "float32",
                       "tied_head": tied_head,
                       "deepspeed": {"zero_stage": stage, "param_persistence_threshold": 0, **ds}}}


@pytest.fixture(scope="module")
def runs(model4, tmp_path_factory):
    out = tmp_path_factory.mktemp("deepspeed_runs")
    critic = {"critic": True, "optim": STEPS["optim"]}
    w1 = [{"name": "ref", "engine": {"max_tokens_per_mb": BIG}, "fwd": True, **STEPS},
          {"name": "ref_x8", "engine": {"max_tokens_per_mb": SMALL}, **STEPS},
          {"name": "ref_clip", "engine": {"max_tokens_per_mb": BIG}, "fwd": True, **STEPS, "optim": {**STEPS["optim"], **CLIP}},
          {"name": "critic_ref", **critic}]
    w2 = [_ds("z1", 1), _ds("z2", 2), _ds("z3", 3), _ds("z3_x8", 3, mb=SMALL), _ds("z2_x8", 2, mb=SMALL),
          _ds("z1_x8", 1, mb=SMALL),
          _ds("z3_c2", 3, parallel={"cp": 2}),
          # offload runs DeepSpeed's offload path; on CPU it moves nothing (host memory either way)
          _ds("z3_offload", 3, offload_optimizer=True, offload_param=True),
          _ds("z2_offload", 2, offload_optimizer=True),
          # bf16 compute over fp32 weights, against fsdp's mixed precision at d2
          {"name": "fsdp_d2_mp", "parallel": {"dp": 2},
           "engine": {"max_tokens_per_mb": BIG, "dtype": "bfloat16"}, **STEPS},
          _ds("z1_mp", 1), _ds("z3_mp", 3),
          # the tied table row-sharded outside ZeRO-3 (engines/zero3_table.py); auto picks it for z3_x8
          _ds("z3_rows", 3, tied_head="sharded"), _ds("z3_rows_c2", 3, parallel={"cp": 2}, tied_head="sharded"),
          _ds("z3_rows_mp", 3, tied_head="sharded"), _ds("z3_rows_clip", 3, tied_head="sharded", optim=CLIP),
          _ds("z3_clip", 3, optim=CLIP),
          {**_ds("z3_rows_fwd_only", 3, tied_head="sharded"), "steps": 0, "forward_only": True},
          {"name": "critic_z3", "cls": "deepspeed", "parallel": {"dp": 2}, **critic}]
    for world, variants in ((1, w1), (2, w2)):
        launch({"model_dir": model4, "out": str(out), "variants": variants}, world, timeout=600)
    skewed = out / "skewed"
    skewed.mkdir()
    for world, variants in ((1, [{"name": "ref", "engine": {"max_tokens_per_mb": SMALL}, **STEPS}]),
                            (2, [_ds("z3", 3, mb=SMALL)])):
        launch({"model_dir": model4, "out": str(skewed), "variants": variants, "batch": "skewed"}, world,
               timeout=600, script=str(SUPPORT / "deepspeed_worker.py"))
    runs = {p.stem: torch.load(p, weights_only=False) for p in out.glob("*.pt")}
    runs.update({f"skewed_{p.stem}": torch.load(p, weights_only=False) for p in skewed.glob("*.pt")})
    return runs


@pytest.mark.parametrize("name", ["z1", "z2", "z3", "z3_c2", "z3_offload", "z2_offload", "z3_rows", "z3_rows_c2"])
def test_zero_stage_matches_the_one_process_reference(runs, name):
    assert_matches_reference(runs["ref"], runs[name])


def test_tied_table_row_sharded_where_asked(runs):
    """engine.tied_head under ZeRO-3: auto keeps the table out of ZeRO at one token per micro-batch (2 x 1 <
    2 x vocab) and leaves it to ZeRO at 10k-token ones; 'sharded' is honoured; ZeRO-1/2 never take it."""
    got = {n: runs[n]["tied_table"] for n in ("z3", "z3_x8", "z3_rows", "z3_rows_c2", "z1_x8", "z2_x8")}
    assert got == {"z3": False, "z3_x8": True, "z3_rows": True, "z3_rows_c2": True, "z1_x8": False,
                   "z2_x8": False}


def test_forward_only_engine_with_the_table_row_sharded(runs, model4):
    """A reference model's engine (no optimizer) under ZeRO-3 with the table out of ZeRO: its logprobs are the
    one-process reference's and its HF tensors are the checkpoint's."""
    from safetensors.torch import load_file

    got = runs["z3_rows_fwd_only"]
    assert got["tied_table"]
    _close(runs["ref"]["logprobs"], got["logprobs"])
    _close(load_file(str(Path(model4) / "model.safetensors")), got["weights"], 0.0)


@pytest.mark.parametrize("name", ["z3_clip", "z3_rows_clip"])
def test_clipping_matches_the_reference(runs, name):
    """A clip threshold below the gradient norm: the row-sharded table's norm joins DeepSpeed's and its rows
    take the same coefficient, so the step equals the one-process clipped step (without the table's norm, or
    with the table unclipped, its rows and every other weight move differently)."""
    assert runs["ref_clip"]["stats"][0]["grad_norm"] > 10 * CLIP["grad_clip"]
    assert_matches_reference(runs["ref_clip"], runs[name])


@pytest.mark.parametrize("name", ["z1_x8", "z2_x8", "z3_x8"])
def test_micro_batch_invariance(runs, name):
    # 8 rows over 2 ranks at one row per micro-batch: 4 micro-batches per rank, vs 1 in the BIG runs
    assert runs[name]["stats"][0]["n_micro_batches"] == 4 and runs["z3"]["stats"][0]["n_micro_batches"] == 1
    _close(runs["ref_x8"]["weights"], runs[name]["weights"])
    _close(runs[name.replace("_x8", "")]["weights"], runs[name]["weights"])


def test_zero3_pads_the_lighter_rank_with_empty_micro_batches(runs):
    """One rank holds 2 rows and the other 6 (one row per micro-batch): the light rank runs 4 empty
    forwards and backwards, and the step still equals the one-process reference."""
    ref, got = runs["skewed_ref"], runs["skewed_z3"]
    assert [s["n_micro_batches"] for s in got["stats"]] == [6.0, 6.0]
    for s_ref, s_got in zip(ref["stats"], got["stats"], strict=True):
        assert abs(s_ref["loss"] - s_got["loss"]) <= TOL, (s_ref["loss"], s_got["loss"])
    _close(ref["weights"], got["weights"])


@pytest.mark.parametrize("name,tol", [("z1_mp", TOL), ("z3_mp", 1e-4), ("z3_rows_mp", 1e-4)])
def test_mixed_precision_matches_fsdp(runs, name, tol):
    """bf16 compute, fp32 master weights (put back after DeepSpeed built them from the bf16 module), fp32
    gradient reduction: ZeRO-1 ends where fsdp's mixed precision does (measured: bit-equal); ZeRO-3 within
    1e-4 (measured 3.6e-5; fsdp's mixed precision is itself 6e-5 away from the fp32 run)."""
    assert runs[name]["stats"][0]["loss"] == pytest.approx(runs["fsdp_d2_mp"]["stats"][0]["loss"], abs=TOL)
    _close(runs["fsdp_d2_mp"]["weights"], runs[name]["weights"], tol)
    assert max_diff(runs["ref"]["weights"], runs[name]["weights"]) > 0  # bf16 compute really differs from fp32


def test_weights_moved(runs, model4):
    from safetensors.torch import load_file

    init = load_file(str(Path(model4) / "model.safetensors"))
    assert max((runs["z3"]["weights"][k] - init[k]).abs().max().item() for k in init) > 1e-4


def test_zero3_critic_matches_reference_and_reloads(runs):
    ref, got = runs["critic_ref"], runs["critic_z3"]
    for s_ref, s_got in zip(ref["stats"], got["stats"], strict=True):
        assert abs(s_ref["loss"] - s_got["loss"]) <= TOL, (s_ref["loss"], s_got["loss"])
    assert (ref["values"] - got["values"]).abs().max().item() <= TOL
    assert (got["values"] - got["values_reloaded"]).abs().max().item() <= TOL


@pytest.mark.parametrize("tied_head", ["gathered", "sharded"])
def test_zero3_sync_into_hf_server(tiny_model_dir, tiny_model_dir_b, tmp_path, tied_head):
    """ZeRO-3 at d2 (every tensor partitioned, gathered bucket by bucket; the tied table in ZeRO or
    row-sharded outside it) pushes into a running hf server by disk and twice over the distributed group:
    its greedy output afterwards equals the trained model's (the engine's HF export of the same step)."""
    from hf_server_helpers import _check_pushes, prompts
    from transformers import AutoTokenizer

    from areal_cli.inference.launch import launch_server
    from areal_cli.utils.network import find_free_port

    ps = prompts(AutoTokenizer.from_pretrained(tiny_model_dir), 3)
    server = launch_server("hf", tiny_model_dir_b, log_dir=str(tmp_path), timeout_s=180)
    try:
        spec = {"model_dir": tiny_model_dir, "out": str(tmp_path), "address": server.address, "kill": False,
                "server_pid": server.proc.pid, "group_port": find_free_port(), "prompts": ps,
                "engine": "deepspeed", "parallel": {"dp": 2},
                # 0.02M-element buckets: the tiny model's weights take several gathers
                "engine_cfg": {"tied_head": tied_head, "deepspeed": {"zero_stage": 3, "param_persistence_threshold": 0,
                                             "bucket_mel": 0.02}}}
        launch(spec, 2, timeout=600, script=str(SUPPORT / "sync_worker.py"))
    finally:
        server.stop()
    _check_pushes(json.loads((tmp_path / "sync.json").read_text()), tmp_path, ps)


RUNS = 20


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_repeated_two_rank_runs_exit_cleanly(tiny_model_dir, tmp_path):
    """20 two-rank ZeRO-3 runs (a step, an HF export, the engine's destroy, then the trainer's
    destroy_distributed) all exit with status 0 inside the timeout: no hang or crash at shutdown."""
    for i in range(RUNS):
        v = _ds(f"run{i}", 3)
        v.update(steps=1, fwd=False, export=str(tmp_path / f"hf{i}"))
        # launch raises, with the workers' output, on any non-zero exit status or on the timeout
        launch({"model_dir": tiny_model_dir, "out": str(tmp_path), "variants": [v], "trainer_exit": True}, 2,
               timeout=300, script=str(SUPPORT / "deepspeed_worker.py"))
        assert (tmp_path / f"hf{i}" / "model.safetensors").is_file() and (tmp_path / f"run{i}.pt").is_file()
    print(f"\n{RUNS} two-rank runs exited cleanly")
