"""``workflow.name=online``: train on the sessions of an agent service that lives outside the trainer.

The rollout process serves an :class:`~areal_cli.rollout.gateway.OnlineGateway` (a long-lived proxy) at
``http://<host>:<port>`` and writes where, with the service's key, to ``gateway_file`` (default:
``<run dir>/gateway.json``, the ``run_dir`` the trainer hands a workflow that names it). The service opens
sessions there (``POST /rl/start_session``), runs its agents against each session's ``base_url`` /
``api_key`` with any OpenAI client, sets rewards and ends them, at its own pace; see
``examples/online_agent/`` and docs/agents.md.

Each episode the executor admits (through the staleness gate) grants the gateway one session and
waits for it to end; the ended session's rows are the episode's trajectory. A session the service
abandons is dropped whole and its episode returns nothing (capacity freed, ``online/abandoned``
counts it). The data item of the episode rides along as the session's ``task`` (a service with tasks
of its own ignores it).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from areal_cli.api.workflow_api import RolloutWorkflow, Trajectory
from areal_cli.errors import ConfigError
from areal_cli.rollout.interaction_cache import rows_to_tensors
from areal_cli.rollout.workflows import check_online_group_size
from areal_cli.rollout.workflows.common import load_tokenizer, next_group_id, pad_token_id

KEY_ENV = "AREAL_GATEWAY_KEY"


class OnlineAgentWorkflow(RolloutWorkflow):
    def __init__(self, tokenizer: Any, group_size: int = 1, *, host: str = "127.0.0.1", port: int = 0,
                 gateway_file: str | None = None, service_key: str | None = None,
                 session_timeout_s: float = 600.0, export_style: str = "per_leaf",
                 turn_discount: float | None = None, tool_call_parser: str = "hermes",
                 prompt_mode: str = "continue", default_max_tokens: int = 512,
                 max_total_tokens: int | None = None, run_dir: str | None = None):
        check_online_group_size(group_size)
        if export_style not in ("per_call", "per_leaf"):
            raise ConfigError("workflow.kwargs.export_style", f"must be 'per_call' or 'per_leaf', got "
                              f"{export_style!r}", "set workflow.kwargs.export_style=per_leaf")
        if isinstance(session_timeout_s, bool) or not isinstance(session_timeout_s, (int, float)) \
                or session_timeout_s <= 0:
            raise ConfigError("workflow.kwargs.session_timeout_s", "must be a positive number of seconds, "
                              f"got {session_timeout_s!r}", "set workflow.kwargs.session_timeout_s=600")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
            raise ConfigError("workflow.kwargs.port", f"must be a port (0: any free one), got {port!r}",
                              "set workflow.kwargs.port=0")
        self.tokenizer = load_tokenizer(tokenizer)
        self.host, self.port = str(host), int(port)
        if gateway_file is None and run_dir:
            from areal_cli.rollout.gateway import GATEWAY_FILE

            gateway_file = os.path.join(run_dir, GATEWAY_FILE)
        self.gateway_file = gateway_file or None
        self.service_key = service_key or os.environ.get(KEY_ENV) or None
        self.gateway_kwargs = dict(session_timeout_s=float(session_timeout_s), export_style=export_style,
                                   turn_discount=turn_discount, tool_call_parser=tool_call_parser,
                                   prompt_mode=prompt_mode, default_max_tokens=int(default_max_tokens),
                                   max_total_tokens=max_total_tokens)
        self.pad_id = pad_token_id(self.tokenizer)
        self.server: Any = None

    @property
    def gateway(self) -> Any:
        return self.server.proxy if self.server is not None else None

    def start(self, engine: Any) -> Any:
        """Serve the gateway (once) on ``engine``: the run's inference client, whose versions the
        tokens get. The first episode calls it; call it yourself to serve before any episode runs."""
        if self.server is None:
            from areal_cli.rollout.gateway import OnlineGateway, serve_gateway

            base = getattr(engine, "_inner", engine)  # the run's client, not an episode's seeded wrapper
            gw = OnlineGateway(base, self.tokenizer, service_key=self.service_key, **self.gateway_kwargs)
            self.server = serve_gateway(gw, self.host, self.port, self.gateway_file)
        return self.server

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> Trajectory | None:
        gw = self.start(engine).proxy
        # Cancelling this episode (the executor shutting down) cancels the grant with it.
        rows = await asyncio.wrap_future(gw.grant(data))
        if not rows:
            return None  # abandoned or empty: nothing of it is trained, the capacity is free again
        import torch

        traj = rows_to_tensors(rows, self.pad_id, next_group_id(), self.tokenizer)
        traj.data["agent_tool_calls"] = torch.tensor([r.get("tool_calls", 0) for r in rows], dtype=torch.long)
        traj.meta.update(id=data.get("id"))
        return traj

    def rollout_stats(self) -> dict[str, float]:
        """The gateway's counters (``online/*``), logged with every batch."""
        return self.gateway.counters() if self.gateway is not None else {}

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
