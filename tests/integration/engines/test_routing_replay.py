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


def test_trainer_routes_every_token_as_the_server_did(server, moe_dir, tmp_path):
    batch = _rollout(server.address, moe_dir)
    rt, am = batch[KEY], batch["attention_mask"]
    assert rt.dtype == torch.int16 and rt.shape[:2] == am.shape and rt.shape[2] == N_LAYERS * TOP_K
    lens = am.sum(1)
    recorded = (rt >= 0).all(-1)
    # every fed token is recorded: all but each row's last; padding never
    assert torch.equal(recorded.sum(1), lens - 1) and not recorded[~am].any()
    torch.save(batch, tmp_path / "batch.pt")
    out = tmp_path / "res.pt"
    spec = {"model_dir": moe_dir, "batch": str(tmp_path / "batch.pt"), "out": str(out), "lr": 1e-3,
            "stale_dir": str(tmp_path / "stale")}
    _worker(spec, 1)
    res = torch.load(out, weights_only=False)
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


def _worker(spec: dict, world: int) -> None:
    """r3_worker.py on ``world`` gloo ranks."""
    launch(spec, world, timeout=600, script=str(SUPPORT / "r3_worker.py"))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_areal_train_with_routing_replay_logs_the_mismatch(moe_dir, tmp_path):
    """``areal train rollout.routing_replay=true`` on the MoE model: the routing travels from the server
    through the rollout worker into every training step, which logs what it replaced."""
    args = {"cluster.fileroot": str(tmp_path), "model.path": moe_dir, "experiment_name": "r3",
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
