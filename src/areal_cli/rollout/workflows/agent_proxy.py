"""Agents in other processes or languages: one external command per episode, through the proxy.

``workflow.name=areal_cli.rollout.workflows.agent_proxy:ProxyAgentWorkflow`` with
``workflow.kwargs.command="python my_agent.py"`` (or a list of argv). Per episode the workflow grants
one unit of capacity, starts a session on its :class:`~areal_cli.rollout.proxy.AgentProxy` (served
on a thread of the rollout process) and runs the command with

- ``OPENAI_BASE_URL`` = the proxy's ``/v1``, ``OPENAI_API_KEY`` = the session key (any OpenAI client
  picks both up unchanged);
- ``AREAL_PROXY_URL`` (the proxy root, for ``/rl/set_reward`` and ``/rl/end_session``) and
  ``AREAL_TASK`` (the data item as JSON).

The agent sets its rewards with ``POST /rl/set_reward``; the workflow ends the session when the
command exits (if the agent did not) and exports it. A command that exits non-zero or runs past
``timeout_s`` is a failed episode: counted, and dropped or raised per ``on_error``.

``workflow.kwargs.agent=my_pkg.mod:my_agent`` instead of a command runs the agent in this process, still
over HTTP through the proxy: ``async def my_agent(base_url, api_key, data) -> reward`` gets the
proxy's ``/v1`` and the session key (for ``ChatOpenAI(base_url=..., api_key=...)`` and any other
client that takes them) and returns its reward as the agent workflow's agents do (a number for the
last call, ``None`` when it posted its rewards itself). No process per episode: frameworks that are
slow to import (LangChain) pay once.

Evaluation (``eval_episode``) runs the agent (or the command) once per held-out item in a greedy
session: an item succeeds when the episode's reward reaches ``success_threshold`` (or, for a reward
that states its correctness, when it is correct); an episode that fails counts as unsolved
(``on_error="raise"``: ends the run).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shlex
from typing import Any

import httpx

from areal_cli.api.workflow_api import RolloutWorkflow, Trajectory
from areal_cli.errors import ConfigError
from areal_cli.rewards.outcome import correctness
from areal_cli.rollout.interaction_cache import rows_to_tensors
from areal_cli.rollout.workflows.common import (check_group_and_reward, eval_failed, eval_result, load_tokenizer,
                                               next_group_id, pad_token_id)

log = logging.getLogger(__name__)


class ProxyAgentWorkflow(RolloutWorkflow):
    def __init__(self, command: str | list[str] | None = None, tokenizer: Any = None, group_size: int = 1, *,
                 agent: Any = None, export_style: str = "per_leaf", turn_discount: float | None = None,
                 on_error: str = "drop", timeout_s: float = 600.0, session_timeout_s: float = 3600.0,
                 success_threshold: float = 1.0, **client_kwargs: Any):
        from areal_cli.rollout.workflows import check_proxy_agent

        check_proxy_agent(command, agent)
        if on_error not in ("drop", "raise"):
            raise ConfigError("workflow.kwargs.on_error", f"must be 'drop' or 'raise', got {on_error!r}",
                              "set workflow.kwargs.on_error=drop")
        if agent is not None:
            from areal_cli.rollout.workflows.agent import resolve_agent

            agent = resolve_agent(agent)
        check_group_and_reward(group_size, lambda: None)
        self.agent = agent
        self.argv = ([] if not command else shlex.split(command) if isinstance(command, str)
                     else [str(a) for a in command])
        self.tokenizer = load_tokenizer(tokenizer)
        self.group_size = group_size
        self.export_style = export_style
        self.turn_discount = turn_discount
        self.on_error = on_error
        self.timeout_s = float(timeout_s)
        self.session_timeout_s = session_timeout_s
        self.success_threshold = float(success_threshold)
        known = ("tool_call_parser", "prompt_mode", "default_max_tokens", "max_total_tokens")
        self.client_kwargs = {k: v for k, v in client_kwargs.items() if k in known}
        self.pad_id = pad_token_id(self.tokenizer)
        self.server: Any = None
        self.failed = 0

    @staticmethod
    def sft_items(cfg: Any, tokenizer: Any, items: list[dict]) -> list[dict]:
        """SFT warm-start examples: the in-process agent's ``sft_example(item, tokenizer)`` when it has one."""
        agent = dict(cfg.workflow.kwargs or {}).get("agent")
        if agent is None:
            return items
        from areal_cli.rollout.workflows.agent import AgentWorkflow

        return AgentWorkflow.sft_items(cfg, tokenizer, items)

    def _ensure_proxy(self, engine: Any) -> Any:
        if self.server is None:
            from areal_cli.rollout.proxy import AgentProxy, serve_proxy

            # One proxy for every episode: the run's client, not an episode's seeded wrapper.
            base = getattr(engine, "_inner", engine)
            self.server = serve_proxy(AgentProxy(base, self.tokenizer,
                                                 session_timeout_s=self.session_timeout_s, **self.client_kwargs))
        return self.server

    async def _session(self, http: httpx.AsyncClient, root: str, admin: dict, data: dict,
                       greedy: bool = False) -> tuple[dict, Any]:
        """Start a session, run the episode's agent in it and end it: ``(session, reward)``; the reward is
        what an in-process agent returned (None for a command: it posts its own)."""
        (await http.post(f"{root}/rl/grant_capacity", json={"n": 1}, headers=admin)).raise_for_status()
        r = await http.post(f"{root}/rl/start_session", headers=admin,
                            json={"task_id": str(data.get("id", "task")), "greedy": greedy})
        r.raise_for_status()
        s = r.json()
        session_auth = {"Authorization": f"Bearer {s['api_key']}"}
        try:
            if self.agent is not None:
                reward = await asyncio.wait_for(self.agent(f"{root}/v1", s["api_key"], data), self.timeout_s)
                if reward is not None:
                    (await http.post(f"{root}/rl/set_reward", json={"reward": float(reward)},
                                     headers=session_auth)).raise_for_status()
                return s, reward
            await self._run_command(root, s["api_key"], data)
            return s, None
        finally:
            await http.post(f"{root}/rl/end_session", headers=session_auth)

    async def _run_command(self, root: str, api_key: str, data: dict) -> None:
        env = {**os.environ, "OPENAI_BASE_URL": f"{root}/v1", "OPENAI_API_KEY": api_key,
               "AREAL_PROXY_URL": root, "AREAL_TASK": json.dumps(data, default=str)}
        proc = await asyncio.create_subprocess_exec(*self.argv, env=env, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.STDOUT)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), self.timeout_s)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            raise RuntimeError(f"agent command {self.argv} ran past {self.timeout_s:.0f}s") from None
        if proc.returncode != 0:
            raise RuntimeError(f"agent command {self.argv} exited {proc.returncode}: "
                               f"{out.decode(errors='replace')[-2000:]}")

    async def _episode(self, http: httpx.AsyncClient, root: str, admin: dict, data: dict) -> list[dict]:
        s, reward = await self._session(http, root, admin, data)
        body = {"session_id": s["session_id"], "style": self.export_style}
        if self.turn_discount is not None and self.export_style == "per_call":
            # per_leaf rows carry every call's own reward (token_rewards): discounting there would count
            # later rewards twice, so only per_call rows are discounted, as in the agent workflow
            body["turn_discount"] = self.turn_discount
        r = await http.post(f"{root}/rl/export", json=body, headers=admin)
        r.raise_for_status()
        rows = r.json()["rows"]
        if reward is not None:  # the episode's outcome on each of its rows, as the agent workflow does
            for row in rows:
                row["correct"] = correctness(reward)
        return rows

    async def eval_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, Any]:
        """One greedy episode of the agent (or the command): ``{success, reward, tool_calls}``; the
        reward is the agent's, or the sum of the rewards the command posted."""
        server = self._ensure_proxy(engine)
        root = f"http://{server.address}"
        admin = {"Authorization": f"Bearer {server.proxy.admin_key}"}
        try:
            async with httpx.AsyncClient(timeout=self.timeout_s + 60) as http:
                s, reward = await self._session(http, root, admin, data, greedy=True)
        except Exception as e:
            if self.on_error == "raise":
                raise
            return eval_failed(self, e)
        client = server.proxy.take(s["session_id"])  # nothing of an evaluation is trained
        if client is None:  # collected meanwhile (idle past session_timeout_s)
            return eval_failed(self, RuntimeError(f"evaluation session {s['session_id']} was collected"))
        return eval_result(client, reward, self.success_threshold)

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> Trajectory | None:
        server = self._ensure_proxy(engine)
        root = f"http://{server.address}"
        admin = {"Authorization": f"Bearer {server.proxy.admin_key}"}
        async with httpx.AsyncClient(timeout=self.timeout_s + 60) as http:
            res = await asyncio.gather(*[self._episode(http, root, admin, data)
                                         for _ in range(self.group_size)], return_exceptions=True)
        errors = [r for r in res if isinstance(r, BaseException)]
        if errors:
            self.failed += len(errors)
            if self.on_error == "raise":
                raise errors[0]
            log.warning("%d of %d proxy agent episodes failed (%s: %s); dropped", len(errors), len(res),
                        type(errors[0]).__name__, errors[0])
        rows = [row for r in res if not isinstance(r, BaseException) for row in r]
        if not rows:
            return None
        import torch

        traj = rows_to_tensors(rows, self.pad_id, next_group_id(), self.tokenizer)
        # the trainer logs agent/tool_call_rate from it, as for the in-process agent workflow
        traj.data["agent_tool_calls"] = torch.tensor([r.get("tool_calls", 0) for r in rows], dtype=torch.long)
        traj.meta.update(id=data.get("id"), agent_failed=self.failed)
        return traj

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
