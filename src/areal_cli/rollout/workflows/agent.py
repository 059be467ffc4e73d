"""Agent episodes: ordinary ``openai.AsyncOpenAI`` agent code as a rollout workflow.

``workflow.name=agent`` with ``workflow.kwargs.agent=my_pkg.mod:my_agent``, where::

    async def my_agent(client: openai.AsyncOpenAI, data: dict) -> float | dict[str, float] | None

``client`` is an :class:`~areal_cli.rollout.openai_client.ArealOpenAI` for this one episode. The
return value is the reward: a number goes to the episode's last call, a dict maps interaction ids
(``completion.id``) to rewards, ``None`` means the agent set them itself (``client.set_reward``).
``turn_discount`` is then applied once (``rollout/interaction_cache.py`` has the formula).

``group_size`` episodes run per data item and their rows form one group (one ``group_id``; the
advantage code groups by it, so episodes may export any number of rows). An episode that raises is
counted (``AgentWorkflow.failed``) and, with ``on_error="drop"`` (default), dropped: the group goes on
with the others (all failed: the item is rejected); ``on_error="raise"`` ends the run.

Rows: ``export_style="per_leaf"`` (default) gives one row per conversation (several trained
segments, per-turn rewards as ``token_rewards``); ``"per_call"`` one row per call with the
discounted reward.

Evaluation runs the same agent (:meth:`AgentWorkflow.eval_episode`, greedy): an item succeeds when
its reward reaches ``success_threshold``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import uuid
from typing import TYPE_CHECKING, Any

from areal_cli.api.workflow_api import RolloutWorkflow, Trajectory
from areal_cli.errors import ConfigError
from areal_cli.rollout.interaction_cache import rows_to_tensors
from areal_cli.rollout.openai_client import ArealOpenAI
from areal_cli.rewards.outcome import correctness
from areal_cli.rollout.workflows.common import (check_group_and_reward, eval_failed, eval_result, load_tokenizer,
                                               next_group_id, pad_token_id, tool_call_count)

if TYPE_CHECKING:
    from areal_cli.config.schema import ExperimentConfig

log = logging.getLogger(__name__)


class AgentWorkflow(RolloutWorkflow):
    def __init__(self, agent: Any, tokenizer: Any, group_size: int = 1, *, turn_discount: float = 1.0,
                 export_style: str = "per_leaf", on_error: str = "drop", tool_call_parser: str = "hermes",
                 prompt_mode: str = "continue", default_max_tokens: int = 256,
                 max_total_tokens: int | None = None, success_threshold: float = 1.0, **_ignored: Any):
        agent = resolve_agent(agent)
        if not callable(agent) or not (inspect.iscoroutinefunction(agent)
                                       or inspect.iscoroutinefunction(getattr(agent, "__call__", None))):
            raise ConfigError("workflow.kwargs.agent", f"{agent!r} is not an async function",
                              "define `async def agent(client, data) -> reward` and name it module:function")
        check_group_and_reward(group_size, agent)
        if on_error not in ("drop", "raise"):
            raise ConfigError("workflow.kwargs.on_error", f"must be 'drop' or 'raise', got {on_error!r}",
                              "set workflow.kwargs.on_error=drop")
        if export_style not in ("per_leaf", "per_call"):
            raise ConfigError("workflow.kwargs.export_style",
                              f"must be per_leaf or per_call, got {export_style!r}",
                              "set workflow.kwargs.export_style=per_leaf")
        self.agent = agent
        self.tokenizer = load_tokenizer(tokenizer)
        self.group_size = group_size
        self.turn_discount = float(turn_discount)
        self.export_style = export_style
        self.on_error = on_error
        self.client_kwargs = {"tool_call_parser": tool_call_parser, "prompt_mode": prompt_mode,
                              "default_max_tokens": default_max_tokens, "max_total_tokens": max_total_tokens}
        self.success_threshold = float(success_threshold)
        self.pad_id = pad_token_id(self.tokenizer)
        self.failed = 0
        self.episodes = 0

    async def _run(self, engine: Any, data: dict[str, Any], greedy: bool = False,
                   session_id: str | None = None) -> tuple[ArealOpenAI, Any]:
        client = ArealOpenAI(engine, self.tokenizer, force_greedy=greedy, session_id=session_id,
                             **self.client_kwargs)
        return client, await self.agent(client, data)

    async def eval_episode(self, engine: Any, data: dict[str, Any]) -> tuple[bool, float]:
        """One greedy episode: ``{success, reward, tool_calls}``; the reward is the number the agent
        returned, or the sum of the rewards it set. An episode that raises counts as unsolved (and in
        ``failed``); with ``on_error="raise"`` it ends the run."""
        try:
            client, reward = await self._run(engine, data, greedy=True)
        except Exception as e:
            if self.on_error == "raise":
                raise
            return eval_failed(self, e)
        return eval_result(client, reward, self.success_threshold)

    async def episode_rows(self, engine: Any, data: dict[str, Any], session_id: str | None = None
                           ) -> list[dict[str, Any]]:
        """Run one episode; its exported rows (``interaction_cache`` format). ``session_id``: the
        routing key of its calls (the group's, so one server's prefix cache serves all members)."""
        client, reward = await self._run(engine, data, session_id=session_id)
        if isinstance(reward, dict):
            for iid, r in reward.items():
                client.set_reward(iid, r)
        elif reward is not None:
            client.set_last_reward(reward)
        if len(client.cache) == 0:
            raise RuntimeError("the agent made no chat.completions call; there is nothing to train on")
        if self.export_style == "per_call":
            client.apply_reward_discount(self.turn_discount)
        rows = client.export_interactions(self.export_style)
        ok, calls = correctness(reward), tool_call_count(client)
        for row in rows:  # the episode's outcome and tool use, on each of its rows
            row["correct"], row["tool_calls"] = ok, calls
        return rows

    @staticmethod
    def sft_items(cfg: ExperimentConfig, tokenizer: Any, items: list[dict]) -> list[dict]:
        """SFT warm-start examples: the agent's ``sft_example(item, tokenizer)`` when it has one."""
        agent = resolve_agent(dict(cfg.workflow.kwargs or {}).get("agent"))
        example = getattr(agent, "sft_example", None)
        return items if example is None else [example(it, tokenizer) for it in items]

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> Trajectory | None:
        import torch

        key = f"group-{uuid.uuid4().hex}"
        try:
            res = await asyncio.gather(*[self.episode_rows(engine, data, key) for _ in range(self.group_size)],
                                       return_exceptions=True)
        finally:
            end = getattr(engine, "end_session", None)
            if end is not None:
                end(key)
        self.episodes += len(res)
        errors = [r for r in res if isinstance(r, BaseException)]
        for e in errors:
            if isinstance(e, asyncio.CancelledError):
                raise e
        if errors:
            self.failed += len(errors)
            if self.on_error == "raise":
                raise errors[0]
            log.warning("%d of %d agent episodes failed (%s: %s); dropped", len(errors), len(res),
                        type(errors[0]).__name__, errors[0])
        rows = [row for r in res if not isinstance(r, BaseException) for row in r]
        if not rows:
            return None
        traj = rows_to_tensors(rows, self.pad_id, next_group_id(), self.tokenizer)
        traj.data["agent_tool_calls"] = torch.tensor([r["tool_calls"] for r in rows], dtype=torch.long)
        traj.meta.update(id=data.get("id"), agent_failed=self.failed)
        return traj


def resolve_agent(agent: Any) -> Any:
    """``module:function`` / ``module:Class`` (instantiated without arguments) / a callable."""
    if isinstance(agent, str):
        from areal_cli.rollout.workflows import import_object

        agent = import_object(agent, "workflow.kwargs.agent")
    if inspect.isclass(agent):
        agent = agent()
    if agent is None:
        raise ConfigError("workflow.kwargs.agent", "no agent given",
                          "set workflow.kwargs.agent=my_pkg.mod:my_agent (an async function)")
    return agent
