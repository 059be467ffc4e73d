"""Rollout routing replay (R3) end to end: a real hf server serves a tiny Qwen3-MoE (4 experts, top-2)
and returns the experts it routed every token to; the real client and RLVR workflow carry them into the
trainer batch; real FSDP engines (r3_worker.py) run that batch and count, per fed token and MoE layer,
where the experts their MoE blocks actually ran differ from the server's.

With identical fp32 weights the mismatch is (nearly) nil anyway; the realistic cases are a server one
policy version behind the trainer (after one optimizer step) and a bf16 trainer against an fp32 server.
There, without replay the rate is measured and printed (and must be > 0 for the stale case, or the test
shows nothing); with replay it must be exactly 0, on ``forward`` and on the training path, and the
packed and shared-prefix layouts must give the padded layout's logprobs.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest
import torch
from fsdp_worker import launch  # noqa: E402
from hf_server_helpers import prompts, start_hf_server  # noqa: E402
from support_paths import SUPPORT

KEY = "routed_experts"
N_LAYERS, TOP_K = 2, 2


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory, tiny_model_dir) -> str:
    from areal_cli.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_moe"), tokenizer_dir=tiny_model_dir, seed=0,
                           family="qwen3_moe", num_layers=N_LAYERS, num_experts=4, top_k=TOP_K)


@pytest.fixture(scope="module")
def server(moe_dir, tmp_path_factory):
    h = start_hf_server(moe_dir, tmp_path_factory)
    yield h
    h.stop()


def _rollout(address: str, model_dir: str) -> dict:
    """GRPO groups through the real client and RLVR workflow (seeded as the trainer seeds them),
    concatenated as the trainer gets them."""
    from transformers import AutoTokenizer

    from areal_cli.api.io_struct import GenerationConfig
    from areal_cli.api.workflow_api import Trajectory
    from areal_cli.inference.client import RemoteInferenceEngine
    from areal_cli.rollout.episodes import SeededEngine
    from areal_cli.rollout.workflows.rlvr import RLVRWorkflow

    tok = AutoTokenizer.from_pretrained(model_dir)
    g = GenerationConfig(max_new_tokens=12, temperature=1.0, return_routed_experts=True)
    wf = RLVRWorkflow(lambda p, c, a: float(len(c) % 3 == 0), g, tok, group_size=4, use_chat_template=False)

    async def run():
        eng = RemoteInferenceEngine([address], backend="hf")
        items = [{"prompt_ids": p, "answer": "1"} for p in prompts(tok, 4, seed=3)]
        runs = [wf.arun_episode(SeededEngine(eng, 4096 * i), x) for i, x in enumerate(items)]
        trajs = await asyncio.gather(*runs)
        return Trajectory.concat(list(trajs), pad_id=int(tok.pad_token_id or 0))

    batch = asyncio.run(run()).data
    batch["row"] = torch.arange(batch["input_ids"].shape[0])
    return batch


def _rate(c: dict, gen: bool = False) -> float:
    d, n = (c["gen_diff"], c["gen_n"]) if gen else (c["diff"], c["n"])
    return d / max(n, 1)


@pytest.fixture(scope="module")
def replayed(server, moe_dir, tmp_path_factory):
    """A rollout with its routing, and the fsdp worker's results on it (the stale policy in ``stale_dir``)."""
    tmp_path = tmp_path_factory.mktemp("r3")
    batch = _rollout(server.address, moe_dir)
    torch.save(batch, tmp_path / "batch.pt")
    out = tmp_path / "res.pt"
    spec = {"model_dir": moe_dir, "batch": str(tmp_path / "batch.pt"), "out": str(out), "lr": 1e-3,
            "stale_dir": str(tmp_path / "stale")}
    _worker(spec, 1)
    return batch, spec, torch.load(out, weights_only=False)


def test_trainer_routes_every_token_as_the_server_did(replayed, tmp_path):
    batch, spec, res = replayed
    rt, am = batch[KEY], batch["attention_mask"]
    assert rt.dtype == torch.int16 and rt.shape[:2] == am.shape and rt.shape[2] == N_LAYERS * TOP_K
    lens = am.sum(1)
    recorded = (rt >= 0).all(-1)
    # every fed token is recorded: all but each row's last; padding never
    assert torch.equal(recorded.sum(1), lens - 1) and not recorded[~am].any()
    res = {**res, "logprobs": dict(res["logprobs"])}
    _worker({**spec, "cp": 2, "out": str(tmp_path / "cp.pt")}, 2)  # Ulysses: the packed row over 2 ranks
    res["logprobs"].update(torch.load(tmp_path / "cp.pt", weights_only=False))
    # archon d2e2: the experts cut over 2 ranks, tokens dispatched by all-to-all; the router is HF's
    _worker({**spec, "archon": {"dp": 2, "ep": 2}, "out": str(tmp_path / "archon.pt")}, 2)
    archon = torch.load(tmp_path / "archon.pt", weights_only=False)
    res["logprobs"].update({k: archon[k] for k in ("archon_on", "archon_off")})

    print(f"\nrouting mismatch vs the server (token x MoE layer; all fed tokens / generated tokens), "
          f"{res['stale/on']['n']} pairs:")
    for name in ("fp32_same/off", "bf16_same/off", "bf16_same/on", "stale/off", "stale/on", "stale/train_on"):
        c = res[name]
        print(f"  {name:15s} {_rate(c):7.2%}  generated {_rate(c, gen=True):7.2%}  ({c['diff']}/{c['n']})")
    assert res["stale/off"]["gen_diff"] > 0, "one policy version of staleness should move some routing"
    for name in ("bf16_same/on", "stale/on", "stale/train_on"):
        assert res[name]["n"] > 0 and res[name]["diff"] == 0, (name, res[name])
    assert _rate(res["fp32_same/off"]) < 0.01  # same weights, same precision: the same routing
    assert res["router_grad"] > 0  # the replayed experts' gate scores are still trained
    # the training step's own stat (what its router would have chosen differently) is the off rate, up to
    # near-ties that the no-grad and the training forward round differently
    assert res["stale/train_on"]["reported"] == pytest.approx(_rate(res["stale/off"]), abs=5e-3)

    lps, loss = res["logprobs"], batch["loss_mask"] > 0
    # under replay, every layout (and archon's expert-parallel blocks) runs the server's experts
    for name in ("packed", "shared", "cp_on", "archon_on"):
        torch.testing.assert_close(lps[name][loss], lps["padded"][loss], rtol=0, atol=1e-5)
    gap = (lps["packed_off"][loss] - lps["padded"][loss]).abs().max().item()
    print(f"  max |logprob| change from replay on the stale policy: {gap:.3g} nats")
    assert gap > 1e-4
    for name in ("cp_off", "archon_off"):
        assert (lps[name][loss] - lps["padded"][loss]).abs().max().item() > 1e-4, name
    # archon's training step replayed too, and its stat counts what its own routers would have changed
    assert 0 < archon["archon_train"]["routing_replay/mismatch_rate"] <= 1


