"""The built-in agentic task: answer arithmetic word problems by calling a calculator tool.

:class:`CalculatorAgent` is ordinary ``openai.AsyncOpenAI`` agent code (no areal-cli API inside
``__call__``): it offers one tool, ``calculator(expression)``, executes the calls the model makes,
sends the results back and reads the final answer. An episode succeeds when the model called the
tool and its final answer is the right number; the reward is 1 then, else 0.

``experiment=agent_calculator`` trains it on the built-in ``arith`` task with the built-in tiny
model: a short SFT warm start on whole tool-use transcripts (:meth:`CalculatorAgent.sft_example`)
teaches the format, then GRPO through the agent workflow raises the tool-call rate and the accuracy
(``agent/tool_call_rate``, ``reward/accuracy``, ``eval/pass@1``).
"""

from __future__ import annotations

import json
import re
from typing import Any

from areal_cli.rewards.outcome import Reward

# Kept short: every prompt carries it, and with the tiny model's byte-level tokenizer a JSON schema
# costs a token per character or two. The call's arguments are {"expression": "a+b"}.
CALCULATOR = {"type": "function", "function": {"name": "calculator", "description": "expression: a+b or a-b"}}
_EXPR = re.compile(r"^\s*\d{1,6}\s*[-+*]\s*\d{1,6}\s*$")
_NUMBER = re.compile(r"-?\d+")


def calculate(expression: Any) -> str:
    """The tool: ``a op b`` with op in + - *; anything else is an error string (for the model)."""
    if not isinstance(expression, str) or not _EXPR.match(expression):
        return "error: give an expression like 3+4"
    a, op, b = re.split(r"\s*([-+*])\s*", expression.strip())
    x, y = int(a), int(b)
    return str(x + y if op == "+" else x - y if op == "-" else x * y)


def final_number(text: str | None) -> str | None:
    found = _NUMBER.findall(text or "")
    return found[-1] if found else None


def _messages(data: dict) -> list[dict]:
    return [{"role": "user", "content": data["question"]}]


class CalculatorAgent:
    """``async agent(client, data) -> Reward``; ``max_turns`` calls at most. ``max_tokens`` must hold a
    whole call: with the tiny model's byte-level tokenizer the ~80-character ``<tool_call>`` block is
    ~75 tokens, and a call cut at the limit is not a call."""

    def __init__(self, max_turns: int = 2, max_tokens: int = 100, temperature: float = 1.0):
        self.max_turns = max_turns
        self.max_tokens = max_tokens
        self.temperature = temperature

    async def __call__(self, client: Any, data: dict) -> Reward:
        msgs = _messages(data)
        used_tool = False
        for _ in range(self.max_turns):
            r = await client.chat.completions.create(model="policy", messages=msgs, tools=[CALCULATOR],
                                                     max_tokens=self.max_tokens, temperature=self.temperature)
            m = r.choices[0].message
            if not m.tool_calls:
                # a data item's "answer" is the reference number (data/datasets.py build_items)
                ok = used_tool and final_number(m.content) == str(data["answer"]).strip()
                return Reward(1.0 if ok else 0.0, ok)
            used_tool = True
            msgs.append(m.model_dump(exclude_none=True))
            for call in m.tool_calls:
                try:
                    expr = json.loads(call.function.arguments).get("expression")
                except (ValueError, AttributeError):
                    expr = None
                msgs.append({"role": "tool", "tool_call_id": call.id, "content": calculate(expr)})
        return Reward(0.0, False)  # never answered

    @staticmethod
    def sft_example(item: dict, tokenizer: Any) -> dict:
        """``item`` with ``prompt_ids`` (the question with the tool) and ``target`` (the rest of a
        correct transcript: the call, the tool's result, the answer) for the SFT warm start."""
        # the built-in task's worked solution: "17+25=42\n#### 42" -> "17+25"
        expr = str(item.get("solution") or item["answer"]).split("\n")[0].split("=")[0]
        result = calculate(expr)
        call = {"id": "call_0", "type": "function",
                "function": {"name": "calculator", "arguments": json.dumps({"expression": expr})}}
        msgs = _messages(item)
        full = msgs + [{"role": "assistant", "content": None, "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": "call_0", "content": result},
                       {"role": "assistant", "content": f"The answer is {result}."}]
        prompt = tokenizer.apply_chat_template(msgs, tools=[CALCULATOR], tokenize=False,
                                               add_generation_prompt=True)
        text = tokenizer.apply_chat_template(full, tools=[CALCULATOR], tokenize=False)
        eos = tokenizer.eos_token or ""
        target = text[len(prompt):].rstrip()
        if eos and target.endswith(eos):  # make_sft_batch appends the end-of-turn token itself
            target = target[:-len(eos)]
        ids = list(tokenizer.encode(prompt, add_special_tokens=False))
        return {**item, "prompt_ids": ids, "target": target}
