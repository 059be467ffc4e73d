"""Keep-Sampling-Mask end to end: the hf server samples with top-p / top-k and records each token's kept
set; a real FSDP engine, given that mask, recomputes exactly the behaviour policy's logprobs.

Without the mask the trainer's logprobs are those of the full softmax, off by the log of the kept mass
at every token: that gap is measured and printed (the bias the mask removes).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from fsdp_worker import launch  # noqa: E402
from hf_server_helpers import prompts, start_hf_server  # noqa: E402
from support_paths import SUPPORT

TOL = 1e-4
TEMPERATURE = 0.7
GROUP = 4
SETTINGS = {"top_p": {"top_p": 0.9}, "top_k": {"top_k": 20}, "both": {"top_p": 0.9, "top_k": 20}}
VARIANTS = [
    {"name": "shared", "engine": {"max_tokens_per_mb": 100_000}},  # shared-prefix packing (the default)
    {"name": "packed", "engine": {"max_tokens_per_mb": 100_000, "shared_prefix": False}},
    {"name": "padded", "engine": {"max_tokens_per_mb": 100_000, "padding_free": False}},
    {"name": "nomask", "engine": {"max_tokens_per_mb": 100_000}, "mask": False},
]


# Archon: t2 shards the vocabulary (engines/archon/vocab_parallel.py), p2 runs the pipeline's unpacking
VARIANTS_2 = [{"name": "archon_t2", "cls": "archon", "parallel": {"tp": 2}, "engine": {"max_tokens_per_mb": 100_000}},
              {"name": "archon_p2", "cls": "archon", "parallel": {"pp": 2}, "engine": {"max_tokens_per_mb": 100_000}}]


def _recompute(model_dir: str, tmp_path: Path, tag: str, variants: list[dict], world: int) -> dict:
    """Run ksm_worker.py on ``world`` ranks; per variant, rank 0's forward and the training-path logprobs
    of the rank that ran the loss (the last pipeline stage)."""
    out = tmp_path / f"{tag}.pt"
    spec = {"model_dir": model_dir, "batch": str(tmp_path / "batch.pt"), "out": str(out),
            "temperature": TEMPERATURE, "variants": variants}
    launch(spec, world, timeout=600, script=str(SUPPORT / "ksm_worker.py"))
    ranks = [torch.load(str(out).replace(".pt", f".{r}.pt"), weights_only=False) for r in range(world)]
    res = {}
    for v in variants:
        train = max((r[v["name"]]["train"] for r in ranks), key=lambda t: t.abs().sum().item())
        res[v["name"]] = {"forward": ranks[0][v["name"]]["forward"], "train": train}
    return res


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    h = start_hf_server(tiny_model_dir, tmp_path_factory)
    yield h
    h.stop()


def _generate(address: str, tok_prompts: list[list[int]], sp: dict) -> list[tuple[list[int], dict]]:
    """GRPO-style groups in SGLang's batch form: each prompt ``GROUP`` times, one seed per row."""
    rows = [p for p in tok_prompts for _ in range(GROUP)]
    body = {"input_ids": rows, "return_logprob": True, "return_sampling_mask": True,
            "sampling_params": [{"max_new_tokens": 12, "temperature": TEMPERATURE, "sampling_seed": 100 + i,
                                 "ignore_eos": True, **sp} for i in range(len(rows))]}
    r = httpx.post(f"http://{address}/generate", json=body, timeout=300)
    r.raise_for_status()
    return [(p, out) for p, out in zip(rows, r.json())]


