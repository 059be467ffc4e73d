"""A rollout workflow of one's own: answer, then judge your own answer, in one trained sequence.

The model answers the question; the workflow then asks it "is your answer correct?" and the model
replies yes or no. Both replies are trained (``loss_mask`` on generated tokens only); the question
between them is context. The reward is the answer's correctness (``workflow.reward`` decides) plus
``verdict_bonus`` for a right verdict, minus it for a wrong or unreadable one, so the policy learns to
solve and to know when it has not. ``@register_workflow`` names it ``workflow.name=self_verify`` once
``plugins: [self_verify]`` imports this module.
"""

from __future__ import annotations

import asyncio
import re

from areal_cli.api.io_struct import ModelRequest
from areal_cli.api.workflow_api import RolloutWorkflow
from areal_cli.rewards.outcome import correctness
from areal_cli.rollout.workflows import register_workflow
from areal_cli.rollout.workflows.common import (
    Segment,
    build_prompt,
    build_row,
    call_reward,
    decode,
    encode,
    next_group_id,
    pad_token_id,
    render_chat,
    stack_rows,
    with_eos_stop,
)

CHECK = "Is your answer correct? Reply with one word: yes or no."
_VERDICT = re.compile(r"^\W*(yes|no)\b", re.IGNORECASE)


@register_workflow("self_verify")
class SelfVerifyWorkflow(RolloutWorkflow):
    # The trainer passes the pieces a constructor names (workflow.reward as reward_fn, rollout.gconfig,
    # the tokenizer, rollout.group_size); the keyword-only ones come from workflow.kwargs.
    def __init__(self, reward_fn, gconfig, tokenizer, group_size: int = 1, *, verdict_bonus: float = 0.2,
                 verdict_tokens: int = 16):
        self.reward_fn, self.tok, self.group_size, self.bonus = reward_fn, tokenizer, group_size, verdict_bonus
        self.answer_cfg = with_eos_stop(gconfig, tokenizer)  # one sample per request, ends at end-of-turn
        self.verdict_cfg = self.answer_cfg.new(max_new_tokens=verdict_tokens)
        self.pad_id = pad_token_id(tokenizer)

    async def arun_episode(self, engine, data):
        prompt = build_prompt(self.tok, data)  # dataset items carry their chat as "messages"
        samples = await asyncio.gather(*[self._sample(engine, prompt, data.get("answer"))
                                         for _ in range(self.group_size)])
        rows, rewards, cut, correct = (list(x) for x in zip(*samples))
        # one group per item: GRPO compares the group_size samples of the same question
        return stack_rows(rows, rewards, cut, next_group_id(), self.pad_id, {"id": data.get("id")},
                          correct=correct)

    async def _sample(self, engine, prompt, reference):
        ans = await engine.agenerate(ModelRequest(list(prompt.ids), self.answer_cfg))
        text = decode(self.tok, ans.output_tokens)
        correct = bool(correctness(await call_reward(self.reward_fn, prompt.text, text, reference)))
        ask = self._check_turn(prompt.messages, ans.output_tokens, text)
        context = list(prompt.ids) + list(ans.output_tokens) + ask
        verdict = await engine.agenerate(ModelRequest(context, self.verdict_cfg))
        said = _VERDICT.match(decode(self.tok, verdict.output_tokens))
        right = said is not None and (said.group(1).lower() == "yes") == correct
        row = build_row([Segment(list(prompt.ids)),
                         Segment(ans.output_tokens, ans.output_logprobs, ans.output_versions),
                         Segment(ask),  # context: not trained, version -1
                         Segment(verdict.output_tokens, verdict.output_logprobs, verdict.output_versions)])
        reward = float(correct) + (self.bonus if right else -self.bonus)
        return row, reward, verdict.stop_reason == "length", correct

    def _check_turn(self, messages, answer_ids, answer_text):
        """The ids between the answer and the verdict (end of the answer's turn, the question, the next
        assistant header) as the chat template renders them. The answer keeps the ids the model
        generated: re-encoding its text could give other ids than the ones it was sampled as."""
        before = render_chat(self.tok, messages, True) + decode(self.tok, answer_ids, skip_special_tokens=False)
        full = render_chat(self.tok, messages + [{"role": "assistant", "content": answer_text},
                                                 {"role": "user", "content": CHECK}], True)
        if full.startswith(before):
            return encode(self.tok, full[len(before):])
        # the text does not round-trip (special tokens inside the answer): close the turn, ask afresh
        eos = self.tok.eos_token_id
        close = [] if answer_ids and answer_ids[-1] == eos else [eos]
        return close + encode(self.tok, render_chat(self.tok, [{"role": "user", "content": CHECK}], True))
