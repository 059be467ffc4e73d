"""Routing replay (R3) pieces on a tiny in-process Qwen3-MoE: forced experts, the gate's gradients, the
trainer-side layouts (padded, packed, shared-prefix), the wire format, the row plumbing and the config."""

from __future__ import annotations

import pytest
import torch

from areal_cli.engines import routing_replay as r3

N_LAYERS, N_EXPERTS, TOP_K = 2, 4, 2


@pytest.fixture(scope="module")
def moe():
    from transformers import AutoModelForCausalLM

    from areal_cli.models.tiny import tiny_qwen3_moe_config

    torch.manual_seed(0)
    cfg = tiny_qwen3_moe_config(vocab_size=50, hidden_size=32, num_layers=N_LAYERS, num_heads=4,
                                num_experts=N_EXPERTS, top_k=TOP_K)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).train()  # stats count training forwards


class ExpertsSeen:
    """The indices each layer's experts module is actually called with (independent of the router hook)."""

    def __init__(self, model):
        self.seen: list[torch.Tensor] = []
        blocks = [m for m in model.modules() if hasattr(m, "experts") and hasattr(m, "gate")]
        self.handles = [b.experts.register_forward_pre_hook(lambda _m, a: self.seen.append(a[1].clone()))
                        for b in blocks]

    def take(self) -> torch.Tensor:
        out, self.seen = torch.stack(self.seen, dim=1), []
        return out

    def close(self):
        for h in self.handles:
            h.remove()


def _natural(model, ids) -> torch.Tensor:
    cap = r3.Capture(model)
    cap.active = True
    with torch.no_grad():
        model(input_ids=ids)
    out = cap.take()
    cap.remove()
    return out


def _other_routing(natural: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """A different valid top-k per token and layer (distinct experts)."""
    g = torch.Generator().manual_seed(seed)
    n = natural[..., 0].numel()
    perm = torch.stack([torch.randperm(N_EXPERTS, generator=g)[:TOP_K] for _ in range(n)])
    return perm.view(natural.shape).to(natural.dtype)


def test_replay_forces_the_recorded_experts_and_differentiates_their_gates(moe):
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    nat = _natural(moe, ids)
    assert nat.shape == (14, N_LAYERS, TOP_K) and nat.dtype == torch.int8
    forced = _other_routing(nat)
    forced[3] = r3.NO_ROUTE  # a token without a recording keeps the model's own choice
    seen = ExpertsSeen(moe)
    try:
        r3.set_replay(moe, forced.reshape(14, -1))  # the batch's flat [T, layers * k] form
        out = moe(input_ids=ids).logits
        used = seen.take()
        want = forced.long().clone()
        want[3] = nat[3].long()
        assert torch.equal(used.sort(-1).values, want.sort(-1).values)
        out.sum().backward()
        for r in r3.routers(moe):
            assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0  # gate scores still trained
        st = moe._areal_r3_stats.clone()
        assert int(st[1]) == 13 * N_LAYERS and int(st[0]) > 0  # counted: 13 replayed tokens, some differ
        assert r3.replay_stats(moe)["routing_replay/mismatch_rate"] == int(st[0]) / int(st[1])
        assert r3.replay_stats(moe) == {}  # reset
    finally:
        r3.set_replay(moe, None)
        seen.close()
        moe.zero_grad(set_to_none=True)


def test_replaying_the_models_own_routing_changes_nothing(moe):
    """Replay of the natural routing gives the plain forward's logits and gradients: the hook's maths
    are the router's own."""
    ids = torch.randint(0, 50, (3, 6), generator=torch.Generator().manual_seed(2))
    nat = _natural(moe, ids)
    ref = moe(input_ids=ids).logits
    ref.square().sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in moe.named_parameters() if p.grad is not None}
    moe.zero_grad(set_to_none=True)
    r3.set_replay(moe, nat)
    try:
        out = moe(input_ids=ids).logits
        out.square().sum().backward()
    finally:
        r3.set_replay(moe, None)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    for n, p in moe.named_parameters():
        if n in ref_grads:
            torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-5, atol=1e-7)
    assert r3.replay_stats(moe)["routing_replay/mismatch_rate"] == 0.0
    moe.zero_grad(set_to_none=True)


