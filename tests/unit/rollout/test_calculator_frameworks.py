"""The calculator task's framework agents: each offers the tool in the schema its framework really sends
(so the warm start renders what the agent will be prompted with) and scores episodes as the plain agent."""

from __future__ import annotations

import asyncio

import pytest

from areal_cli.rollout.workflows.calculator import CALCULATOR, CalculatorAgent
from areal_cli.rollout.workflows.calculator_frameworks import (SDK_TOOL, langchain_shaped_agent,
                                                               sdk_shaped_agent)

ITEM = {"question": "Tom has 4 apples and gets 7 more. How many?", "answer": "11",
        "solution": "4+7=11\n#### 11"}


def test_sdk_tool_is_what_the_agents_sdk_sends():
    pytest.importorskip("agents")
    from agents.models.chatcmpl_converter import Converter

    seen: list = []
    tool = sdk_shaped_agent.function_tool(seen)
    assert Converter.tool_to_openai(tool) == SDK_TOOL == sdk_shaped_agent.tool
    # the tool runs the calculator and records the expression the shaped reward reads
    assert asyncio.run(tool.on_invoke_tool(None, '{"expression": "4+7"}')) == "11"
    assert asyncio.run(tool.on_invoke_tool(None, "not json")).startswith("error")
    assert seen == ["4+7", None]


def test_langchain_sends_the_tool_dict_unchanged():
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="policy", base_url="http://127.0.0.1:9/v1", api_key="k").bind_tools(
        [langchain_shaped_agent.tool])
    assert llm.kwargs["tools"] == [CALCULATOR] and langchain_shaped_agent.tool == CALCULATOR


@pytest.mark.parametrize("agent", [CalculatorAgent(operand_credit=0.25), sdk_shaped_agent, langchain_shaped_agent])
def test_outcome_is_the_plain_agents(agent):
    right = agent.outcome(True, "The answer is 11.", "4+7", ITEM)
    assert float(right) == 1.0 and right.correct
    # the right number without the tool is not a success; a call with one right operand scores 0.25
    head = agent.outcome(False, "The sum is 11.", None, ITEM)
    assert float(head) == 0.0 and not head.correct
    wrong = agent.outcome(True, "The answer is 13.", "4+9", ITEM)
    assert float(wrong) == 0.25 and not wrong.correct
    never = agent.outcome(True, None, "4+7", ITEM)  # out of turns: never answered
    assert float(never) == 0.5 and not never.correct
