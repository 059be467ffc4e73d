"""Multi-turn RLVR: on a wrong answer, append a feedback user turn and let the model retry."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from areal_cli.api.io_struct import GenerationConfig, ModelRequest
from areal_cli.api.workflow_api import RolloutWorkflow, Trajectory
from areal_cli.errors import ConfigError
from areal_cli.rewards.outcome import correctness
from areal_cli.models.vl_inputs import (
    check_served_prompt,
    image_pad_id,
    item_prompt_images,
    merge_multi_modal,
    prompt_images,
)
from areal_cli.rollout.workflows.common import (
    check_group_and_reward,
    Prompt,
    RewardFn,
    Segment,
    build_prompt,
    build_row,
    call_reward,
    decode,
    encode,
    load_tokenizer,
    next_group_id,
    pad_token_id,
    render_chat,
    stack_rows,
    with_eos_stop,
)

if TYPE_CHECKING:  # pragma: no cover
    from areal_cli.api.inference_api import InferenceEngine


@dataclass
class _Dialogue:
    segments: list[Segment]
    reward: float = 0.0
    raw_reward: float = 0.0
    correct: bool | None = None  # the last attempt's, as the reward function stated it
    turns: int = 0
    no_eos: bool = False
    n_resumes: int = 0
    completions: list[str] = field(default_factory=list)
    images: list[Any] = field(default_factory=list)  # every image of the sequence so far, in order
    features: list[dict[str, Any]] = field(default_factory=list)  # their multi_modal parts


class MultiTurnWorkflow(RolloutWorkflow):
    """Up to ``max_turns`` attempts per sample; after a wrong attempt the chat gets
    ``{"role": "user", "content": feedback}`` and the model answers again in the same sequence.

    An attempt is correct when the reward function says so (:class:`~areal_cli.rewards.outcome.Reward`,
    as every built-in reward returns); for a function that returns a plain number, when its reward is
    ``>= success_threshold``. The sample's reward is the last
    attempt's reward times ``turn_discount ** (turns - 1)``. ``loss_mask`` is True only on tokens the model
    generated; feedback and chat-template tokens are context (version -1, logprob 0). Data items are the
    same as for :class:`~areal_cli.rollout.workflows.rlvr.RLVRWorkflow`; ``group_size`` dialogues run
    concurrently per prompt. Extra per-row tensor: ``n_turns`` [G].

    Images: an item with images is sent with them (:mod:`areal_cli.models.vl_inputs`), and ``image_feedback``
    (a callable or an import path, ``(data, turn, completion) -> image | None``; e.g.
    ``areal_cli.rollout.workflows.vision_env:frame_shapes``) gives the feedback turn a new image after a wrong
    attempt: the feedback message becomes an image part and the feedback text, the image goes with every later
    request, and the row's ``multi_modal`` holds all the sequence's images in order (rows of one group may hold
    different numbers). Needs a chat (``messages``) prompt.
    """

    def __init__(self, reward_fn: RewardFn, gconfig: GenerationConfig, tokenizer: Any, group_size: int = 1,
                 *, max_turns: int = 2, turn_discount: float = 0.9,
                 feedback: str = "Your answer is wrong. Try again.", success_threshold: float = 1.0,
                 max_context_len: int | None = None, use_chat_template: bool = True,
                 image_feedback: Any = None, processor: Any = None):
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
            raise ConfigError("workflow.max_turns", f"must be an integer >= 1, got {max_turns!r}",
                              "set workflow.max_turns=2")
        if not 0.0 < float(turn_discount) <= 1.0:
            raise ConfigError("workflow.turn_discount", f"must be in (0, 1], got {turn_discount!r}",
                              "set workflow.turn_discount=0.9")
        check_group_and_reward(group_size, reward_fn)
        self.reward_fn = reward_fn
        self.tokenizer = load_tokenizer(tokenizer)
        self.gconfig = with_eos_stop(gconfig, self.tokenizer)
        self.group_size = group_size
        self.max_turns = max_turns
        self.turn_discount = float(turn_discount)
        self.feedback = feedback
        self.success_threshold = float(success_threshold)
        self.max_context_len = max_context_len
        self.use_chat_template = use_chat_template
        self.pad_id = pad_token_id(self.tokenizer)
        self.processor = processor
        if isinstance(image_feedback, str):
            from areal_cli.rollout.workflows import import_object

            image_feedback = import_object(image_feedback, "workflow.kwargs.image_feedback")
        if image_feedback is not None and not callable(image_feedback):
            raise ConfigError("workflow.kwargs.image_feedback", f"must be a function, got {image_feedback!r}",
                              "set it to areal_cli.rollout.workflows.vision_env:frame_shapes or module:function")
        self.image_feedback = image_feedback

    async def arun_episode(self, engine: "InferenceEngine", data: dict[str, Any]) -> Trajectory | None:
        import torch

        prompt = build_prompt(self.tokenizer, data, self.use_chat_template)
        answer = data.get("answer")
        key = f"group-{uuid.uuid4().hex}"  # the group's members share one server's prefix cache
        try:
            dialogues = await asyncio.gather(*[self._dialogue(engine, prompt, answer, key, data)
                                               for _ in range(self.group_size)])
        finally:
            end = getattr(engine, "end_session", None)
            if end is not None:
                end(key)
        rows = [build_row(d.segments) for d in dialogues]
        extra = {"n_turns": torch.tensor([d.turns for d in dialogues], dtype=torch.long)}
        meta = {"id": data.get("id"), "prompt_len": len(dialogues[0].segments[0].ids),  # image pads expanded
                "n_resumes": sum(d.n_resumes for d in dialogues),
                "raw_rewards": [d.raw_reward for d in dialogues]}
        traj = stack_rows(rows, [d.reward for d in dialogues], [d.no_eos for d in dialogues],
                          next_group_id(), self.pad_id, meta, extra, correct=[d.correct for d in dialogues])
        if any(d.images for d in dialogues):  # each row carries its own sequence's images
            traj.data["multi_modal"] = [merge_multi_modal(d.features) if d.features else None for d in dialogues]
        return traj

    async def _dialogue(self, engine: "InferenceEngine", prompt: Prompt, answer: Any,
                        key: str | None = None, data: dict[str, Any] | None = None) -> _Dialogue:
        d = _Dialogue(segments=[])
        context = list(prompt.ids)
        vis = item_prompt_images(self.tokenizer, data or {}, context, self.processor)
        if vis is not None:
            context = vis.ids
            d.images, d.features = list(vis.image_data), [vis.multi_modal]
        d.segments.append(Segment(list(context)))
        messages = list(prompt.messages) if prompt.messages is not None else None
        for turn in range(self.max_turns):
            pad = image_pad_id(self.tokenizer) if d.images else None
            resp = await engine.agenerate(ModelRequest(input_ids=list(context), gconfig=self.gconfig,
                                                       session_id=key, image_data=list(d.images) or None,
                                                       image_pad_id=pad))
            if d.images and turn == 0:  # the prompt as the server expanded it: the row's multi_modal is for it
                check_served_prompt(context, resp.input_tokens)
            out = list(resp.output_tokens)
            d.segments.append(Segment(out, list(resp.output_logprobs), list(resp.output_versions),
                                      resp.sampling_cutoffs, resp.routed_experts))
            context.extend(out)
            d.turns, d.no_eos = turn + 1, resp.stop_reason == "length"
            d.n_resumes += resp.n_resumes
            completion = decode(self.tokenizer, out)
            d.completions.append(completion)
            d.raw_reward = await call_reward(self.reward_fn, prompt.text, completion, answer)
            d.correct = correctness(d.raw_reward)
            solved = d.correct if d.correct is not None else d.raw_reward >= self.success_threshold
            if solved or turn + 1 == self.max_turns:
                break
            content, image = self._feedback_content(data, turn, completion, messages)
            tail = self._feedback_ids(messages, out, completion, content)
            if image is not None:  # the new image's pads, expanded as the processor does
                feedback = prompt_images(self.tokenizer, tail, [image], self.processor)
                tail = feedback.ids
            if self.max_context_len is not None and \
                    len(context) + len(tail) + self.gconfig.max_new_tokens > self.max_context_len:
                break
            if image is not None:
                d.images.extend(feedback.image_data)
                d.features.append(feedback.multi_modal)
            d.segments.append(Segment(tail))
            context.extend(tail)
            if messages is not None:
                messages += [{"role": "assistant", "content": completion}, {"role": "user", "content": content}]
        d.reward = d.raw_reward * self.turn_discount ** (d.turns - 1)
        return d

    def _feedback_content(self, data: dict[str, Any] | None, turn: int, completion: str,
                          messages: list[dict[str, Any]] | None) -> tuple[Any, Any]:
        """The feedback message's content and its new image (None: the text feedback alone)."""
        image = None
        if self.image_feedback is not None and messages is not None:
            image = self.image_feedback(data or {}, turn, completion)
        if image is None:
            return self.feedback, None
        return [{"type": "image"}, {"type": "text", "text": self.feedback}], image

    def _feedback_ids(self, messages: list[dict[str, Any]] | None, out: list[int],
                      completion: str, content: Any = None) -> list[int]:
        """Tokens between the generated answer and the next generation: the end of the assistant turn as
        the chat template renders it, the feedback user turn and the generation prompt. The generated
        tokens themselves are never re-tokenized."""
        tok = self.tokenizer
        generated_text = decode(tok, out, skip_special_tokens=False)
        if messages is not None:
            before = render_chat(tok, messages, add_generation_prompt=True) + generated_text
            after = render_chat(tok, messages + [{"role": "assistant", "content": completion},
                                                 {"role": "user", "content": content or self.feedback}],
                                add_generation_prompt=True)
            if after.startswith(before):
                return encode(tok, after[len(before):])
        # Template without a clean prefix (or raw-id prompts): close the turn explicitly, then open a
        # fresh user turn rendered on its own.
        eos = getattr(tok, "eos_token_id", None)
        close = [int(eos)] if eos is not None and (not out or out[-1] != eos) else []
        sep = encode(tok, "\n")
        user = render_chat(tok, [{"role": "user", "content": content or self.feedback}], add_generation_prompt=True)
        return close + sep + encode(tok, user)
