"""RLVR: ``group_size`` samples per prompt, each scored by a verifiable reward."""

from __future__ import annotations

import asyncio
import uuid
from typing import TYPE_CHECKING, Any

from areal_cli.api.io_struct import GenerationConfig, ModelRequest
from areal_cli.api.workflow_api import RolloutWorkflow, Trajectory
from areal_cli.rewards.outcome import is_dropped
from areal_cli.models.vl_inputs import check_served_prompt, item_prompt_images
from areal_cli.rollout.workflows.common import (
    check_group_and_reward,
    RewardFn,
    Segment,
    build_prompt,
    build_row,
    call_reward,
    call_rewards,
    decode,
    load_tokenizer,
    next_group_id,
    pad_token_id,
    stack_rows,
    with_eos_stop,
)

if TYPE_CHECKING:  # pragma: no cover
    from areal_cli.api.inference_api import InferenceEngine


class RLVRWorkflow(RolloutWorkflow):
    """One prompt → ``group_size`` completions generated concurrently → one scored group.

    Data item: ``{"prompt_ids" | "messages" | "prompt": ..., "answer": ..., ...}`` (docs/rollout.md).
    ``reward_fn(prompt, completion, answer) -> float`` may be async (e.g.
    ``areal_cli.rewards.AsyncRewardRunner``) or sync (run in a thread); ``prompt`` is the user text and
    ``completion`` the decoded completion without special tokens.

    The returned group has ``group_size`` rows: ``input_ids``, ``attention_mask``, ``loss_mask`` (True on
    generated tokens), ``logprobs`` and ``versions`` (per token, as produced by the server; 0 / -1 on the
    prompt), ``rewards`` [G], ``seq_no_eos_mask`` [G] (True when generation hit the length limit) and
    ``group_id`` [G]. An item with images (``"images"``/``"image"``: :mod:`areal_cli.models.vl_inputs`) is sent with
    its image pads expanded and its images as ``image_data``; its rows hold the prompt the server reports it
    generated on and carry ``multi_modal`` (a list of G ``{"pixel_values", "image_grid_thw"}``).

    A reward that drops a sample (:class:`~areal_cli.rewards.outcome.Dropped`: the LLM judge's
    ``on_failure=drop``) drops the whole group (``None``: the executor counts it rejected and admits
    another prompt) — a group with a member missing would skew its baseline.
    """

    def __init__(self, reward_fn: RewardFn, gconfig: GenerationConfig, tokenizer: Any, group_size: int = 1,
                 *, use_chat_template: bool = True, processor: Any = None):
        check_group_and_reward(group_size, reward_fn)
        self.reward_fn = reward_fn
        self.tokenizer = load_tokenizer(tokenizer)
        self.gconfig = with_eos_stop(gconfig, self.tokenizer)
        self.group_size = group_size
        self.use_chat_template = use_chat_template
        self.pad_id = pad_token_id(self.tokenizer)
        self.processor = processor  # the image processor (None: the model dir's, when an item has images)

    async def arun_episode(self, engine: "InferenceEngine", data: dict[str, Any]) -> Trajectory | None:
        prompt = build_prompt(self.tokenizer, data, self.use_chat_template)
        answer = data.get("answer")
        # An item with images: the prompt goes out with its pads expanded and its images (models/vl_inputs.py)
        vis = item_prompt_images(self.tokenizer, data, prompt.ids, self.processor)
        ids, image_data = (vis.ids, vis.image_data) if vis is not None else (list(prompt.ids), None)
        pad = vis.pad_id if vis is not None else None

        async def score(resp: Any) -> float:
            return await call_reward(self.reward_fn, prompt.text, decode(self.tokenizer, resp.output_tokens), answer)

        key = f"group-{uuid.uuid4().hex}"  # the group's members go to one server (its prefix cache)

        async def sample() -> tuple[Any, float]:
            # Each sample is scored as soon as it finishes, overlapping rewards with generation.
            resp = await engine.agenerate(ModelRequest(input_ids=list(ids), gconfig=self.gconfig,
                                                       session_id=key, image_data=image_data, image_pad_id=pad))
            return resp, await score(resp)

        group = getattr(engine, "agenerate_group", None)
        if group is not None and getattr(engine, "supports_batch_generate", False) and self.group_size > 1:
            # One batched call for the whole group: the server prefills the shared prompt once and
            # the trainer-side client handles one HTTP exchange instead of group_size.
            resps = await group([ModelRequest(input_ids=list(ids), gconfig=self.gconfig, session_id=key,
                                              image_data=image_data, image_pad_id=pad)
                                 for _ in range(self.group_size)])
            rewards = await call_rewards(self.reward_fn, prompt.text,
                                         [decode(self.tokenizer, r.output_tokens) for r in resps], answer)
        else:
            scored = await asyncio.gather(*[sample() for _ in range(self.group_size)])
            resps = [r for r, _ in scored]
            rewards = [x for _, x in scored]
        end = getattr(engine, "end_session", None)
        if end is not None:
            end(key)
        if any(is_dropped(x) for x in rewards):
            return None
        # the prompt as the server expanded it (the same ids for an item without images)
        rows = [build_row([Segment(check_served_prompt(ids, r.input_tokens) if vis is not None else prompt.ids),
                           Segment(list(r.output_tokens), list(r.output_logprobs), list(r.output_versions),
                                   r.sampling_cutoffs, r.routed_experts)])
                for r in resps]
        meta = {"id": data.get("id"), "prompt_len": len(ids),
                "n_resumes": sum(r.n_resumes for r in resps)}
        traj = stack_rows(rows, list(rewards), [r.stop_reason == "length" for r in resps], next_group_id(),
                          self.pad_id, meta)
        if vis is not None:  # every member's row carries the prompt's images (api/engine_api.py multi_modal)
            traj.data["multi_modal"] = [vis.multi_modal] * len(rows)
        return traj
