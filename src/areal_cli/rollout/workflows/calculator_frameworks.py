"""The built-in tool-use task written with agent frameworks: the OpenAI Agents SDK and LangChain.

The same task, tool, reward and warm start as :class:`~areal_cli.rollout.workflows.calculator.CalculatorAgent`
(``experiment=agent_calculator``), but the agent loop is the framework's:

- :class:`AgentsSDKCalculator`: an ``agents.Agent`` with a ``FunctionTool``, run by ``Runner.run`` on an
  ``OpenAIChatCompletionsModel`` over the episode's in-process client (``workflow.name=agent``;
  ``experiment=agent_calculator_agents_sdk``).
- :class:`LangChainCalculator`: ``ChatOpenAI(base_url=..., api_key=...).bind_tools(...)`` reaching the
  policy over HTTP through the run's proxy (``ProxyAgentWorkflow`` with ``workflow.kwargs.agent``;
  ``experiment=agent_calculator_langchain``). Its signature is the proxy's in-process agent contract,
  ``agent(base_url, api_key, data)``.

Each sends the tool in the framework's own schema, so :attr:`tool` is that schema: the SFT warm start
renders exactly the prompt the framework sends (``tests/unit/rollout/test_calculator_frameworks.py``
checks it against the frameworks' own converters). Both need the ``agents`` extra
(``openai-agents``, ``langchain-openai``); they are imported when an episode runs.
"""

from __future__ import annotations

from typing import Any

from areal_cli.rewards.outcome import Reward
from areal_cli.rollout.workflows.calculator import CALCULATOR, CalculatorAgent, calculate, expression_of

# The Agents SDK sends a function tool with its parameter schema and its strictness; kept as small as
# the SDK allows (every prompt carries it, a token per character or two with the tiny tokenizer).
SDK_PARAMETERS = {"type": "object", "properties": {"expression": {"type": "string"}}}
SDK_TOOL = {"type": "function", "function": {**CALCULATOR["function"], "parameters": SDK_PARAMETERS,
                                             "strict": False}}


class AgentsSDKCalculator(CalculatorAgent):
    """The calculator task as an OpenAI Agents SDK agent. ``max_turns`` is the SDK's: model calls per
    episode; an episode that runs out of turns or calls a tool the agent does not have scores as one
    that never answered."""

    tool = SDK_TOOL

    def function_tool(self, expressions: list) -> Any:
        """The SDK tool; each call's expression is appended to ``expressions`` (the shaped reward reads
        the first)."""
        from agents import FunctionTool

        async def invoke(_ctx: Any, arguments: str) -> str:
            expr = expression_of(arguments)
            expressions.append(expr)
            return calculate(expr)

        fn = self.tool["function"]
        return FunctionTool(name=fn["name"], description=fn["description"], params_json_schema=SDK_PARAMETERS,
                            on_invoke_tool=invoke, strict_json_schema=False)

    async def __call__(self, client: Any, data: dict) -> Reward:
        from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
        from agents.exceptions import MaxTurnsExceeded, ModelBehaviorError

        set_tracing_disabled(True)  # no OpenAI account behind this client to send traces to
        expressions: list = []
        agent = Agent(name="calculator", tools=[self.function_tool(expressions)],
                      model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
                      model_settings=ModelSettings(temperature=self.temperature, max_tokens=self.max_tokens))
        try:
            answer = str((await Runner.run(agent, data["question"], max_turns=self.max_turns)).final_output)
        except (MaxTurnsExceeded, ModelBehaviorError):
            answer = None
        return self.outcome(bool(expressions), answer, expressions[0] if expressions else None, data)


class LangChainCalculator(CalculatorAgent):
    """The calculator task as a LangChain agent over HTTP: ``ChatOpenAI.bind_tools`` with the tool as an
    OpenAI tool dict, the loop written as LangChain's tool-calling guide writes it. ``max_turns``
    model calls at most."""

    async def __call__(self, base_url: str, api_key: str, data: dict) -> Reward:
        import httpx
        from langchain_openai import ChatOpenAI

        # an HTTP client of the episode's own: LangChain's shared default one is bound to the event loop
        # that first used it, and training and evaluation run episodes on different loops
        async with httpx.AsyncClient(timeout=600) as http:
            llm = ChatOpenAI(model="policy", base_url=base_url, api_key=api_key, max_retries=0,
                             http_async_client=http, temperature=self.temperature,
                             max_tokens=self.max_tokens).bind_tools([self.tool])
            return await self._loop(llm, data)

    async def _loop(self, llm: Any, data: dict) -> Reward:
        from langchain_core.messages import HumanMessage, ToolMessage

        messages: list = [HumanMessage(data["question"])]
        first_expr, used_tool = None, False
        for _ in range(self.max_turns):
            reply = await llm.ainvoke(messages)
            # a call whose arguments are not JSON is still a call (LangChain files it as invalid)
            calls = list(reply.tool_calls) + list(reply.invalid_tool_calls)
            if not calls:
                return self.outcome(used_tool, str(reply.content), first_expr, data)
            used_tool = True
            messages.append(reply)
            for call in calls:
                expr = expression_of(call.get("args"))
                first_expr = expr if first_expr is None else first_expr
                messages.append(ToolMessage(calculate(expr), tool_call_id=call.get("id") or ""))
        return self.outcome(used_tool, None, first_expr, data)


# experiment=agent_calculator_agents_sdk / _langchain: the shaping and warm-start mix of
# calculator.shaped_agent (experiment=agent_calculator)
sdk_shaped_agent = AgentsSDKCalculator(operand_credit=0.25, sft_mix=(4, 1, 3))
langchain_shaped_agent = LangChainCalculator(operand_credit=0.25, sft_mix=(4, 1, 3))
