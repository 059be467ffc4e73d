"""Rollouts with images (issue 39): the expanded prompt and multi_modal of a data item with an image (the tiny
Qwen2.5-VL's, and the tiny Qwen2-VL's, own processor as the reference), the RLVR and multi-turn workflows'
trajectories (a scripted fake engine that reports the prompt it was sent, as the hf server does), the image
feedback environment, the visual task's data items and its config checks."""

from __future__ import annotations

import asyncio
import io

import pytest
import torch

from areal_cli.api.io_struct import GenerationConfig
from areal_cli.api.workflow_api import Trajectory
from areal_cli.errors import DataError, InferenceError
from areal_cli.models import vl_inputs as I


@pytest.fixture(scope="module")
def tok(vl_tok):  # tests/conftest.py builds the tiny VLM (vl_dir) once
    return vl_tok


@pytest.fixture(scope="module")
def rows():
    from areal_cli.data import builtin_vision as bv

    return bv.generate_splits("count_shapes", 6, 2, seed=0)[0]


def _ids(tok, messages):
    return tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)


@pytest.fixture(scope="module", params=["tiny_vl", "tiny_qwen2_vl"])
def any_vl_dir(tmp_path_factory, request) -> str:
    from areal_cli.data.builtin_model import ensure_builtin_model

    return str(ensure_builtin_model(tmp_path_factory.mktemp("fileroot"), request.param))


def test_prompt_images_equal_the_processor(any_vl_dir, rows):
    from PIL import Image
    from transformers import AutoTokenizer

    from areal_cli.models.tiny_vl import load_vl_processor

    proc = load_vl_processor(any_vl_dir)
    tok = AutoTokenizer.from_pretrained(any_vl_dir)
    row = rows[0]
    text = tok.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True)
    want = proc(text=[text], images=[[Image.open(io.BytesIO(row["image"]))]], return_tensors="pt")
    got = I.prompt_images(tok, _ids(tok, row["messages"]), [row["image"]])
    assert got.ids == want["input_ids"][0].tolist()
    assert got.ids.count(I.image_pad_id(tok)) == 16  # a 64x64 picture: 8 px patches merged 2x2
    assert torch.equal(got.multi_modal["pixel_values"], want["pixel_values"])
    assert torch.equal(got.multi_modal["image_grid_thw"], want["image_grid_thw"])
    assert got.image_data[0].startswith("data:image/png;base64,")
    assert I.to_pil(got.image_data[0]).tobytes() == Image.open(io.BytesIO(row["image"])).convert("RGB").tobytes()
    # an already expanded prompt (a resubmission) is kept; another run length or count is refused
    assert I.expand_pads(got.ids, I.image_pad_id(tok), [16]) == got.ids
    pad = I.image_pad_id(tok)
    with pytest.raises(DataError, match="run of 3 pads"):
        I.expand_pads([1, pad, pad, pad, 2], pad, [16])
    with pytest.raises(DataError, match="0 image placeholder"):
        I.expand_pads([1, 2], pad, [16])
    with pytest.raises(DataError, match="more image placeholders"):
        I.expand_pads([pad, 1, pad], pad, [16])


class _Served:
    """A fake server that records what it was sent and reports the prompt back as the hf server does."""

    def __init__(self, fake_engine, scripted, served=None):
        self.eng = fake_engine(token_delay=0)
        self.eng.scripted = list(scripted)
        self.sent: list = []
        self.served = served

    async def agenerate(self, req):
        self.sent.append((list(req.input_ids), list(req.image_data or [])))
        resp = await self.eng.agenerate(req)
        if self.served is not None:
            resp.input_tokens = list(self.served)
        return resp


def test_rlvr_sends_images_and_rows_carry_multi_modal(fake_engine, tok, rows):
    from areal_cli.rollout.workflows.rlvr import RLVRWorkflow

    item = {**rows[0], "images": [rows[0]["image"]]}
    eos = tok.eos_token_id
    outs = [tok.encode(" 3", add_special_tokens=False) + [eos], tok.encode(" 2", add_special_tokens=False) + [eos]]
    srv = _Served(fake_engine, outs)
    wf = RLVRWorkflow(lambda p, c, a: 1.0 if c.strip() == a else 0.0, GenerationConfig(max_new_tokens=4), tok,
                      group_size=2)
    traj = asyncio.run(wf.arun_episode(srv, item))
    want = I.prompt_images(tok, _ids(tok, item["messages"]), [item["image"]])
    assert [s[1] for s in srv.sent] == [want.image_data] * 2 and all(s[0] == want.ids for s in srv.sent)
    P = len(want.ids)
    d = traj.data
    assert len(d["multi_modal"]) == 2 and traj.meta["prompt_len"] == P
    for r, o in enumerate(outs):
        assert d["input_ids"][r, :P].tolist() == want.ids
        assert d["input_ids"][r, P:P + len(o)].tolist() == o
        assert d["loss_mask"][r].tolist()[:P + len(o)] == [False] * P + [True] * len(o)
        assert torch.equal(d["multi_modal"][r]["pixel_values"], want.multi_modal["pixel_values"])
        assert d["multi_modal"][r]["image_grid_thw"].tolist() == [[1, 8, 8]]
    # a server that expanded the prompt differently cannot be trained on with these pixels
    bad = _Served(fake_engine, outs, served=want.ids[:-1])
    with pytest.raises(InferenceError, match="expanded the image prompt"):
        asyncio.run(wf.arun_episode(bad, item))


