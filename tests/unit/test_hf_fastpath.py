"""The hf server's fast decode path against HF's own forward (fp32, within 1e-4)."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from areal_cli.inference.server import decode_kernel
from areal_cli.inference.server.fastpath import FastRunner, unsupported_reason


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


@pytest.mark.parametrize("attention", ["torch", "kernel", "torch-flash-prefill"])
@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama"])
def test_fast_runner_matches_hf_forward(kind, attention):
    model = _model(kind)
    assert unsupported_reason(model) is None
    if attention == "kernel":
        _kernel_or_skip()
    runner = FastRunner(model, torch.device("cpu"), attention=attention.split("-")[0])
    assert runner.attention == attention.split("-")[0]
    if attention == "torch-flash-prefill":  # prefill attention through SDPA's flash kernel (long prompts)
        runner.MATMUL_ATTENTION_MAX = 0
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
