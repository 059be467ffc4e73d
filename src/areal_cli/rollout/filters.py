"""``should_accept`` filters for the rollout executor."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from areal_cli.api.workflow_api import Trajectory


def has_reward_variance(traj: "Trajectory", atol: float = 1e-6) -> bool:
    """DAPO dynamic sampling: reject a group whose rewards are all equal (its advantages would be zero).

    Groups are told apart by ``group_id`` when present, else the whole trajectory is one group; the
    trajectory is accepted only if every group in it has at least two distinct rewards.
    """
    rewards = traj.data["rewards"].float()
    if rewards.numel() < 2:
        return False
    gid = traj.data.get("group_id")
    if gid is None:
        return bool((rewards.max() - rewards.min()) > atol)
    for g in gid.unique():
        r = rewards[gid == g]
        if r.numel() < 2 or bool((r.max() - r.min()) <= atol):
            return False
    return True
