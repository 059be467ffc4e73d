"""validate() checks the dataset group before launch (data/checks.py): files, columns, knobs, the rule for
remote launchers, and the import targets a config names (workflow, reward, agent)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from areal_cli.plan.compose import load_config
from areal_cli.plan.validate import validate
from areal_cli.errors import ConfigError

SRC = Path(__file__).resolve().parents[3] / "src"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"}]


@pytest.fixture
def jsonl(tmp_path):
    p = tmp_path / "train.jsonl"
    p.write_text("".join(json.dumps({"problem": f"{i}+1?", "solution": f"#### {i + 1}", "messages": CHAT,
                                     "refs": ["1"]}) + "\n" for i in range(3)))
    return str(p)


def check(*overrides):
    return validate(load_config(list(overrides)))


def err(*overrides) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        check(*overrides)
    return e.value


def test_fields_must_be_columns(jsonl):
    e = err(f"dataset.train_path={jsonl}", "dataset.prompt_field=problme", "dataset.answer_field=solution")
    assert e.path == "dataset.prompt_field"
    assert "'problme' is not a column" in e.reason and "columns: problem, solution, messages, refs" in e.reason
    assert e.hint.startswith("did you mean 'problem'?")
    e = err(f"dataset.train_path={jsonl}", "dataset.prompt_field=problem")  # answer_field stays 'answer'
    assert e.path == "dataset.answer_field" and "did you mean" not in e.hint
    plan = check(f"dataset.train_path={jsonl}", "dataset.prompt_field=problem", "dataset.answer_field=solution")
    assert any("no held-out evaluation" in w for w in plan.warnings)


def test_field_kinds(jsonl):
    e = err(f"dataset.train_path={jsonl}", "dataset.prompt_field=refs", "dataset.answer_field=solution")
    assert e.path == "dataset.prompt_field" and "holds list values" in e.reason
    e = err(f"dataset.train_path={jsonl}", "dataset.prompt_field=problem", "dataset.answer_field=refs")
    assert e.path == "dataset.answer_field"
    # a chat column is a prompt, and needs the chat template
    check(f"dataset.train_path={jsonl}", "dataset.prompt_field=messages", "dataset.answer_field=solution")
    e = err(f"dataset.train_path={jsonl}", "dataset.prompt_field=messages", "dataset.answer_field=solution",
            "dataset.use_chat_template=false")
    assert e.path == "dataset.use_chat_template"


def test_missing_file_local_refused_remote_warned(tmp_path):
    gone = str(tmp_path / "gone.jsonl")
    e = err(f"dataset.train_path={gone}")
    assert e.path == "dataset.train_path" and "does not exist" in e.reason
    plan = check(f"dataset.train_path={gone}", "launcher=slurm")
    assert any(w.startswith("dataset.train_path:") and "launcher=slurm" in w and "not visible" in w
               for w in plan.warnings)
    # visible on a remote launcher: checked in full
    ok = tmp_path / "ok.jsonl"
    ok.write_text(json.dumps({"q": "x", "answer": "1"}) + "\n")
    assert err(f"dataset.train_path={ok}", "launcher=ray").path == "dataset.prompt_field"
    # launch-time check: the same rule
    from areal_cli.cli.launch import check_dataset_files

    check_dataset_files(load_config([f"dataset.train_path={gone}", "launcher=skypilot"]))
    with pytest.raises(ConfigError):
        check_dataset_files(load_config([f"dataset.train_path={gone}"]))


def test_held_out_knobs(jsonl, tmp_path):
    base = [f"dataset.train_path={jsonl}", "dataset.prompt_field=problem", "dataset.answer_field=solution"]
    plan = check(*base, "dataset.test_fraction=0.2")
    assert not any("held-out" in w for w in plan.warnings)
    assert err(*base, "dataset.test_fraction=0.2", f"dataset.test_path={jsonl}").path == "dataset.test_fraction"
    assert err("dataset.test_fraction=0.2").path == "dataset.test_fraction"  # the built-in task
    assert err(*base, "dataset.test_fraction=1.0").path == "dataset.test_fraction"  # out of range
    plan = check(*base, "dataset.train_size=50")
    assert any(w.startswith("dataset.train_size=50 has no effect") for w in plan.warnings)


def test_saved_dict_dir_and_its_splits(tmp_path):
    import datasets

    rows = [{"question": f"{i}+1?", "answer": str(i + 1)} for i in range(4)]
    d = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                          "test": datasets.Dataset.from_list(rows[:1])}).save_to_disk(str(d))
    plan = check(f"dataset.train_path={d}")
    assert any(f"dataset.test_path={d}:test" in w for w in plan.warnings)  # the hint names the split
    plan = check(f"dataset.train_path={d}:train", f"dataset.test_path={d}:test")
    assert not any("dataset" in w for w in plan.warnings)
    e = err(f"dataset.train_path={d}", f"dataset.test_path={d}:tests")
    assert e.path == "dataset.test_path" and "did you mean 'test'?" in e.hint


def test_import_targets_are_checked_without_running_them(tmp_path, monkeypatch):
    mod = tmp_path / "my_user_code.py"
    mod.write_text("import no_such_heavy_dependency\n\n"
                   "def my_reward(prompt, completion, answer, **kw):\n    return 1.0\n\n"
                   "async def my_agent(client, data):\n    return 1.0\n\n"
                   "def sync_agent(client, data):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    check("workflow.reward=my_user_code:my_reward")
    check("workflow.reward=my_user_code.my_reward")
    e = err("workflow.reward=my_user_code:my_rewrd")
    assert e.path == "workflow.reward" and "did you mean 'my_reward'?" in e.hint
    assert "no module named 'no_such_pkg'" in err("workflow.reward=no_such_pkg.mod:f").reason
    check("workflow.name=agent", "+workflow.kwargs.agent=my_user_code:my_agent")
    assert err("workflow.name=agent").path == "workflow.kwargs.agent"
    e = err("workflow.name=agent", "+workflow.kwargs.agent=my_user_code:sync_agent")
    assert e.path == "workflow.kwargs.agent" and "not an async function" in e.reason
    e = err("workflow.name=agent", "+workflow.kwargs.agent=my_user_code:my_agnet")
    assert "did you mean 'my_agent'?" in e.hint
    # the proxy workflow's in-process agent is checked the same way
    check("workflow.name=agent_proxy", "+workflow.kwargs.agent=my_user_code:my_agent")
    e = err("workflow.name=agent_proxy", "+workflow.kwargs.agent=my_user_code:sync_agent")
    assert e.path == "workflow.kwargs.agent" and "not an async function" in e.reason
    e = err("workflow.name=agent_proxy")  # neither a command nor an agent
    assert e.path == "workflow.kwargs.command" and "neither" in e.reason
    e = err("workflow.name=agent_proxy", "+workflow.kwargs.agent=my_user_code:my_agent",
            "+workflow.kwargs.command=python a.py")
    assert e.path == "workflow.kwargs.command" and "both" in e.reason
    e = err("workflow.name=my_user_code:NoSuchWorkflow")
    assert e.path == "workflow.name"
    e = err("+workflow.kwargs.use_chat_templat=false")  # rlvr's constructor, read from its source
    assert e.path == "workflow.kwargs" and "did you mean 'use_chat_template'?" in e.hint
    check("workflow=multi_turn", "+workflow.kwargs.max_context_len=64")
    assert "my_user_code" not in sys.modules  # found, never imported


def test_validate_reads_parquet_and_saved_dirs_without_datasets_or_torch(tmp_path):
    import datasets

    rows = [{"question": "1+1?", "answer": "2"}]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dd"))
    code = ("import sys\n"
            "from areal_cli.plan.compose import load_config\n"
            "from areal_cli.plan.validate import validate\n"
            f"validate(load_config(['dataset.train_path={tmp_path / 'd.parquet'}', "
            f"'dataset.test_path={tmp_path / 'dd'}:train']))\n"
            "print(sorted(m for m in ('torch', 'transformers', 'datasets') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
