"""Pieces a spawned rollout worker imports by path (tests/integration is on its sys.path)."""

from __future__ import annotations

from areal_cli.api.workflow_api import RolloutWorkflow


class ExplodingWorkflow(RolloutWorkflow):
    """Fails every episode with a recognisable message."""

    def __init__(self, **kwargs):
        pass

    async def arun_episode(self, engine, data):
        raise KeyError(f"episode exploded at position {data.get('_pos')}")