def test_concat_keeps_multi_modal_with_its_rows():
    def traj(n, mm):
        data = {"input_ids": torch.ones(n, 3, dtype=torch.long), "rewards": torch.zeros(n)}
        if mm is not None:
            data["multi_modal"] = mm
        return Trajectory(data)

    a, b = {"pixel_values": torch.zeros(1)}, {"pixel_values": torch.ones(1)}
    out = Trajectory.concat([traj(2, None), traj(2, [a, b]), traj(1, None)])
    assert out.data["multi_modal"] == [None, None, a, b, None]
    assert Trajectory.concat([traj(1, [a]), traj(1, None)]).data["multi_modal"] == [a, None]
    assert "multi_modal" not in Trajectory.concat([traj(1, None), traj(1, None)]).data


def test_frame_shapes_frames_the_cells_to_count(rows):
    from PIL import Image

    from areal_cli.data import builtin_vision as bv
    from areal_cli.rollout.workflows.vision_env import CELL, frame_shapes, shape_cells

    for seed in range(20):
        import random

        pic = bv.draw_picture(random.Random(seed), bv.VISION_TASKS["count_shapes"])
        png = bv.render(pic)
        assert shape_cells(png) == [c for c, *_ in pic.items]
        for colour in bv.COLOURS:
            assert shape_cells(png, colour) == [c for c, col, *_ in pic.items if col == colour]
    row = rows[0]
    hint = frame_shapes(row, 0, "7")
    assert hint == frame_shapes(row, 0, "7")  # deterministic
    img = Image.open(io.BytesIO(hint)).convert("RGB")
    cells = shape_cells(row["image"], row["colour"])
    for c in range(16):
        corner = img.getpixel(((c % 4) * CELL, (c // 4) * CELL))
        assert (corner == (0, 0, 0)) == (c in cells)
    assert frame_shapes({"question": "no picture"}, 0, "") is None


def test_multi_turn_feeds_a_new_image_after_a_wrong_answer(fake_engine, tok, rows):
    from areal_cli.rollout.workflows.multi_turn import MultiTurnWorkflow
    from areal_cli.rollout.workflows.vision_env import frame_shapes

    row = next(r for r in rows if r["ground_truth"] != "9")
    item = {**row, "images": [row["image"]], "answer": row["ground_truth"]}
    eos = tok.encode(" 9", add_special_tokens=False) + [tok.eos_token_id]
    right = tok.encode(" " + row["ground_truth"], add_special_tokens=False) + [tok.eos_token_id]
    srv = _Served(fake_engine, [eos, right])
    wf = MultiTurnWorkflow(lambda p, c, a: 1.0 if c.strip() == a else 0.0, GenerationConfig(max_new_tokens=4), tok,
                           group_size=1, max_turns=3, feedback="Wrong. Count the framed shapes.",
                           image_feedback="areal_cli.rollout.workflows.vision_env:frame_shapes")
    traj = asyncio.run(wf.arun_episode(srv, item))
    pad = I.image_pad_id(tok)
    (ids1, imgs1), (ids2, imgs2) = srv.sent
    assert len(imgs1) == 1 and len(imgs2) == 2 and imgs2[0] == imgs1[0]
    assert imgs2[1] == I.to_data_url(frame_shapes(item, 0, " 9"))
    assert ids2[:len(ids1)] == ids1 and ids1.count(pad) == 16 and ids2.count(pad) == 32
    d = traj.data
    assert d["n_turns"].tolist() == [2] and d["rewards"].tolist() == [pytest.approx(0.9)]
    mm = d["multi_modal"][0]
    assert mm["image_grid_thw"].tolist() == [[1, 8, 8], [1, 8, 8]] and mm["pixel_values"].shape[0] == 128
    n = int(d["attention_mask"][0].sum())
    row_ids, mask = d["input_ids"][0, :n].tolist(), d["loss_mask"][0, :n].tolist()
    assert row_ids == ids2 + right
    trained = [t for t, m in zip(row_ids, mask) if m]
    assert trained == eos + right and not any(m for t, m in zip(row_ids, mask) if t == pad)


def test_visual_task_items_and_checks(tok):
    from areal_cli.config.dataset import DatasetConfig
    from areal_cli.data.datasets import load_split

    cfg = DatasetConfig(train_path="builtin:count_shapes", train_size=8, test_size=4, max_prompt_len=64)
    items, report = load_split(cfg, tok, "train")
    assert report.kept == 8 and all(len(it["images"]) == 1 and "prompt_ids" not in it for it in items)
    text = len(_ids(tok, items[0]["messages"]))
    assert items[0]["prompt_len"] == text - 1 + 16  # the image's 16 tokens replace its one placeholder
    short = DatasetConfig(train_path="builtin:count_shapes", train_size=8, test_size=4, max_prompt_len=text)
    with pytest.raises(DataError, match="no usable rows"):
        load_split(short, tok, "train")
    for knob in ({"max_image_tokens": 15}, {"max_image_pixels": 64 * 64 - 1}):  # one image: 16 tokens, 64x64
        with pytest.raises(DataError, match="no usable rows.*dataset.max_image"):
            load_split(DatasetConfig(train_path="builtin:count_shapes", train_size=8, test_size=4, **knob), tok)
    assert load_split(DatasetConfig(train_path="builtin:count_shapes", train_size=8, test_size=4,
                                    max_image_tokens=16, max_image_pixels=64 * 64), tok)[1].kept == 8


@pytest.mark.parametrize("overrides, path, words", [
    (["dataset.train_path=builtin:count_shapes"], "dataset.train_path", "no vision tower"),
    (["model=tiny_vl", "dataset.train_path=builtin:count_shapes", "workflow=online",
      "rollout.group_size=1"], "workflow.name",
     "does not send"),
    (["experiment=vision_default", "dataset.max_image_tokens=100"], "dataset.max_image_tokens", "do not fit"),
])
def test_validate_refuses_visual_nonsense(overrides, path, words):
    from areal_cli.errors import ConfigError
    from areal_cli.plan.compose import load_config
    from areal_cli.plan.validate import validate

    with pytest.raises(ConfigError) as e:
        validate(load_config(overrides))
    assert str(e.value).startswith(path) and words in str(e.value) and "\n" not in str(e.value)


def test_areal_train_plans_a_vision_model_on_every_built_in_server(monkeypatch):
    """hf, sglang and vllm carry images (a server without them, a plugin's: test_backend_plugins.py)."""
    from areal_cli.cli import launch
    from areal_cli.cli.common import compose_and_validate

    monkeypatch.setattr(launch, "fetch_hub_model", lambda cfg: False)
    cfg, plan = compose_and_validate(["model=qwen2_5_vl_3b", "cluster=gpu_1x8", "allocation_mode=vllm:d4+fsdp:d4"],
                                     fetch_model=True)
    assert plan.inferences[0].backend == "vllm"
    cfg, plan = compose_and_validate(["model=qwen2_5_vl_3b", "cluster=gpu_1x8", "allocation_mode=gpu8_sglang_fsdp"],
                                     fetch_model=True)
    assert plan.inferences[0].backend == "sglang"
    cfg, plan = compose_and_validate(["experiment=vision_default"], fetch_model=True)
    assert cfg.dataset.train_path.startswith("builtin:") and plan.inferences[0].backend == "hf"


def test_server_never_samples_vision_tokens(any_vl_dir):
    from transformers import AutoConfig, AutoTokenizer

    from areal_cli.inference.server.vision import vision_token_ids

    from areal_cli.inference.server.sampling import SamplingParams, sample_next

    tok = AutoTokenizer.from_pretrained(any_vl_dir)
    banned = vision_token_ids(AutoConfig.from_pretrained(any_vl_dir))
    assert banned.tolist() == I.vision_token_ids(tok) and len(banned) == 5
    # logits that favour the vision tokens: never sampled (greedy or not), and the reported logprob is the
    # model's own (the full vocabulary's, what the trainer's forward computes)
    logits = torch.zeros(4, len(tok))
    logits[:, banned] = 8.0
    gen = torch.Generator().manual_seed(0)
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0), SamplingParams(temperature=0.7),
              SamplingParams(temperature=1.0, top_k=3)]
    for _ in range(20):
        ids, lps = sample_next(logits, params, [0] * 4, set(), gen, banned=banned)
        assert not set(ids.tolist()) & set(banned.tolist())
        temps = torch.tensor([1.0, 1.0, 0.7, 1.0]).unsqueeze(1)
        want = torch.log_softmax(logits / temps, dim=-1).gather(1, ids.unsqueeze(1)).squeeze(1)
        assert torch.allclose(lps, want)
    ids, _ = sample_next(logits, params, [0] * 4, set(), gen)  # without the ban they win
    assert set(ids.tolist()) <= set(banned.tolist())


def test_openai_client_takes_image_url_parts_and_rows_carry_them(fake_engine, tok, rows, tiny_model_dir):
    import openai
    from transformers import AutoTokenizer

    from areal_cli.rollout.interaction_cache import rows_to_tensors
    from areal_cli.rollout.openai_client import ArealOpenAI

    a, b = I.to_data_url(rows[0]["image"]), I.to_data_url(rows[1]["image"])
    srv = _Served(fake_engine, [tok.encode(" 3", add_special_tokens=False) + [tok.eos_token_id],
                                tok.encode(" 4", add_special_tokens=False) + [tok.eos_token_id]])
    client = ArealOpenAI(srv, tok)

    def user(url, text):
        return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                            {"type": "text", "text": text}]}

    async def episode():
        msgs = [user(a, "How many shapes?")]
        first = await client.chat.completions.create(messages=msgs, max_tokens=4)
        msgs += [{"role": "assistant", "content": first.choices[0].message.content}, user(b, "And here?")]
        return await client.chat.completions.create(messages=msgs, max_tokens=4)

    asyncio.run(episode())
    pad = I.image_pad_id(tok)
    (ids1, imgs1), (ids2, imgs2) = srv.sent
    assert imgs1 == [a] and imgs2 == [a, b]
    assert ids1.count(pad) == 16 and ids2.count(pad) == 32 and ids2[:len(ids1)] == ids1  # one token chain
    second = client.cache.last
    assert second.token_parent_id is not None and second.images == [a, b]
    [row] = client.export_interactions("per_leaf")
    traj = rows_to_tensors([row], pad_id=0, group_id=7, tokenizer=tok)
    mm = traj.data["multi_modal"][0]
    assert mm["image_grid_thw"].tolist() == [[1, 8, 8], [1, 8, 8]]
    want = I.prompt_images(tok, ids2, [a, b])
    assert torch.equal(mm["pixel_values"], want.multi_modal["pixel_values"])
    trained = traj.data["input_ids"][0][traj.data["loss_mask"][0]].tolist()
    three, four = (tok.encode(t, add_special_tokens=False) + [tok.eos_token_id] for t in (" 3", " 4"))
    assert trained == three + four  # only what the model generated
    # a text-only model's client refuses an image part as a server would (400)
    text_client = ArealOpenAI(srv, AutoTokenizer.from_pretrained(tiny_model_dir))
    with pytest.raises(openai.BadRequestError, match="text-only"):
        asyncio.run(text_client.chat.completions.create(messages=[user(a, "hi")], max_tokens=2))