@pytest.mark.megatron
@pytest.mark.parametrize("layout", ["d2e2", "t2p2"])
def test_megatron_routes_every_token_as_the_server_did(replayed, tmp_path, layout):
    """mcore's routers under replay: d2e2 (experts cut over 2 ranks) and t2p2 (sequence parallelism hands each
    router half the tokens; each stage holds one layer) run the server's experts for every recorded token, and
    give the fsdp engine's replayed logprobs."""
    from areal_cli.engines.megatron import compat

    if compat.installed_version() != compat.SUPPORTED_VERSION:
        pytest.skip(f"megatron-core {compat.SUPPORTED_VERSION} is not installed (pip install -e '.[megatron]')")
    batch, spec, res = replayed
    dims = {"d2e2": {"dp": 2, "ep": 2}, "t2p2": {"tp": 2, "pp": 2}}[layout]
    _worker({**spec, "megatron": dims, "out": str(tmp_path / "mcore.pt")}, 2 if layout == "d2e2" else 4)
    m = torch.load(tmp_path / "mcore.pt", weights_only=False)
    c, rate = m["megatron_chosen"], m["megatron_train"]["routing_replay/mismatch_rate"]
    print(f"\nmegatron {layout}: {c['n']} replayed (token x layer) pairs, {c['diff']} ran other experts; the "
          f"training step's own routers would have changed {rate:.2%}")
    assert c["n"] > 0 and c["diff"] == 0, c
    assert 0 < rate <= 1
    loss, padded = batch["loss_mask"] > 0, res["logprobs"]["padded"]
    torch.testing.assert_close(m["megatron_on"][loss], padded[loss], rtol=0, atol=1e-5)
    assert (m["megatron_off"][loss] - padded[loss]).abs().max().item() > 1e-4


def _worker(spec: dict, world: int) -> None:
    """r3_worker.py on ``world`` gloo ranks."""
    launch(spec, world, timeout=600, script=str(SUPPORT / "r3_worker.py"))


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("engine", ["fsdp", "megatron_d1t2"])
def test_areal_train_with_routing_replay_logs_the_mismatch(moe_dir, tmp_path, engine):
    """``areal train rollout.routing_replay=true`` on the MoE model: the routing travels from the server
    through the rollout worker into every training step, which logs what it replaced."""
    layout = {"fsdp": {}, "megatron_d1t2": {"engine": "megatron", "allocation_mode": "hf:d1+megatron:d1t2",
                                            "cluster.n_gpus_per_node": 3}}[engine]
    args = {**layout, "cluster.fileroot": str(tmp_path), "model.path": moe_dir, "experiment_name": "r3",
            "trial_name": "t0", "trainer.total_steps": 3, "trainer.sft_warmup_steps": 0,
            "trainer.eval_every": 0, "algo.batch_size": 2, "rollout.group_size": 2,
            "rollout.gconfig.max_new_tokens": 6,
            "rollout.max_head_offpolicyness": 1, "dataset.train_size": 50, "dataset.test_size": 4,
            "dataset.max_prompt_len": 256, "stats.live": "false", "algo.optim.lr": 1e-3,
            "rollout.routing_replay": "true"}
    argv = [sys.executable, "-m", "areal_cli.cli.main", "train", *[f"{k}={v}" for k, v in args.items()]]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    p = subprocess.run(argv, capture_output=True, text=True, timeout=540, env=env)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    lines = (tmp_path / "runs/r3/t0/metrics.jsonl").read_text().splitlines()
    recs = [json.loads(x) for x in lines if x.strip()]
    rates = [r["routing_replay/mismatch_rate"] for r in recs if r.get("kind") == "train"]
    print(f"\nrouting_replay/mismatch_rate per step: {rates}")
    assert len(rates) == 3 and all(0.0 <= x <= 1.0 for x in rates)
