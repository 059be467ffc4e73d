"""Registries and plugins (src/areal_cli/registry.py): entries declare their requirements and the
validator enforces them; functions take exactly the inputs they name; plugin modules register names
that validation accepts and that reach child processes; a missing plugin is a typed error."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from areal_cli.algorithms.advantages import compute_advantages
from areal_cli.algorithms.losses import ActorLossParams, actor_loss
from areal_cli.algorithms.registry import ADV_ESTIMATORS, LOSS_AGG, POLICY_LOSSES, register_adv_estimator
from areal_cli.config.algo import AlgoConfig
from areal_cli.algorithms.config_checks import validate_algo_config, validate_group_size
from areal_cli.errors import ConfigError
from areal_cli.registry import PLUGINS_ENV, RegistrationError, load_plugins
from areal_cli.rewards.registry import REWARDS
from areal_cli.rollout.workflows import WORKFLOWS

REWARDS_T = torch.tensor([1.0, 0.0, 1.0, 1.0])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0]])


@pytest.fixture(autouse=True)
def isolated_registries(monkeypatch):
    """Names a test registers disappear after it (each registry's table is restored)."""
    from areal_cli import registry

    for reg in (ADV_ESTIMATORS, POLICY_LOSSES, LOSS_AGG, REWARDS, WORKFLOWS):
        monkeypatch.setattr(reg, "_entries", dict(reg._entries))
    monkeypatch.setattr(registry, "_imported", set(registry._imported))
    monkeypatch.setenv(PLUGINS_ENV, "")  # load_plugins writes it; undone (unset) after the test


def test_a_decorated_estimator_is_validated_and_called_with_what_it_names():
    seen = {}

    @register_adv_estimator("test_sign")
    def sign(*, rewards, loss_mask):
        seen["called"] = True
        return (rewards * 2 - 1)[:, None] * loss_mask, None

    validate_algo_config(AlgoConfig(adv_estimator="test_sign"))
    # the actor offers every input; the estimator gets the two it names
    adv, ret = compute_advantages("test_sign", rewards=REWARDS_T, loss_mask=MASK, group_size=2, gamma=1.0,
                                  values=None, token_rewards=None, reduce=None, group_ids=None)
    assert seen and ret is None and adv[1].tolist() == [-1.0, -1.0, -1.0]
    with pytest.raises(ConfigError, match="test_sign") as ei:  # unknown names list the registered ones
        validate_algo_config(AlgoConfig(adv_estimator="test_sgn"))
    assert ei.value.path == "algo.adv_estimator" and "did you mean 'test_sign'" in str(ei.value)


def test_a_misspelt_input_is_not_swallowed():
    with pytest.raises(TypeError, match=r"unknown input\(s\) \['lamda'\]"):
        compute_advantages("gae", rewards=REWARDS_T, loss_mask=MASK, values=torch.zeros(4, 3), lamda=0.9)
    with pytest.raises(TypeError, match="unknown input"):
        compute_advantages("grpo", rewards=REWARDS_T, loss_mask=MASK, group_size=2, std_levl="batch")


def _kwargs(*, rewards, loss_mask, **kw):
    pass


def _typo(*, rewards, los_mask):
    pass


def _positional(rewards, loss_mask, /):
    pass


@pytest.mark.parametrize("fn,match", [
    (_kwargs, "no \\*args, \\*\\*kwargs"),
    (_typo, "did you mean 'loss_mask'"),
    (_positional, "positional-only"),
])
def test_a_function_taking_what_is_not_an_input_is_refused(fn, match):
    with pytest.raises(RegistrationError, match=match):
        register_adv_estimator("test_bad")(fn)
    assert "test_bad" not in ADV_ESTIMATORS


def test_declarations_must_match_the_function_and_be_known():
    def no_values(*, rewards, loss_mask):
        pass

    def with_values(*, rewards, loss_mask, values):
        pass

    with pytest.raises(RegistrationError, match="needs_values=True but does not take 'values'"):
        register_adv_estimator("test_v1", needs_values=True)(no_values)
    with pytest.raises(RegistrationError, match="needs_values=False but takes 'values'"):
        register_adv_estimator("test_v2")(with_values)
    with pytest.raises(RegistrationError, match="requirements it may declare: .*needs_values"):
        register_adv_estimator("test_v3", need_values=True)(with_values)
    with pytest.raises(RegistrationError, match="already registered"):
        register_adv_estimator("grpo")(no_values)


def test_requirements_come_from_the_declaration():
    def v(*, rewards, loss_mask, values):
        return values, None

    def g(*, rewards, loss_mask, group_size):
        return rewards, None

    register_adv_estimator("test_critic", needs_values=True)(v)
    register_adv_estimator("test_group", group_baseline=True)(g)
    with pytest.raises(ConfigError, match="needs_values") as ei:
        validate_algo_config(AlgoConfig(adv_estimator="test_critic"))
    assert ei.value.path == "algo.use_critic"
    validate_algo_config(AlgoConfig(adv_estimator="test_critic", use_critic=True))
    with pytest.raises(ConfigError, match="ignores values") as ei:
        validate_algo_config(AlgoConfig(adv_estimator="test_group", use_critic=True))
    assert ei.value.path == "algo.adv_estimator"
    with pytest.raises(ConfigError, match="group baseline") as ei:
        validate_group_size(AlgoConfig(adv_estimator="test_group"), 1)
    assert ei.value.path == "rollout.group_size"
    validate_group_size(AlgoConfig(adv_estimator="reinforce_pp"), 1)  # no group statistic: fine


def test_a_policy_loss_without_advantages_needs_no_group_and_no_kl_term():
    @POLICY_LOSSES.register("test_nll", uses_advantages=False)
    def nll(*, logp, loss_mask):
        return torch.where(loss_mask, -logp, torch.zeros_like(logp)), {}

    validate_group_size(AlgoConfig(adv_estimator="grpo", policy_loss="test_nll"), 1)
    logp = torch.full((2, 3), -1.0)
    mb = {"loss_mask": torch.ones(2, 3), "logprobs": logp, "ref_logp": logp - 5}
    loss, stats = actor_loss(logp, None, mb, ActorLossParams(policy_loss="test_nll", kl_coef=1.0))
    assert loss.item() == pytest.approx(1.0) and "kl" not in stats


def test_validate_reads_workflow_and_reward_registries():
    from rollout_fakes import LengthWorkflow

    from areal_cli.config.schema import ExperimentConfig
    from areal_cli.plan.validate import validate
    from areal_cli.config.workflow import WorkflowConfig
    from areal_cli.rewards.registry import register_reward
    from areal_cli.rollout.workflows import register_workflow

    register_workflow("test_length", LengthWorkflow)
    register_reward("test_one", in_process=True)(lambda prompt, completion, answer, **kw: 1.0)
    validate(ExperimentConfig(workflow=WorkflowConfig(name="test_length", reward="test_one")))
    for wcfg, path in [(WorkflowConfig(name="test_lenght"), "workflow.name"),
                       (WorkflowConfig(reward="test_two"), "workflow.reward"),
                       (WorkflowConfig(kwargs={"group_size": 2}), "workflow.kwargs")]:
        with pytest.raises(ConfigError) as ei:
            validate(ExperimentConfig(workflow=wcfg))
        assert ei.value.path == path
    with pytest.raises(RegistrationError, match="not a RolloutWorkflow"):
        register_workflow("test_notwf", ConfigError)


def test_an_in_process_reward_is_called_in_process():
    from areal_cli.config.schema import ExperimentConfig
    from areal_cli.config.workflow import WorkflowConfig
    from areal_cli.rewards.registry import register_reward
    from areal_cli.rollout.build import build_reward_fn

    def one(prompt, completion, answer, **kw):
        return 1.0

    register_reward("test_inproc", in_process=True)(one)
    assert build_reward_fn(ExperimentConfig(workflow=WorkflowConfig(reward="test_inproc"))) is one


def _plugin(tmp_path, monkeypatch, name: str, body: str) -> str:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_load_plugins_registers_and_exports_for_children(tmp_path, monkeypatch):
    mod = _plugin(tmp_path, monkeypatch, "areal_test_plugin_a", """
        from areal_cli.algorithms.registry import register_adv_estimator

        @register_adv_estimator("test_plugin_adv")
        def adv(*, rewards, loss_mask):
            return rewards[:, None] * loss_mask, None
        """)
    load_plugins([mod])
    assert "test_plugin_adv" in ADV_ESTIMATORS and os.environ[PLUGINS_ENV] == mod
    # A child process that inherits the environment knows the name at its first lookup.
    code = "from areal_cli.algorithms.registry import ADV_ESTIMATORS; print(ADV_ESTIMATORS.names()[-1])"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60,
                         check=False)
    assert out.stdout.strip() == "test_plugin_adv", out.stderr


def test_plugin_errors_are_typed_and_bugs_are_not_hidden(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="cannot import plugin module 'no_such_plugin_q'") as ei:
        load_plugins(["areal_cli", "no_such_plugin_q"])
    assert ei.value.path == "plugins[1]" and "PYTHONPATH" in ei.value.hint
    with pytest.raises(ConfigError, match="not a module name") as ei:
        load_plugins(["my-plugin.py"])
    bad = _plugin(tmp_path, monkeypatch, "areal_test_plugin_bad", """
        from areal_cli.algorithms.registry import register_adv_estimator

        @register_adv_estimator("test_bad_plugin")
        def adv(*, rewards, mask):
            pass
        """)
    with pytest.raises(ConfigError, match="malformed entry.*'mask'") as ei:
        load_plugins([bad])
    assert ei.value.path == "plugins[0]"
    # The plugin exists but one of *its* imports is missing: that is its own bug, with its traceback.
    broken = _plugin(tmp_path, monkeypatch, "areal_test_plugin_broken", "import no_such_dependency_q\n")
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_q"):
        load_plugins([broken])
