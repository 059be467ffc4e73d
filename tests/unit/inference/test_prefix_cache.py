"""The hf server's prefix cache: a multi-turn conversation and a shared system prompt reuse cached KV,
with the same tokens and logprobs as prefilling everything; weight updates drop it."""

from __future__ import annotations

import random

import pytest
import torch

from areal_cli.inference.server import decode_kernel
from areal_cli.inference.server.prefix_cache import PrefixCache


def test_prefix_cache_lookup_lru_and_adapters():
    pc = PrefixCache(budget_tokens=100, block=4)
    kv = lambda n: torch.arange(n, dtype=torch.float32)
    a = tuple(range(10))
    assert pc.insert(None, a, kv)
    assert pc.lookup(None, list(range(10)) + [99], limit=10)[1] == 10
    assert pc.lookup(None, [0, 1, 2, 3, 4, 5, 7], limit=6)[1] == 6  # extended token by token past block 1
    assert pc.lookup(None, [0, 1, 2, 9, 4], limit=4) == (None, 0)  # no full block matches
    assert pc.lookup("lora-a", list(a), limit=10) == (None, 0)  # other adapter, other KV
    assert not pc.insert(None, a[:8], kv)  # covered by a longer entry
    assert pc.insert(None, a + (10, 11), kv) and len(pc) == 1 and pc.tokens == 12  # the next turn replaces it
    for i in range(4):  # 4 x 30 tokens over a budget of 100: the least recently used go first
        assert pc.insert(None, tuple(1000 * (i + 1) + j for j in range(30)), kv)
    assert pc.tokens <= 100 and pc.lookup(None, list(a), limit=12) == (None, 0)
    assert pc.lookup(None, [4000 + j for j in range(30)], limit=30)[1] == 30


def _kernel_or_skip(attention: str) -> None:
    if attention == "kernel":
        reason = decode_kernel.usable(torch.float32, torch.device("cpu"), check_threads=False)
        if reason is not None:
            pytest.skip(f"fused decode kernel unavailable: {reason}")


def _engine(model_dir: str, attention: str, cache_tokens: int):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from areal_cli.inference.server.attention import use_areal_sdpa
    from areal_cli.inference.server.engine import GenerationEngine

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    use_areal_sdpa(model)
    return GenerationEngine(model, AutoTokenizer.from_pretrained(model_dir), device="cpu", context_length=512,
                            fast_path=True, decode_attention=attention, prefix_cache_tokens=cache_tokens)


def _generate(eng, prompts: list[list[int]], greedy: list[bool]) -> list:
    """Run the engine loop by hand until every prompt finished (no thread: a fixed schedule)."""
    from areal_cli.inference.server.engine import Sequence
    from areal_cli.inference.server.sampling import SamplingParams

    done: list = []
    for i, (p, g) in enumerate(zip(prompts, greedy)):
        eng.submit(Sequence(rid=str(i), prompt_ids=list(p), on_done=done.append,
                            params=SamplingParams(max_new_tokens=6, temperature=0.0 if g else 1.0,
                                                  ignore_eos=True, sampling_seed=None if g else 7 + i)))
    with torch.no_grad():
        while len(done) < len(prompts):
            eng._admit()
            if eng._running:
                eng._decode_step()
    return sorted(done, key=lambda s: int(s.rid))


def _episode(eng, long_prompts: bool):
    """Two sessions sharing a system prompt, three turns each (turn k+1 = turn k's prompt + its output +
    a new user message); session 0 greedy, session 1 sampled. Returns the sequences of every turn."""
    rng = random.Random(3)
    system = [rng.randrange(5, 60) for _ in range(40 if not long_prompts else 70)]
    ctx = [system + [rng.randrange(5, 60) for _ in range(8)] for _ in range(2)]
    turns = []
    for _ in range(3):
        seqs = _generate(eng, ctx, greedy=[True, False])
        turns.append(seqs)
        ctx = [c + s.out_ids + [rng.randrange(5, 60) for _ in range(5)] for c, s in zip(ctx, seqs)]
    return turns, len(system)


# "kernel-torch-prefill" runs the torch-ops suffix prefill (the path without the C kernels too).
@pytest.mark.parametrize("attention,long_prompts", [("kernel", False), ("kernel", True)],
                         ids=["kernel", "kernel-torch-prefill"])
def test_prefix_cache_same_tokens_and_logprobs_fewer_prefilled(tiny_model_dir, attention, long_prompts):
    _kernel_or_skip(attention)
    on, off = _engine(tiny_model_dir, attention, 4096), _engine(tiny_model_dir, attention, 0)
    assert on.prefix_cache is not None and off.prefix_cache is None
    if long_prompts:  # suffixes prefilled with torch ops over the kernel's slabs (prompts past the limit)
        for e in (on, off):
            e.runner.KERNEL_PREFILL_MAX_LEN = 0
    got, n_sys = _episode(on, long_prompts)
    ref, _ = _episode(off, long_prompts)
    for t_on, t_off in zip(got, ref):
        for a, b in zip(t_on, t_off):
            assert a.out_ids == b.out_ids
            assert max(abs(x - y) for x, y in zip(a.out_logprobs, b.out_logprobs)) < 1e-4
    # Turn 1: session 1 arrives with session 0 and shares its system prompt: it is admitted one step
    # later and copies that from the cache. Later turns reuse everything the previous turn fed through
    # the model: its prompt and all its output but the last token.
    assert [s.cached_tokens for s in got[0]] == [0, n_sys]
    for k in (1, 2):
        assert [s.cached_tokens for s in got[k]] == [len(s.prompt_ids) + len(s.out_ids) - 1 for s in got[k - 1]]
    st_on, st_off = on.cache_stats(), off.cache_stats()
    total = sum(len(s.prompt_ids) for t in ref for s in t)
    assert st_off["prefill_tokens"] == total and st_off["cached_prefill_tokens"] == 0
    assert st_on["prefill_tokens"] + st_on["cached_prefill_tokens"] == total
    assert st_on["prefill_tokens"] < total / 2 and st_on["prefix_cache_entries"] == 2

    # A third session with the same system prompt reuses it; a command (here a no-op, as a weight
    # update would run) drops the cache, and nothing admitted before it is stored afterwards.
    third = _generate(on, [got[0][0].prompt_ids[:n_sys] + [3, 4, 5]], greedy=[True])[0]
    assert third.cached_tokens == n_sys and on.prefix_cache.followers([(None, [1] * 40), (None, [1] * 39)]) == [
        False, True]
    import concurrent.futures

    on._run_commands([(lambda: None, concurrent.futures.Future())])
    assert on.cache_stats()["prefix_cache_tokens"] == 0
    again = _generate(on, [got[0][0].prompt_ids[:n_sys] + [3, 4, 5]], greedy=[True])[0]
    assert again.cached_tokens == 0 and again.out_ids == third.out_ids
