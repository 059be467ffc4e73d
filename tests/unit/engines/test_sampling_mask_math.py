"""Keep-Sampling-Mask math: the server sampler's recorded cutoffs rebuild its kept set exactly (ties
included), and the vocab-parallel logprobs (a real 2-process gloo group, t=2 vocab shards) renormalise
over it like the one-process function, gradients included."""

from __future__ import annotations

import torch
from gloo_ranks import run_ranks

from areal_cli.engines.sampling_mask import masked_logprobs_entropy
from areal_cli.inference.server.sampling import SamplingParams, sample_next

T = 0.7


def _logits(vocab: int, rows: int = 6, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 3
    x[:, 5:40] = x[:, 5:6]  # a block of exact ties, straddling every cut below
    return x


def _params(**kw) -> list[SamplingParams]:
    return [SamplingParams(temperature=T, sampling_seed=i, **kw) for i in range(6)]


def test_sampler_cutoff_rebuilds_its_kept_set_and_logprob():
    for kw in ({"top_p": 0.9}, {"top_k": 20}, {"top_k": 7, "top_p": 0.5}, {"top_k": 1000}):
        logits = _logits(251)
        ids, full, cut, masked = sample_next(logits, _params(**kw), [0] * 6, set(), torch.Generator(),
                                             positions=list(range(6)), with_mask=True)
        z = logits / T
        kept = z >= cut.unsqueeze(1)
        assert kept.gather(1, ids.unsqueeze(1)).all(), kw  # the drawn token is inside the recorded set
        # every token tied with a kept one is kept: the set is a threshold, whatever order sort chose
        lowest = z.masked_fill(~kept, float("inf")).min(dim=1, keepdim=True).values
        assert ((z >= lowest) == kept).all(), kw
        if "top_k" in kw and "top_p" not in kw:
            assert (kept.sum(1) >= min(kw["top_k"], 251)).all()
        lp, ent = masked_logprobs_entropy(logits, ids, T, cut)
        assert (lp - masked).abs().max() <= 1e-6, kw
        ref = torch.log_softmax(z.masked_fill(~kept, float("-inf")), dim=1).gather(1, ids.unsqueeze(1)).squeeze(1)
        assert (lp - ref).abs().max() <= 1e-6, kw
        if kw != {"top_k": 1000}:  # truncation happened: renormalising moved every logprob up
            assert (masked - full).min() > 0, kw


def test_no_truncation_and_greedy_are_no_ops():
    logits = _logits(64)
    for params in (_params(), [SamplingParams(temperature=0.0, top_p=0.5)] * 6):
        ids, full, cut, masked = sample_next(logits, params, [0] * 6, set(), torch.Generator(),
                                             positions=list(range(6)), with_mask=True)
        assert torch.isinf(cut).all() and (cut < 0).all()
        assert torch.equal(full, masked)


def _sampled_case(vocab: int):
    """Eight rows sampled under top-p 0.9 and top-k 20: logits, the server's cutoffs and masked
    logprobs, and targets (row 0's is outside the kept set, which keeps it all the same)."""
    logits = _logits(vocab, rows=8, seed=vocab)
    ids, _, cut, masked = sample_next(logits, [SamplingParams(temperature=T, top_p=0.9, top_k=20, sampling_seed=i)
                                               for i in range(8)], [0] * 8, set(), torch.Generator(),
                                      positions=list(range(8)), with_mask=True)
    tgt = ids.clone()
    tgt[0] = int(logits[0].argmin())
    return logits, cut, masked, tgt


def _rank_main(rank: int, world: int, port: int, q) -> None:
    import torch.distributed as dist

    from areal_cli.engines.archon.vocab_parallel import logprobs_entropy, vocab_range

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    out = {}
    for vocab in (256, 251):
        logits, cut, _, tgt = _sampled_case(vocab)
        start, end = vocab_range(vocab, dist.group.WORLD)
        local = logits[:, start:end].clone().requires_grad_(True)
        lp, ent = logprobs_entropy(local, tgt, T, group=dist.group.WORLD, vocab_size=vocab, cutoffs=cut)
        (lp.sum() + 0.3 * ent.sum()).backward()
        out[vocab] = {"lp": lp.tolist(), "ent": ent.tolist(), "grad": local.grad.tolist(), "start": start}
    q.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()


def test_vocab_parallel_t2_masked_equals_full_vocab():
    results = run_ranks(_rank_main, 2)
    for vocab in (256, 251):
        logits, cut, masked, tgt = _sampled_case(vocab)
        full = logits.clone().requires_grad_(True)
        lp, ent = masked_logprobs_entropy(full, tgt, T, cut)
        (lp.sum() + 0.3 * ent.sum()).backward()
        assert torch.isfinite(lp).all() and torch.isfinite(full.grad).all()
        assert (lp[1:] - masked[1:]).abs().max() <= 1e-6  # the behaviour logprobs the server reported
        for rank in (0, 1):
            r = results[rank][vocab]
            assert (torch.tensor(r["lp"]) - lp).abs().max() <= 1e-5, (vocab, rank)
            assert (torch.tensor(r["ent"]) - ent).abs().max() <= 1e-5, (vocab, rank)
            g = torch.tensor(r["grad"])
            s = r["start"]
            assert (g - full.grad[:, s: s + g.shape[1]]).abs().max() <= 1e-5, (vocab, rank)
        # masked columns get no gradient at all
        z = logits / T
        out = (z < cut.unsqueeze(1))
        out[torch.arange(8), tgt] = False
        assert (full.grad[out] == 0).all() and out.any()


def test_ties_at_the_cut_are_all_kept():
    """top_k=3 over [5, 4, 3, 3, 3, 1, 0, ...]: the three tokens tied at 3 are all kept (5 in the set)."""
    logits = torch.zeros(1, 32)
    logits[0, :6] = torch.tensor([5.0, 4.0, 3.0, 3.0, 3.0, 1.0])
    _, _, cut, _ = sample_next(logits, [SamplingParams(temperature=T, top_k=3, sampling_seed=0)], [0],
                               set(), torch.Generator(), positions=[0], with_mask=True)
    kept = (logits / T >= cut.unsqueeze(1))[0]
    assert kept.nonzero().squeeze(1).tolist() == [0, 1, 2, 3, 4]
    assert 1.0 / T < cut.item() < 3.0 / T  # between the lowest kept and the highest dropped value


def test_config_option_is_validated():
    import pytest

    from areal_cli.plan.compose import load_config
    from areal_cli.plan.validate import validate
    from areal_cli.config.rollout import keep_sampling_mask_active
    from areal_cli.errors import ConfigError

    on = ["rollout.keep_sampling_mask=true", "rollout.gconfig.top_p=0.9"]
    cfg = load_config(on)
    assert keep_sampling_mask_active(cfg) and not validate(cfg).warnings
    assert not keep_sampling_mask_active(load_config(["rollout.gconfig.top_p=0.9"]))  # off by default
    for noop in (["rollout.keep_sampling_mask=true"], on + ["rollout.gconfig.greedy=true"]):
        cfg = load_config(noop)
        assert not keep_sampling_mask_active(cfg)
        assert any("keep_sampling_mask" in w and "no effect" in w for w in validate(cfg).warnings)
    with pytest.raises(ConfigError) as e:
        validate(load_config(on + ["rollout.gconfig.min_new_tokens=2"]))
    assert e.value.path == "rollout.keep_sampling_mask"
    with pytest.raises(ConfigError) as e:
        validate(load_config(on + ["allocation_mode=sglang:d1+fsdp:d1", "cluster.device=cuda"]))
    assert e.value.path == "rollout.keep_sampling_mask" and "sglang" in str(e.value)