def _batch(results: list[tuple[list[int], dict]]) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """The trainer batch, plus the server's masked and full logprobs laid out like it."""
    B, L = len(results), max(len(p) + len(o["output_ids"]) for p, o in results)
    ids = torch.zeros(B, L, dtype=torch.long)
    loss = torch.zeros(B, L)
    cut = torch.full((B, L), float("-inf"))
    masked, full = torch.zeros(B, L), torch.zeros(B, L)
    for r, (p, o) in enumerate(results):
        meta, out = o["meta_info"], o["output_ids"]
        n, m = len(p), len(out)
        ids[r, : n + m] = torch.tensor(p + out)
        loss[r, n: n + m] = 1
        cut[r, n: n + m] = torch.tensor([float("-inf") if c is None else c
                                         for c in meta["output_token_sampling_cutoffs"]])
        masked[r, n: n + m] = torch.tensor(meta["output_token_sampling_logprobs"])
        full[r, n: n + m] = torch.tensor([x[0] for x in meta["output_token_logprobs"]])
    batch = {"input_ids": ids, "attention_mask": ids.new_zeros(B, L, dtype=torch.bool), "loss_mask": loss,
             "sampling_cutoff": cut, "row": torch.arange(B)}
    for r, (p, o) in enumerate(results):
        batch["attention_mask"][r, : len(p) + len(o["output_ids"])] = True
    return batch, masked, full


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_trainer_logprobs_equal_server_with_mask(server, tiny_model_dir, tmp_path, setting):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    results = _generate(server.address, prompts(tok, 3, seed=7), SETTINGS[setting])
    batch, masked, full = _batch(results)
    loss = batch["loss_mask"] > 0
    cut = batch["sampling_cutoff"][loss]
    assert torch.isfinite(cut).all(), "every sampled token under truncation records a finite cutoff"
    torch.save(batch, tmp_path / "batch.pt")
    res = _recompute(tiny_model_dir, tmp_path, "w1", VARIANTS, 1)
    if setting == "both":  # the tensor-parallel vocab-sharded and the pipelined paths (2 ranks)
        res.update(_recompute(tiny_model_dir, tmp_path, "w2", VARIANTS_2, 2))
    for name in [v["name"] for v in VARIANTS[:-1]] + ([v["name"] for v in VARIANTS_2] if setting == "both" else []):
        for path in ("forward", "train"):
            d = (res[name][path][loss] - masked[loss]).abs().max().item()
            assert d <= TOL, f"{setting}/{name}/{path}: trainer vs server masked logprobs differ by {d:.3g}"
    nomask = res["nomask"]["forward"][loss]
    # apples to apples: unmasked, the trainer reproduces the server's full-softmax logprobs
    assert (nomask - full[loss]).abs().max().item() <= TOL
    gap = (nomask - masked[loss]).abs()
    print(f"\n[keep-sampling-mask] {setting} T={TEMPERATURE}: without the mask |trainer - behaviour| "
          f"mean {gap.mean():.4f} max {gap.max():.4f} nats over {int(loss.sum())} tokens")
    assert gap.max().item() > 10 * TOL, "the unmasked logprobs should show the truncation bias"


def test_client_and_workflow_carry_the_mask(server, tiny_model_dir):
    """``GenerationConfig.keep_sampling_mask`` → ``ModelResponse.sampling_cutoffs`` and behaviour logprobs
    → the trajectory's ``sampling_cutoff`` (-inf on prompts and padding). Off by default: lean responses."""
    import asyncio

    from transformers import AutoTokenizer

    from areal_cli.api.io_struct import GenerationConfig, ModelRequest
    from areal_cli.api.workflow_api import Trajectory
    from areal_cli.inference.client import RemoteInferenceEngine
    from areal_cli.rollout.workflows.common import Segment, build_row, stack_rows

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = prompts(tok, 1, seed=11)[0]
    g = GenerationConfig(temperature=TEMPERATURE, top_k=20, max_new_tokens=8, stop_token_ids=[], seed=5)
    engine = RemoteInferenceEngine([server.address], "hf", timeout_s=300)

    async def go():
        return await engine.agenerate_group([ModelRequest(input_ids=prompt, gconfig=g.new(keep_sampling_mask=True,
                                                                                           seed=5 + i))
                                             for i in range(2)] + [ModelRequest(input_ids=prompt, gconfig=g)])

    masked, masked2, plain = asyncio.run(go())
    lean = httpx.post(f"http://{server.address}/generate", json={
        "input_ids": prompt, "return_logprob": True,
        "sampling_params": {"max_new_tokens": 4, "temperature": TEMPERATURE, "top_k": 20}}, timeout=120).json()
    assert "output_token_sampling_cutoffs" not in lean["meta_info"]  # not asked: not sent
    assert plain.sampling_cutoffs is None
    assert masked.sampling_cutoffs is not None and len(masked.sampling_cutoffs) == len(masked.output_tokens)
    assert all(c > float("-inf") for c in masked.sampling_cutoffs)
    # the same seed draws the same tokens; the masked response reports the truncated (higher) logprobs
    same = [(a, b) for a, b in zip(masked.output_logprobs, plain.output_logprobs)]
    assert masked.output_tokens == plain.output_tokens and all(a > b for a, b in same)
    rows = [build_row([Segment(prompt), Segment(r.output_tokens, r.output_logprobs, r.output_versions,
                                                r.sampling_cutoffs)]) for r in (masked, masked2)]
    rows[1] = {k: v[:-3] for k, v in rows[1].items()}  # a shorter row: stack_rows pads it
    traj = stack_rows(rows, [0.0, 1.0], [False, False], 0, 0)
    cut = traj.data["sampling_cutoff"]
    n = len(prompt)
    assert torch.isinf(cut[:, :n]).all() and torch.isfinite(cut[0, n:]).all()
    assert torch.isinf(cut[1, -3:]).all() and (cut[1, -3:] < 0).all()
    short = stack_rows([rows[1]], [0.0], [False], 1, 0)
    both = Trajectory.concat([traj, short])
    assert torch.isinf(both.data["sampling_cutoff"][2, -3:]).all()
    assert "sampling_cutoff" not in build_row([Segment(prompt), Segment(plain.output_tokens, plain.output_logprobs,
                                                                        plain.output_versions)])