def test_proxy_takes_image_url_parts_and_exports_rows_with_images(fake_engine, tok, rows):
    import httpx

    from areal_cli.rollout.interaction_cache import rows_to_tensors
    from areal_cli.rollout.proxy import AgentProxy, serve_proxy

    url = I.to_data_url(rows[0]["image"])
    srv = _Served(fake_engine, [tok.encode(" 5", add_special_tokens=False) + [tok.eos_token_id]])
    p = serve_proxy(AgentProxy(srv, tok, admin_key="admin"))
    try:
        base, admin = f"http://{p.address}", {"Authorization": "Bearer admin"}
        assert httpx.post(f"{base}/rl/grant_capacity", json={}, headers=admin).status_code == 200
        sess = httpx.post(f"{base}/rl/start_session", json={}, headers=admin).json()
        mine = {"Authorization": f"Bearer {sess['api_key']}"}
        msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "How many shapes?"}]}]
        r = httpx.post(f"{base}/v1/chat/completions", json={"model": "p", "messages": msgs, "max_tokens": 4},
                       headers=mine, timeout=60)
        assert r.status_code == 200, r.text
        assert httpx.post(f"{base}/rl/end_session", json={}, headers=mine).status_code == 200
        out = httpx.post(f"{base}/rl/export", json={"session_id": sess["session_id"]}, headers=admin).json()
    finally:
        p.stop()
    [(ids, imgs)] = srv.sent
    assert imgs == [url] and ids.count(I.image_pad_id(tok)) == 16
    [row] = out["rows"]
    assert row["images"] == [url]  # over JSON, as data URLs
    mm = rows_to_tensors(out["rows"], pad_id=0, group_id=1, tokenizer=tok).data["multi_modal"][0]
    assert mm["image_grid_thw"].tolist() == [[1, 8, 8]]