def test_replay_refuses_a_routing_that_does_not_fit(moe):
    ids = torch.randint(0, 50, (1, 5))
    with pytest.raises(r3.RoutingReplayError, match="MoE layers"):
        r3.set_replay(moe, torch.zeros(5, 3, TOP_K, dtype=torch.int16))
    r3.set_replay(moe, torch.zeros(4, N_LAYERS * TOP_K, dtype=torch.int16))  # 4 tokens for a 5-token forward
    try:
        with pytest.raises(r3.RoutingReplayError, match="covers 4 tokens"):
            moe(input_ids=ids)
    finally:
        r3.set_replay(moe, None)


def _mb(ids: list[list[int]], loss_from: list[int]) -> dict:
    """A batch whose routing is a function of the token (id % 4 in every slot): any layout that moves
    tokens must move their routing with them."""
    B, L = len(ids), max(len(x) for x in ids)
    t = torch.zeros(B, L, dtype=torch.long)
    am = torch.zeros(B, L, dtype=torch.bool)
    lm = torch.zeros(B, L)
    for r, x in enumerate(ids):
        t[r, : len(x)] = torch.tensor(x)
        am[r, : len(x)] = True
        lm[r, loss_from[r]: len(x)] = 1
    rt = (t % N_EXPERTS).to(torch.int16)[..., None].expand(B, L, N_LAYERS * TOP_K).clone()
    rt[~am] = r3.NO_ROUTE
    return {"input_ids": t, "attention_mask": am, "loss_mask": lm, r3.KEY: rt}


def test_layouts_carry_each_tokens_routing():
    from areal_cli.engines import packing

    mb = _mb([[5, 6, 7, 9, 10], [5, 6, 7, 11], [3, 2, 1]], [3, 3, 1])
    flat = r3.padded(mb)
    assert torch.equal(flat[:, 0][mb["attention_mask"].view(-1)],
                       (mb["input_ids"][mb["attention_mask"]] % N_EXPERTS).to(torch.int16))
    pk = packing.pack(mb, pad_to_multiple_of=8)
    rp = r3.packed(mb, pk.lengths, pk.input_ids.shape[1])
    real = pk.input_ids[0, : pk.n_real]
    assert torch.equal(rp[: pk.n_real, 0].long(), real % N_EXPERTS) and (rp[pk.n_real:] == r3.NO_ROUTE).all()
    sp = packing.pack_shared(mb, loss_only=True)
    assert sp is not None and r3.prefix_shareable(mb)
    rs = r3.shared(mb, sp.input_ids)
    assert torch.equal(rs[:, 0].long(), sp.input_ids[0] % N_EXPERTS)
    mb[r3.KEY][1, 1] = 3  # the second row's prompt was routed differently: no shared prefix for it
    assert not r3.prefix_shareable(mb)


