"""The hf server's fast decode path against HF's own forward (fp32, within 1e-4)."""

from __future__ import annotations

import random
import sys
import threading
from pathlib import Path

import pytest
import torch

from areal_cli.inference.server import decode_kernel
from areal_cli.inference.server.fastpath import FastRunner, unsupported_reason

# hf_baseline: the server's earlier paths, kept as the benchmark's baselines in benchmarks/
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))


def _model(kind: str):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    cfg = {"qwen2": lambda: Qwen2Config(**common),  # q/k/v biases
           "qwen3": lambda: Qwen3Config(head_dim=16, **common),  # q_norm / k_norm
           "llama": lambda: LlamaConfig(**{**common, "num_key_value_heads": 1})}[kind]()
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def _ref_last(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


def _kernel_or_skip() -> None:
    reason = decode_kernel.usable(torch.float32, torch.device("cpu"), check_threads=False)
    if reason is not None:
        pytest.skip(f"fused decode kernel unavailable: {reason}")


@pytest.mark.parametrize("attention", ["torch", "kernel", "torch-flash-prefill", "kernel-torch-prefill"])
@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama"])
def test_fast_runner_matches_hf_forward(kind, attention):
    model = _model(kind)
    assert unsupported_reason(model) is None
    if attention.startswith("kernel"):
        _kernel_or_skip()
    runner = FastRunner(model, torch.device("cpu"), attention=attention.split("-")[0])
    assert runner.attention == attention.split("-")[0]
    if attention == "torch-flash-prefill":  # prefill attention through SDPA's flash kernel (long prompts)
        runner.MATMUL_ATTENTION_MAX = 0
    if attention == "kernel-torch-prefill":  # long prompts: torch prefill into the slabs the kernel decodes
        runner.KERNEL_PREFILL_MAX_LEN = 0
    rng = random.Random(1)
    seqs = [[rng.randrange(1, 97) for _ in range(rng.randint(1, 30))] for _ in range(5)]
    logits = runner.prefill(seqs[:3])  # rows join in two cohorts, the second while the first decodes
    live = seqs[:3]
    err = max((logits[i] - _ref_last(model, live[i])).abs().max().item() for i in range(3))
    for step in range(8):
        if step == 2:
            logits = runner.prefill(seqs[3:])
            err = max(err, *((logits[i] - _ref_last(model, seqs[3 + i])).abs().max().item() for i in range(2)))
            live = live + seqs[3:]
        if step == 5:  # retire rows 1 and 3, reorder the rest
            order = [4, 0, 2]
            runner.keep(order)
            live = [live[i] for i in order]
        toks = [rng.randrange(1, 97) for _ in live]
        live = [s + [t] for s, t in zip(live, toks)]
        logits = runner.decode(toks)
        assert runner.lens == [len(s) for s in live]
        err = max(err, *((logits[i] - _ref_last(model, s)).abs().max().item() for i, s in enumerate(live)))
    assert err < 1e-4, err


def test_decode_kernel_matches_torch_ops_on_a_long_ragged_batch():
    """Rows of very different lengths, slab growth and row compaction: kernel and torch decode agree."""
    _kernel_or_skip()
    model = _model("qwen2")
    runners = [FastRunner(model, torch.device("cpu"), attention=a) for a in ("kernel", "torch")]
    rng = random.Random(5)
    seqs = [[rng.randrange(1, 97) for _ in range(n)] for n in (1, 70, 13, 40)]
    outs = [r.prefill(seqs) for r in runners]
    for step in range(80):  # crosses the 64 → 128 column growth of the slabs
        if step == 30:  # retire row 1, reorder the rest
            for r in runners:
                r.keep([3, 0, 2])
        toks = [rng.randrange(1, 97) for _ in range(runners[0].rows)]
        outs = [r.decode(toks) for r in runners]
        assert (outs[0] - outs[1]).abs().max().item() < 1e-4
    assert runners[0].lens == runners[1].lens


def test_forced_kernel_reports_why_it_cannot_run():
    model = _model("qwen2").to(torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16"):
        FastRunner(model, torch.device("cpu"), attention="kernel")
    assert FastRunner(model, torch.device("cpu")).attention == "torch"


def test_fast_runner_sees_in_place_weight_updates():
    model = _model("qwen2")
    runner = FastRunner(model, torch.device("cpu"))
    ids = [5, 9, 11, 2]
    before = runner.prefill([ids])[0]
    with torch.no_grad():  # what a weight update does: copy_ into the live parameters
        model.model.layers[1].mlp.down_proj.weight.copy_(torch.randn_like(model.model.layers[1].mlp.down_proj.weight))
    runner.clear()
    after = runner.prefill([ids])[0]
    assert (after - before).abs().max().item() > 1e-3
    assert (after - _ref_last(model, ids)).abs().max().item() < 1e-4


def test_unsupported_architecture_is_reported():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=32, n_layer=1, n_head=2))
    assert "model_type" in unsupported_reason(model)


