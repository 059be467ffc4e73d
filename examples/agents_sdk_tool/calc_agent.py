"""A GSM8K solver with a calculator tool, written for the OpenAI Agents SDK and trained as it is.

Nothing below is areal-specific except the signature: the agent workflow (``workflow.name=agent``,
``workflow.kwargs.agent=calc_agent:solve``) calls ``await solve(client, data)`` once per episode, with
``client`` an ``openai.AsyncOpenAI`` that generates with the policy being trained and records every
call's tokens, and ``data`` a dataset item (``data["question"]``, ``data["answer"]``: the reference
number). The number it returns is the episode's reward.
"""

from __future__ import annotations

import ast
import operator
import re

from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from agents.exceptions import MaxTurnsExceeded, ModelBehaviorError

set_tracing_disabled(True)  # traces go to the OpenAI platform, and there is no account behind this client

INSTRUCTIONS = ("Solve the math word problem. Use the calculator tool for every computation. "
                "Finish with: The answer is <number>.")
MAX_TURNS = 4  # model calls per episode: enough for two rounds of tool use and the final answer

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg, ast.UAdd: operator.pos}
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _evaluate(node: ast.AST) -> float:
    """Numbers and + - * / over them: the model's expression is never handed to eval()."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.operand))
    raise ValueError("only numbers, + - * / and parentheses")


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression such as (17+25)*3/2.

    Args:
        expression: numbers with + - * / and parentheses.
    """
    try:
        value = _evaluate(ast.parse(expression.replace(",", ""), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as e:
        return f"error: {e}"  # the model reads the error and may try again
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


async def solve(client, data: dict) -> float:
    agent = Agent(name="solver", instructions=INSTRUCTIONS, tools=[calculator],
                  model=OpenAIChatCompletionsModel(model="policy", openai_client=client))
    try:
        result = await Runner.run(agent, data["question"], max_turns=MAX_TURNS)
    except (MaxTurnsExceeded, ModelBehaviorError):
        # Out of turns, or a call to a tool that does not exist: a failed episode the policy should
        # learn from (reward 0), not a crash that drops it from the batch.
        return 0.0
    return 1.0 if _is_right(str(result.final_output), data["answer"]) else 0.0


def _is_right(text: str, reference: str) -> bool:
    numbers = _NUMBER.findall(text)
    try:
        return bool(numbers) and float(numbers[-1].replace(",", "")) == float(reference)
    except ValueError:  # a reference that is not a number
        return False