def test_wire_format_and_row_plumbing():
    from areal_cli.inference.backends.sglang import parse_generate
    from areal_cli.rollout.workflows.common import Segment, build_row, stack_rows

    full = torch.randint(0, N_EXPERTS, (9, N_LAYERS, TOP_K), dtype=torch.int8)
    text = r3.encode([full[:4], full[4:]])
    assert torch.equal(r3.decode(text, 9), full.view(9, -1).to(torch.int16))
    assert torch.equal(r3.decode(r3.encode(full, 3), 6), full[3:].view(6, -1).to(torch.int16))
    with pytest.raises(ValueError):
        r3.decode(text, 7)
    meta = {"finish_reason": {"type": "stop"}, "prompt_tokens": 6, "completion_tokens": 4,
            "routed_experts": text,
            "output_token_logprobs": [[-1.0, t, None] for t in (1, 2, 3, 4)]}
    seg = parse_generate({"meta_info": meta, "output_ids": [1, 2, 3, 4]})
    assert seg.routed_experts.shape == (9, N_LAYERS * TOP_K)
    # a resumed request: the second answer re-covers the first's positions; the first recording wins
    first, again = full[:5].view(5, -1).short(), (full.view(9, -1).short() + 1) % N_EXPERTS
    both = r3.stitch(r3.stitch(None, first), again)
    assert torch.equal(both[:5], first) and torch.equal(both[5:], again[5:])
    # a row: prompt 6 tokens, 4 generated; 9 positions recorded, the last token's is -1
    row = build_row([Segment(list(range(6))), Segment([1, 2, 3, 4], [0.0] * 4, [0] * 4, None, both)])
    assert row[r3.KEY].shape == (10, N_LAYERS * TOP_K) and (row[r3.KEY][9] == r3.NO_ROUTE).all()
    short = build_row([Segment([7, 8]), Segment([1], [0.0], [0], None, both[:2])])
    traj = stack_rows([row, short], [1.0, 0.0], [False, False], group_id=0, pad_id=0)
    assert traj.data[r3.KEY].dtype == torch.int16 and (traj.data[r3.KEY][1, 2:] == r3.NO_ROUTE).all()


def test_config_refuses_what_cannot_replay(tmp_path):
    from areal_cli.plan.compose import load_config
    from areal_cli.plan.validate import validate
    from areal_cli.errors import ConfigError

    moe = ["model.num_experts=4", "model.num_experts_per_tok=2", "rollout.routing_replay=true"]
    assert validate(load_config(moe)) is not None
    assert not load_config(moe[:2]).rollout.routing_replay  # off by default
    # archon without t and p replays (its MoE blocks call the HF router the hook sits on)
    assert validate(load_config(moe + ["engine=archon", "allocation_mode=hf:d1+archon:d2e2",
                                       "cluster.n_gpus_per_node=3"])) is not None
    # megatron replays at every layout (mcore's router seam), but not under full recompute
    assert validate(load_config(moe + ["engine=megatron", "allocation_mode=hf:d1+megatron:d1t2p2",
                                       "cluster.n_gpus_per_node=5"])) is not None
    cases = [(["rollout.routing_replay=true"], "dense"),
             (moe + ["engine=deepspeed"], "deepspeed engine cannot replay routing yet (supported: fsdp, archon, "
              "megatron)"),
             (moe + ["engine=megatron", "engine.gradient_checkpointing=true",
                     "engine.megatron.recompute_granularity=full"], "recompute_granularity=full"),
             (moe + ["engine=archon", "allocation_mode=hf:d1+archon:d1p2", "cluster.n_gpus_per_node=3"],
              "archon replays routing under d, c and e only (this plan has t1p2)"),
             (moe + ["engine=archon", "allocation_mode=hf:d1+archon:d1t2", "cluster.n_gpus_per_node=3"],
              "archon replays routing under d, c and e only (this plan has t2p1)"),
             (moe + ["allocation_mode=sglang:d1+fsdp:d1", "cluster.device=cuda"], "sglang server")]
    for overrides, text in cases:
        with pytest.raises(ConfigError) as e:
            validate(load_config(overrides))
        assert e.value.path == "rollout.routing_replay" and text in str(e.value), str(e.value)


def test_activation_checkpointing_recomputes_with_the_replayed_routing(moe):
    """The recomputation in backward must route as the forward did: same gradients with and without it."""
    ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(4))
    forced = _other_routing(_natural(moe, ids), seed=5)
    grads = []
    for ckpt in (False, True):
        if ckpt:
            moe.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        r3.set_replay(moe, forced)
        try:
            moe(input_ids=ids).logits.square().sum().backward()
        finally:
            r3.set_replay(moe, None)
            moe.gradient_checkpointing_disable()
        grads.append({n: p.grad.clone() for n, p in moe.named_parameters() if p.grad is not None})
        moe.zero_grad(set_to_none=True)
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-5, atol=1e-7)
    r3.replay_stats(moe)
