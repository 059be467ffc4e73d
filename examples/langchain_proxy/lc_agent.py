"""A LangChain tool-calling agent for GSM8K, run as its own process once per episode.

The proxy workflow (``workflow.name=areal_cli.rollout.workflows.agent_proxy:ProxyAgentWorkflow``,
``workflow.kwargs.command="python -m lc_agent"``) starts this script for every episode with
``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` pointing at the run's proxy (an OpenAI-compatible endpoint
that generates with the policy being trained and records each call's tokens), ``AREAL_TASK`` (the
dataset item as JSON) and ``AREAL_PROXY_URL``, where the script posts its reward. Any program that
speaks the OpenAI API over HTTP fits the same slot; this one is plain LangChain.
"""

from __future__ import annotations

import ast
import asyncio
import json
import operator
import os
import re

import httpx
from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

SYSTEM = ("Solve the math word problem. Use the calculator tool for every computation. "
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


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression such as (17+25)*3/2."""
    try:
        value = _evaluate(ast.parse(expression.replace(",", ""), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as e:
        return f"error: {e}"  # the model reads the error and may try again
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def _is_right(text: str, reference: str) -> bool:
    numbers = _NUMBER.findall(text)
    try:
        return bool(numbers) and float(numbers[-1].replace(",", "")) == float(reference)
    except ValueError:  # a reference that is not a number
        return False


async def run_episode(task: dict) -> float:
    # temperature is left unset: the proxy then samples at 1.0, the temperature the RL loss assumes
    llm = ChatOpenAI(model="policy", base_url=os.environ["OPENAI_BASE_URL"],
                     api_key=os.environ["OPENAI_API_KEY"], max_retries=0).bind_tools([calculator])
    messages = [SystemMessage(SYSTEM), HumanMessage(task["question"])]
    for _ in range(MAX_TURNS):
        # LangChain replays the history verbatim, so each call's prompt extends the last one and the
        # proxy links them into one trained sequence
        reply = await llm.ainvoke(messages)
        messages.append(reply)
        if not reply.tool_calls:
            return 1.0 if _is_right(str(reply.content), task["answer"]) else 0.0
        for call in reply.tool_calls:
            messages.append(await _run_tool(call))
    return 0.0  # out of turns without a final answer


async def _run_tool(call: dict) -> ToolMessage:
    """The tool's reply to one call. A call it cannot take gets an error message the model reads, as a
    failed episode to learn from rather than a crashed process."""
    if call["name"] != calculator.name:
        return ToolMessage(f"error: no tool named {call['name']!r}", tool_call_id=call["id"])
    try:
        return await calculator.ainvoke(call)  # a ToolCall in, a ToolMessage out
    except ValueError as e:  # pydantic's ValidationError: arguments that do not fit the tool's schema
        return ToolMessage(f"error: {e}", tool_call_id=call["id"])


def main() -> None:
    reward = asyncio.run(run_episode(json.loads(os.environ["AREAL_TASK"])))
    # no interaction id: the reward goes to the episode's last call
    httpx.post(f"{os.environ['AREAL_PROXY_URL']}/rl/set_reward", json={"reward": reward}, timeout=60,
               headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"}).raise_for_status()


if __name__ == "__main__":
    main()