def _run_engine(model_dir: str, fast: bool, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from areal_cli.inference.server.attention import use_areal_sdpa
    from areal_cli.inference.server.engine import GenerationEngine, Sequence
    from areal_cli.inference.server.sampling import SamplingParams

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    use_areal_sdpa(model)
    eng = GenerationEngine(model, AutoTokenizer.from_pretrained(model_dir), device="cpu", context_length=512,
                           fast_path=fast)
    assert type(eng.runner).__name__ == ("FastRunner" if fast else "HFRunner")
    done = threading.Semaphore(0)
    seqs = [Sequence(rid=str(i), prompt_ids=p, on_done=lambda s: done.release(),
                     params=SamplingParams(max_new_tokens=4 + 3 * i, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(prompts)]
    eng.start()
    try:
        for s in seqs:
            eng.submit(s)
        for _ in seqs:
            assert done.acquire(timeout=120)
    finally:
        eng.shutdown()
    return [(s.out_ids, s.out_logprobs) for s in seqs]


def test_engine_fast_and_hf_runners_agree(tiny_model_dir):
    rng = random.Random(3)
    prompts = [[rng.randrange(10, 200) for _ in range(rng.randint(2, 20))] for _ in range(6)]
    fast = _run_engine(tiny_model_dir, True, prompts)
    slow = _run_engine(tiny_model_dir, False, prompts)
    for (ids_f, lp_f), (ids_s, lp_s) in zip(fast, slow):
        assert ids_f == ids_s
        assert max(abs(a - b) for a, b in zip(lp_f, lp_s)) < 1e-4


# ---------------------------------------------------------------- shared-prompt prefill (KV row copies)
@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_forked_rows_match_independent_prefill(kind):
    """``fork`` copies a prompt's KV rows: the copies decode exactly like independently prefilled rows,
    also when the source row has already decoded past its prompt."""
    model = _model(kind)
    rng = random.Random(7)
    a, b = ([rng.randrange(1, 97) for _ in range(n)] for n in (11, 23))
    shared = FastRunner(model, torch.device("cpu"), attention="torch")
    fresh = FastRunner(model, torch.device("cpu"), attention="torch")
    shared.prefill([a, b])
    shared.fork([1, 0], [len(b), len(a)])  # rows 2, 3: copies of b and a
    fresh.prefill([a, b, b, a])
    toks = [5, 6, 6, 5]  # rows 0 and 3 (prompt a) get the same tokens, rows 1 and 2 (b) too
    for _ in range(3):  # row 0 decodes past its prompt; its prompt columns stay valid for later copies
        out_s, out_f = shared.decode(toks), fresh.decode(toks)
        assert (out_s - out_f).abs().max().item() < 1e-5
        assert torch.equal(out_s[0], out_s[3]) and torch.equal(out_s[1], out_s[2])
    shared.fork([0], [len(a)])  # a late copy of a from a row that has generated 3 tokens since
    fresh.prefill([a])
    toks = [7, 8, 9, 10, 7]
    out_s, out_f = shared.decode(toks), fresh.decode(toks)
    assert shared.lens == fresh.lens
    assert (out_s - out_f).abs().max().item() < 1e-5
    assert (out_s[4] - _ref_last(model, a + [7])).abs().max().item() < 1e-4


def _drive(model_dir: str, fast: bool, shared: bool):
    """Run the engine loop by hand (no thread): a deterministic admission schedule. Prompts A and B
    are sent 3x each at step 0 (copies inside one admission) and A again at step 2 (a copy from a
    running row). Returns per request (tokens, logprobs, cached_tokens) and the engine stats."""
    from hf_baseline import IndependentPrefillEngine  # benchmarks/: the baseline left the product
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from areal_cli.inference.server.attention import use_areal_sdpa
    from areal_cli.inference.server.engine import GenerationEngine, Sequence
    from areal_cli.inference.server.sampling import SamplingParams

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    use_areal_sdpa(model)
    cls = GenerationEngine if shared else IndependentPrefillEngine
    eng = cls(model, AutoTokenizer.from_pretrained(model_dir), device="cpu", context_length=512,
              fast_path=fast)
    rng = random.Random(4)
    pa, pb = ([rng.randrange(10, 200) for _ in range(n)] for n in (17, 9))
    done: list = []

    def seq(i: int, p: list[int]) -> Sequence:
        return Sequence(rid=str(i), prompt_ids=list(p), on_done=done.append,
                        params=SamplingParams(max_new_tokens=6, temperature=1.0, ignore_eos=True,
                                              sampling_seed=100 + i))

    first = [seq(i, p) for i, p in enumerate([pa, pb, pa, pb, pa, pb])]
    late = [seq(6, pa), seq(7, [3] + pb)]
    for s in first:
        eng.submit(s)
    with torch.no_grad():
        for step in range(12):
            if step == 2:
                for s in late:
                    eng.submit(s)
            eng._admit()
            if eng._running:
                eng._decode_step()
    assert len(done) == 8
    return {s.rid: (s.out_ids, s.out_logprobs, s.cached_tokens) for s in done}, dict(eng.stats)


@pytest.mark.parametrize("fast", [True, False], ids=["fastpath", "hf"])
def test_engine_shared_prefill_matches_independent_prefill(tiny_model_dir, fast):
    shared, st_s = _drive(tiny_model_dir, fast, shared=True)
    alone, st_a = _drive(tiny_model_dir, fast, shared=False)
    assert st_a["shared_prefill_tokens"] == 0
    # A and B computed once; 2 copies of A and B at step 0 plus the late copy of A were not prefilled.
    assert st_s["prefill_tokens"] == 17 + 9 + 10 and st_s["shared_prefill_tokens"] == 17 * 3 + 9 * 2
    assert [shared[str(i)][2] for i in range(8)] == [0, 0, 17, 9, 17, 9, 17, 0]
    for rid, (ids, lps, _) in alone.items():
        assert shared[rid][0] == ids, rid
        assert max(abs(x - y) for x, y in zip(shared[rid][1], lps)) < 1e-5
    # The copies of one prompt differ only by their seeds.
    assert len({tuple(shared[str(i)][0]) for i in (0, 2, 4, 6)}) > 1


# ---------------------------------------------------------------- seeded sampling (counter-based hash)
def _splitmix_ref(seed: int, pos: int) -> float:
    """Pure-Python reference of ``seeded_uniform`` (unsigned 64-bit arithmetic)."""
    m = 2**64 - 1

    def mix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        return z ^ (z >> 31)

    z = mix((mix((seed + 0x9E3779B97F4A7C15) & m) + pos * 0x9E3779B97F4A7C15) & m)
    return (z >> 11) / 2**53


def test_seeded_uniform_matches_unsigned_reference():
    """The int64 torch ops (wrapping products, logical shifts) compute splitmix64 exactly."""
    from areal_cli.inference.server.sampling import seeded_uniform

    seeds = [0, 1, 2, 1000, 2**62 - 1, 2**63 + 5, -3, 123456789]
    pos = [0, 1, 29, 30, 7, 1 << 40, 3, 45]
    got = seeded_uniform(seeds, pos).tolist()
    assert got == [_splitmix_ref(s % 2**64, p) for s, p in zip(seeds, pos)]
    assert all(0.0 <= u < 1.0 for u in got)


@pytest.mark.parametrize("temperature,top_k", [(1.0, -1), (0.7, -1), (1.0, 3)])
def test_seeded_sampling_distribution(temperature, top_k):
    """Over many seeds (and over positions for one seed) the token frequencies match the row's
    probabilities (chi-square, 0.1% critical value); truncated and zero-probability tokens never occur."""
    from areal_cli.inference.server.sampling import SamplingParams, sample_next

    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04, 0.0])
    logits = p.log().unsqueeze(0)  # log(0) = -inf: a token that must never be drawn
    target = torch.softmax(logits[0] / temperature, dim=-1)
    if top_k > 0:
        target = torch.where(torch.arange(7) < top_k, target, torch.zeros(()))
        target = target / target.sum()
    crit = {2: 13.82, 5: 20.52}  # chi-square 0.999 quantiles by degrees of freedom
    n = 20000
    for seeds, positions in (([1000 + i for i in range(n)], [29] * n), ([7] * n, list(range(n)))):
        params = [SamplingParams(temperature=temperature, top_k=top_k, sampling_seed=s) for s in seeds]
        ids, _ = sample_next(logits.expand(n, -1), params, [0] * n, set(), torch.Generator().manual_seed(0),
                             positions=positions)
        counts = torch.bincount(ids, minlength=7).double()
        support = target > 0
        assert counts[~support].sum().item() == 0
        expected = target[support].double() * n
        chi2 = ((counts[support] - expected) ** 2 / expected).sum().item()
        assert chi2 < crit[int(support.sum()) - 1], (chi2, counts.tolist())


def test_seeded_sampling_is_batch_independent_in_mixed_batches():
    """A seeded row draws the same token alone, in any order, next to unseeded and greedy rows, and
    unseeded rows do not consume anything from seeded ones; the old generator path still works."""
    from areal_cli.inference.server.sampling import SamplingParams, sample_next

    torch.manual_seed(3)
    logits = torch.randn(6, 400) * 3
    params = [SamplingParams(sampling_seed=5), SamplingParams(), SamplingParams(temperature=0.0),
              SamplingParams(sampling_seed=6, temperature=0.8), SamplingParams(sampling_seed=7, top_p=0.9),
              SamplingParams(temperature=1.2)]
    pos = [30, 31, 32, 33, 34, 35]
    full, lp = sample_next(logits, params, [0] * 6, set(), torch.Generator().manual_seed(0), positions=pos)
    assert full[2].item() == logits[2].argmax().item()
    for i in (0, 3, 4):
        alone, lp1 = sample_next(logits[i:i + 1], [params[i]], [0], set(), torch.Generator().manual_seed(9),
                                 positions=[pos[i]])
        assert alone.item() == full[i].item() and lp1.item() == pytest.approx(lp[i].item(), abs=1e-6)
    perm = [4, 5, 3, 0, 2, 1]
    shuffled, _ = sample_next(logits[perm], [params[i] for i in perm], [0] * 6, set(),
                              torch.Generator().manual_seed(1), positions=[pos[i] for i in perm])
    assert [shuffled[perm.index(i)].item() for i in (0, 2, 3, 4)] == [full[i].item() for i in (0, 2, 3, 4)]
    from hf_baseline import generator_sampling  # benchmarks/: the baseline the benchmark compares with

    with generator_sampling():
        old, _ = sample_next(logits, params, [0] * 6, set(), torch.Generator().manual_seed(0), positions=pos)
        old_alone, _ = sample_next(logits[3:4], params[3:4], [0], set(), torch.Generator().manual_seed(2),
                                   positions=[33])
    assert old[2].item() == full[2].item() and old_alone.item() == old[3].item()


def test_hf_runner_passes_logits_to_keep_only_where_forward_takes_it():
    """An architecture without ``logits_to_keep`` gets all logits; a TypeError raised inside a model's
    forward is the model's error, not retried as a missing argument."""
    from types import SimpleNamespace

    from areal_cli.inference.server.engine import HFRunner

    class NoKeep(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None,
                    use_cache=False):
            return SimpleNamespace(logits=torch.arange(input_ids.numel() * 3.0).view(*input_ids.shape, 3),
                                   past_key_values="cache")

    class Broken(torch.nn.Module):
        def forward(self, input_ids, logits_to_keep=0, **kw):
            raise TypeError("a bug inside the model")

    ids = torch.ones((1, 2), dtype=torch.long)
    logits, cache = HFRunner(NoKeep(), torch.device("cpu"), 0)._forward(ids, ids, ids, None, last_only=True)
    assert logits.tolist() == [[3.0, 4.0, 5.0]] and cache == "cache"
    with pytest.raises(TypeError, match="a bug inside the model"):
        HFRunner(Broken(), torch.device("cpu"), 0)._forward(ids, ids, ids, None, last_only=True)


def test_an_engine_failure_fails_the_request_instead_of_looping(tiny_model_dir):
    """A decode step that raises finishes its requests as "error", not "abort": clients resubmit aborted
    requests (a weight-update pause), so a failure that repeats looped (seen on CUDA: 1001 resubmissions
    before the client gave up). The SGLang-format parser and the OpenAI route fail at once with the cause."""
    import asyncio

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from areal_cli.errors import InferenceError
    from areal_cli.inference.backends.sglang import parse_generate
    from areal_cli.inference.server.engine import GenerationEngine, Sequence
    from areal_cli.inference.server.openai_compat import HTTPError, generate_resumable
    from areal_cli.inference.server.sampling import SamplingParams

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    eng = GenerationEngine(model, AutoTokenizer.from_pretrained(tiny_model_dir), device="cpu", context_length=512)

    def broken(tokens):
        raise RuntimeError("Expected all tensors to be on the same device")

    eng.runner.decode = broken
    done = threading.Semaphore(0)
    seq = Sequence(rid="0", prompt_ids=[5, 6, 7], on_done=lambda s: done.release(),
                   params=SamplingParams(max_new_tokens=8, ignore_eos=True))
    eng.start()
    try:
        eng.submit(seq)
        assert done.acquire(timeout=60)
        assert eng._thread.is_alive()  # the engine keeps serving
    finally:
        eng.shutdown()
    assert seq.finish["type"] == "error" and "same device" in seq.finish["message"], seq.finish
    with pytest.raises(InferenceError, match="server failed the request: engine error: RuntimeError"):
        parse_generate({"output_ids": seq.out_ids, "meta_info": {"finish_reason": seq.finish,
                                                                  "output_token_logprobs": []}})

    async def run(*_a, **_k):
        return seq

    with pytest.raises(HTTPError) as e:
        asyncio.run(generate_resumable(run, [5, 6, 7], seq.params, None))
    assert e.value.status == 500 and "same device" in str(e.value)
