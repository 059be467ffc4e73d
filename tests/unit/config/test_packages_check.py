"""The pre-launch package check (plan/packages.py) inside ``validate()``: a plan that runs here without its
engine's or backend's package is refused in one line naming the config path, this Python and the extra; a plan
for a cluster only warns; installed packages pass. Packages are hidden the way an absent one looks
(tests/support/hide_packages.py), so the check itself runs unchanged."""

from __future__ import annotations

import sys

import pytest
from hide_packages import install

from areal_cli.plan import packages
from areal_cli.plan.compose import load_config
from areal_cli.plan.validate import validate
from areal_cli.errors import ConfigError


@pytest.fixture
def hide(monkeypatch):
    """``hide("megatron", ...)``: those packages are absent for the rest of the test."""

    def _hide(*names: str) -> None:
        for mod in [m for m in sys.modules if m.partition(".")[0] in names]:
            monkeypatch.delitem(sys.modules, mod)  # an imported module answers find_spec without a finder
        monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))  # teardown puts the original list back
        install(names)  # wraps the finders of the copy, in place

    return _hide


def refused(*overrides: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        validate(load_config(list(overrides)))
    return info.value


def test_findable_finds_installed_modules_and_submodules_and_not_absent_ones():
    assert packages.findable("json") and packages.findable("email.mime") and packages.findable("torch")
    assert not packages.findable("areal_no_such_package")
    assert not packages.findable("json.no_such_submodule")
    assert not packages.findable("areal_no_such_package.core")


def test_findable_imports_nothing_not_even_the_parent_package(tmp_path, monkeypatch):
    """A submodule is looked up inside its parent's directories: the parent's __init__ never runs."""
    pkg = tmp_path / "areal_probe_parent"
    (pkg / "core").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('the check imported the package')\n")
    (pkg / "core" / "__init__.py").write_text("raise RuntimeError('the check imported the submodule')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert packages.findable("areal_probe_parent.core")
    assert not packages.findable("areal_probe_parent.other")
    assert "areal_probe_parent" not in sys.modules and "areal_probe_parent.core" not in sys.modules


@pytest.mark.parametrize("overrides, path, dist, extra", [
    (["engine=megatron"], "engine.name", "megatron-core", "areal-cli[megatron]"),
    (["engine=deepspeed"], "engine.name", "deepspeed", "areal-cli[deepspeed]"),
    (["allocation_mode=sglang:d1+fsdp:d1"], "allocation_mode.spec", "sglang", "areal-cli[sglang]"),
])
def test_a_local_plan_without_its_package_is_refused(hide, overrides, path, dist, extra):
    hide("megatron", "deepspeed", "sglang")
    e = refused(*overrides)
    assert e.path == path
    assert f"needs {dist}, which is not installed in this Python ({sys.executable})" in e.reason
    assert extra in e.hint and "scripts/install.sh" in e.hint
    assert "\n" not in str(e)


def test_a_config_mistake_is_named_before_a_missing_package(hide):
    hide("megatron")
    e = refused("engine=megatron", "allocation_mode=hf:d1+megatron:d1t3")
    assert e.path == "allocation_mode.spec" and "t=3" in e.reason


@pytest.mark.parametrize("where", [
    ["cluster=gpu_2x8"],  # several nodes: the cluster's nodes run it
    ["launcher=slurm"],
    ["launcher=skypilot"],
])
def test_a_plan_for_a_cluster_only_warns(hide, where):
    hide("megatron", "sglang")
    plan = validate(load_config(["engine=megatron", "allocation_mode=sglang:d1+megatron:d1", *where]))
    notes = [w for w in plan.warnings if "not installed" in w]
    assert any(w.startswith("engine.name: engine=megatron needs megatron-core") and "areal-cli[megatron]" in w
               and "nodes that run this plan" in w for w in notes), plan.warnings
    assert any(w.startswith("allocation_mode.spec: the sglang inference backend needs sglang") for w in notes)


def test_a_gpu_plan_drafted_on_a_machine_without_a_gpu_only_warns(hide):
    from areal_cli.config.where import has_cuda_driver

    if has_cuda_driver():
        pytest.skip("this machine has an NVIDIA GPU: a one-node cuda plan runs here")
    hide("sglang")
    plan = validate(load_config(["cluster=gpu_1x8", "allocation_mode=sglang:d4+fsdp:d4"]))
    assert any("needs sglang" in w for w in plan.warnings), plan.warnings


def test_a_launcher_package_is_a_warning_for_areal_train_to_refuse(hide):
    hide("ray")
    plan = validate(load_config(["launcher=ray"]))
    assert any(w.startswith("launcher.name: launcher=ray needs ray") and "needed here at `areal train`" in w
               and "areal-cli[ray]" in w for w in plan.warnings), plan.warnings


def test_installed_packages_pass():
    """This machine's own packages: the default plan (torch), and megatron/deepspeed where installed."""
    plan = validate(load_config([]))
    assert not [w for w in plan.warnings if "not installed" in w]
    for engine, module in (("megatron", "megatron.core"), ("deepspeed", "deepspeed")):
        if packages.findable(module):
            plan = validate(load_config([f"engine={engine}"]))
            assert not [w for w in plan.warnings if "not installed" in w]


def _venv_with(tmp_path, module: str) -> str:
    """A real venv (its python a symlink to this base interpreter) whose site-packages holds ``module``."""
    import venv

    root = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False, symlinks=True).create(root)
    (site,) = root.glob("lib/python*/site-packages")
    (site / module).mkdir()
    (site / module / "__init__.py").write_text("")
    return str(root / "bin" / "python")


def test_vllm_is_looked_for_in_the_interpreter_that_runs_it(tmp_path, monkeypatch):
    spec = ["allocation_mode=vllm:d1+fsdp:d1"]
    monkeypatch.setenv("AREAL_VLLM_PYTHON", _venv_with(tmp_path, "vllm"))
    plan = validate(load_config(spec))
    assert not [w for w in plan.warnings if "not installed" in w]
    missing = str(tmp_path / "no_venv" / "bin" / "python")
    monkeypatch.setenv("AREAL_VLLM_PYTHON", missing)
    e = refused(*spec)
    assert e.path == "allocation_mode.spec"
    assert f"needs vllm, which is not installed in the interpreter that runs it ({missing})" in e.reason
    assert "AREAL_VLLM_PYTHON" in e.hint
