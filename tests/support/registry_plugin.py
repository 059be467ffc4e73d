"""A plugin module (``plugins=[registry_plugin]``) that registers one of each kind through the
public decorators, with no edit to the package: an advantage estimator, a workflow and a reward.

Each writes one JSON line to ``$AREAL_TEST_PLUGIN_MARKER`` when it runs (with its pid), so a test
can show it ran in the process that owns it: the estimator in the torchrun trainer ranks, the
workflow in the spawned rollout worker, the reward in the spawned reward-pool workers. Torch and
the built-ins load inside the functions, so importing this module keeps `areal validate-config`
light (the CLI imports plugins before it validates).
"""

from __future__ import annotations

import json
import os

from areal_cli.algorithms.registry import register_adv_estimator
from areal_cli.rewards.registry import register_reward
from areal_cli.rollout.workflows import register_workflow


def _mark(kind: str, **extra) -> None:
    path = os.environ.get("AREAL_TEST_PLUGIN_MARKER")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"kind": kind, "pid": os.getpid(), "rank": os.environ.get("RANK"), **extra}) + "\n")


@register_adv_estimator("marked_grpo", group_baseline=True)
def marked_grpo(*, rewards, loss_mask, group_size, group_ids):
    """Dr.GRPO's group-mean baseline, plus a marker line per call."""
    from areal_cli.algorithms.advantages import drgrpo_advantages

    _mark("adv_estimator", rows=int(rewards.shape[0]))
    return drgrpo_advantages(rewards=rewards, loss_mask=loss_mask, group_size=group_size, group_ids=group_ids)


@register_adv_estimator("marked_gae", needs_values=True)
def marked_gae(*, rewards, loss_mask, values):  # declared only: validation tests read its requirement
    raise NotImplementedError


@register_reward("marked_numeric")  # in_process=False: runs in the reward pool's spawned workers
def marked_numeric(prompt, completion, answer, **kw):
    from areal_cli.rewards.builtin import numeric_reward

    _mark("reward")
    return numeric_reward(prompt, completion, answer, **kw)


@register_workflow("marked_rlvr")
def marked_rlvr(reward_fn, gconfig, tokenizer, group_size):
    """RLVR whose episodes leave a marker line (a factory: the built-in loads on first use)."""
    from areal_cli.rollout.workflows.rlvr import RLVRWorkflow

    class MarkedRLVR(RLVRWorkflow):
        async def arun_episode(self, engine, data):
            _mark("workflow", stop_ids=list(self.gconfig.stop_token_ids))
            return await super().arun_episode(engine, data)

    return MarkedRLVR(reward_fn, gconfig, tokenizer, group_size=group_size)
