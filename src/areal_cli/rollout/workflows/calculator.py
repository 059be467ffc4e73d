"""The built-in agentic task: answer arithmetic word problems by calling a calculator tool.

:class:`CalculatorAgent` is ordinary ``openai.AsyncOpenAI`` agent code (no areal-cli API inside
``__call__``): it offers one tool, ``calculator(expression)``, executes the calls the model makes,
sends the results back and reads the final answer. An episode succeeds when the model called the
tool and its final answer is the right number; the reward is 1 then, else 0, or with
``operand_credit`` the shaped reward of :meth:`CalculatorAgent._partial`.

``experiment=agent_calculator`` trains :data:`shaped_agent` on the built-in ``arith_easy`` task with
the built-in tiny model. The SFT warm start (:meth:`CalculatorAgent.sft_example`) is deliberately weak
at tool use: it teaches the call format and the copying of the numbers, but its demonstrations call
the offered tool only a quarter of the time (they answer in their head otherwise), so the greedy
warm-started model never calls it (held-out success 0%). GRPO through the agent workflow then learns
to call it (``agent/tool_call_rate``, ``reward/accuracy``, ``eval/pass@1``, ``eval/tool_call_rate``).
This shows RL learning when to use a tool, not RL improving a competent tool user; docs/agents.md has
the measured figures.
"""

from __future__ import annotations

import json
import re
import zlib
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


def expression_of(arguments: Any) -> Any:
    """The ``expression`` argument of a call's JSON arguments (None when they are not a JSON object)."""
    try:
        return json.loads(arguments).get("expression") if isinstance(arguments, str) else arguments.get("expression")
    except (ValueError, AttributeError):
        return None


def final_number(text: str | None) -> str | None:
    found = _NUMBER.findall(text or "")
    return found[-1] if found else None


def _messages(data: dict) -> list[dict]:
    return [{"role": "user", "content": data["question"]}]


class CalculatorAgent:
    """``async agent(client, data) -> Reward``; ``max_turns`` calls at most. ``max_tokens`` must hold a
    whole call: with the tiny model's byte-level tokenizer the ~80-character ``<tool_call>`` block is
    ~75 tokens, and a call cut at the limit is not a call. ``sft_mix``: the warm start's weights of
    (plain, call, head) examples (:meth:`sft_example`)."""

    def __init__(self, max_turns: int = 2, max_tokens: int = 100, temperature: float = 1.0,
                 operand_credit: float = 0.0, sft_mix: tuple[int, int, int] = (1, 1, 0)):
        self.operand_credit = float(operand_credit)
        self.sft_mix = tuple(int(w) for w in sft_mix)
        self.max_turns = max_turns
        self.max_tokens = max_tokens
        self.temperature = temperature

    # the tool as the agent offers it, and as the warm start renders it (sft_example): an agent written
    # with a framework that sends another schema for the same tool overrides it (calculator_frameworks.py)
    tool: dict = CALCULATOR

    async def __call__(self, client: Any, data: dict) -> Reward:
        msgs = _messages(data)
        used_tool = False
        first_expr = None
        for _ in range(self.max_turns):
            r = await client.chat.completions.create(model="policy", messages=msgs, tools=[self.tool],
                                                     max_tokens=self.max_tokens, temperature=self.temperature)
            m = r.choices[0].message
            if not m.tool_calls:
                return self.outcome(used_tool, m.content, first_expr, data)
            used_tool = True
            msgs.append(m.model_dump(exclude_none=True))
            for call in m.tool_calls:
                expr = expression_of(call.function.arguments)
                first_expr = expr if first_expr is None else first_expr
                msgs.append({"role": "tool", "tool_call_id": call.id, "content": calculate(expr)})
        return self.outcome(used_tool, None, first_expr, data)  # never answered

    def outcome(self, used_tool: bool, answer: str | None, first_expr: Any, data: dict) -> Reward:
        """The episode's reward: success (1) when the tool was called and ``answer`` (the final reply's
        text; None: the episode never answered) ends in the right number, else :meth:`_partial`."""
        # a data item's "answer" is the reference number (data/datasets.py build_items)
        ok = used_tool and answer is not None and final_number(answer) == str(data["answer"]).strip()
        return Reward(1.0 if ok else self._partial(first_expr, data), ok)

    def _partial(self, expr: Any, data: dict) -> float:
        """A failed episode's shaped reward: ``operand_credit`` for each operand of the first call's
        expression that equals the reference solution's operand in the same place ("4+7": 4, 7), so
        a call with one right number scores above one with none. 0 (no shaping) by default; success
        (reward 1, ``eval/pass@1``) is unchanged by it."""
        if not self.operand_credit or not isinstance(expr, str) or not _EXPR.match(expr):
            return 0.0
        ref = str(data.get("solution") or "").split("\n")[0].split("=")[0]
        got, want = _NUMBER.findall(expr), _NUMBER.findall(ref)
        return self.operand_credit * sum(a == b for a, b in zip(got, want))

    def sft_example(self, item: dict, tokenizer: Any) -> dict:
        """``item`` with ``prompt_ids`` and ``target`` for the SFT warm start.

        Each item is one of three kinds, picked by a hash of the question with weights ``sft_mix``
        = (plain, call, head):
        - plain: the task without tools, the question then the worked solution ("4+7=11\n#### 11");
        - call: the whole tool-use transcript, the question with the tool, then the call, the tool's
          result and the answer;
        - head: the question with the tool offered, answered without calling it ("The sum is 11.": not
          "The answer is", which then follows only a tool's result, so the model learns to copy that
          result rather than to do the sum itself).
        The plain examples are ~50 tokens instead of ~250, and the tiny model learns to copy the
        question's numbers from them far sooner than from the long transcripts alone; the copying
        then carries over to the numbers it writes into the call (docs/agents.md)."""
        solution = str(item.get("solution") or item["answer"])
        plain, call, _head = self.sft_mix
        bucket = zlib.crc32(item["question"].encode()) % sum(self.sft_mix)
        msgs = _messages(item)
        tools = None if bucket < plain else [self.tool]
        prompt = tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
        ids = list(tokenizer.encode(prompt, add_special_tokens=False))
        if bucket < plain:
            return {**item, "prompt_ids": ids, "target": solution}
        # the built-in task's worked solution: "17+25=42\n#### 42" -> "17+25"
        expr = solution.split("\n")[0].split("=")[0]
        result = calculate(expr)
        if bucket >= plain + call:
            return {**item, "prompt_ids": ids, "target": f"The sum is {result}."}
        tool_call = {"id": "call_0", "type": "function",
                     "function": {"name": "calculator", "arguments": json.dumps({"expression": expr})}}
        full = msgs + [{"role": "assistant", "content": None, "tool_calls": [tool_call]},
                       {"role": "tool", "tool_call_id": "call_0", "content": result},
                       {"role": "assistant", "content": f"The answer is {result}."}]
        text = tokenizer.apply_chat_template(full, tools=[self.tool], tokenize=False)
        eos = tokenizer.eos_token or ""
        target = text[len(prompt):].rstrip()
        if eos and target.endswith(eos):  # make_sft_batch appends the end-of-turn token itself
            target = target[:-len(eos)]
        return {**item, "prompt_ids": ids, "target": target}


# experiment=agent_calculator's agent: success as above, failed episodes get 0.25 per right operand in
# their first call; warm start: 4/8 plain examples, 1/8 tool calls, 3/8 answers without the offered tool
# (workflow.kwargs.agent names an object; a class would be built without arguments)
shaped_agent = CalculatorAgent(operand_credit=0.25, sft_mix=(4, 1, 3))
