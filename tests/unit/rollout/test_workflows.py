"""Built-in workflows (RLVR, multi-turn) and workflow loading: tiny tokenizer, scripted fake engine."""

from __future__ import annotations

import asyncio

import pytest
import torch
from rollout_fakes import fake_logprob

from areal_cli.api.io_struct import GenerationConfig
from areal_cli.errors import ConfigError, DataError
from areal_cli.rollout.workflows import build_workflow, load_workflow, resolve_workflow
from areal_cli.rollout.workflows.common import render_chat
from areal_cli.rollout.workflows.multi_turn import MultiTurnWorkflow
from areal_cli.rollout.workflows.rlvr import RLVRWorkflow


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


async def exact_reward(prompt: str, completion: str, answer) -> float:
    return 1.0 if completion.strip() == str(answer) else 0.0


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def run(coro):
    return asyncio.run(coro)


MSG = [{"role": "user", "content": "What is 2+3?"}]


def test_rlvr_group_tensors(fake_engine, tok):
    eos = tok.eos_token_id
    eng = fake_engine(token_delay=0)
    eng.scripted = [enc(tok, "5") + [eos], enc(tok, "6") + [eos], enc(tok, "5 5 5 5")]  # last: truncated
    budget = len(enc(tok, "5 5 5 5"))
    wf = RLVRWorkflow(exact_reward, GenerationConfig(max_new_tokens=budget), tok, group_size=3)
    traj = run(wf.arun_episode(eng, {"messages": MSG, "answer": "5", "id": "q1"}))
    prompt_ids = enc(tok, render_chat(tok, MSG, add_generation_prompt=True))
    P = len(prompt_ids)
    d = traj.data
    assert len(traj) == 3 and eng.n_requests == 3
    assert d["rewards"].tolist() == [1.0, 0.0, 0.0]
    assert d["seq_no_eos_mask"].tolist() == [False, False, True]
    assert d["group_id"].unique().numel() == 1
    assert traj.meta["id"] == "q1" and traj.meta["prompt_len"] == P
    outs = [enc(tok, "5") + [eos], enc(tok, "6") + [eos], enc(tok, "5 5 5 5")]
    width = P + max(len(o) for o in outs)
    assert d["input_ids"].shape == (3, width)
    for r, o in enumerate(outs):
        n = len(o)
        assert d["input_ids"][r, :P].tolist() == prompt_ids
        assert d["input_ids"][r, P:P + n].tolist() == o
        assert d["input_ids"][r, P + n:].tolist() == [tok.pad_token_id] * (width - P - n)
        assert d["loss_mask"][r].tolist() == [False] * P + [True] * n + [False] * (width - P - n)
        assert d["attention_mask"][r].tolist() == [True] * (P + n) + [False] * (width - P - n)
        assert d["versions"][r].tolist() == [-1] * P + [0] * n + [-1] * (width - P - n)
        want_lp = [fake_logprob(t, i) for i, t in enumerate(o)]
        assert d["logprobs"][r, P:P + n].tolist() == pytest.approx(want_lp)
        assert torch.all(d["logprobs"][r, :P] == 0)
    assert d["attention_mask"].dtype == torch.bool and d["loss_mask"].dtype == torch.bool


def test_rlvr_stops_on_eos_even_if_gconfig_does_not_say_so(tok):
    wf = RLVRWorkflow(exact_reward, GenerationConfig(max_new_tokens=8), tok, group_size=1)
    assert tok.eos_token_id in wf.gconfig.stop_token_ids and wf.gconfig.n == 1


@pytest.mark.parametrize("key", ["prompt", "prompt_ids", "raw"])
def test_rlvr_prompt_keys(fake_engine, tok, key):
    text = "What is 2+3?"
    templated = enc(tok, render_chat(tok, [{"role": "user", "content": text}], add_generation_prompt=True))
    if key == "prompt":
        data, want, use_t = {"prompt": text, "answer": "5"}, templated, True
    elif key == "prompt_ids":
        data, want, use_t = {"prompt_ids": templated, "answer": "5"}, templated, True
    else:
        data, want, use_t = {"prompt": text, "answer": "5"}, enc(tok, text), False
    seen = []

    async def reward(prompt, completion, answer):
        seen.append((prompt, completion, answer))
        return 0.5

    eng = fake_engine(token_delay=0)
    eng.scripted = [enc(tok, "5") + [tok.eos_token_id]]
    wf = RLVRWorkflow(reward, GenerationConfig(max_new_tokens=4), tok, group_size=1, use_chat_template=use_t)
    traj = run(wf.arun_episode(eng, data))
    assert traj.data["input_ids"][0, :len(want)].tolist() == want
    assert traj.data["rewards"].tolist() == [0.5]
    assert seen[0][1:] == ("5", "5")
    assert "2+3" in seen[0][0]


def test_rlvr_sync_reward_runs_in_a_thread(fake_engine, tok):
    import threading

    threads = []

    def reward(prompt, completion, answer):
        threads.append(threading.current_thread().name)
        return 1

    eng = fake_engine(token_delay=0)
    wf = RLVRWorkflow(reward, GenerationConfig(max_new_tokens=2), tok, group_size=2)
    traj = run(wf.arun_episode(eng, {"prompt": "hi", "answer": None}))
    assert traj.data["rewards"].tolist() == [1.0, 1.0]
    assert threading.main_thread().name not in threads


def test_rlvr_bad_inputs(fake_engine, tok):
    wf = RLVRWorkflow(exact_reward, GenerationConfig(max_new_tokens=2), tok, group_size=1)
    with pytest.raises(DataError, match="prompt_ids"):
        run(wf.arun_episode(fake_engine(), {"question": "x"}))
    with pytest.raises(ConfigError) as ei:
        RLVRWorkflow(exact_reward, GenerationConfig(), tok, group_size=0)
    assert ei.value.path == "rollout.group_size"
    with pytest.raises(ConfigError):
        RLVRWorkflow("not callable", GenerationConfig(), tok)


def test_multi_turn_retry_sequence_is_the_rendered_chat(fake_engine, tok):
    eos = tok.eos_token_id
    eng = fake_engine(token_delay=0)
    first, second = enc(tok, "6") + [eos], enc(tok, "5") + [eos]
    eng.scripted = [first, second]
    fb = "Your answer is wrong. Try again."
    wf = MultiTurnWorkflow(exact_reward, GenerationConfig(max_new_tokens=4), tok, group_size=1, max_turns=3,
                           turn_discount=0.5, feedback=fb)
    traj = run(wf.arun_episode(eng, {"messages": MSG, "answer": "5"}))
    d = traj.data
    assert d["rewards"].tolist() == [0.5]  # right on turn 2 → 1.0 * 0.5**1
    assert d["n_turns"].tolist() == [2] and traj.meta["raw_rewards"] == [1.0]
    full = render_chat(tok, MSG + [{"role": "assistant", "content": "6"}, {"role": "user", "content": fb},
                                   {"role": "assistant", "content": "5"}], add_generation_prompt=False)
    ids = d["input_ids"][0].tolist()
    assert tok.decode(ids, skip_special_tokens=False) + "\n" == full
    P = len(enc(tok, render_chat(tok, MSG, add_generation_prompt=True)))
    tail = enc(tok, "\n<|im_start|>user\n" + fb + "<|im_end|>\n<|im_start|>assistant\n")
    want_mask = [False] * P + [True] * len(first) + [False] * len(tail) + [True] * len(second)
    assert d["loss_mask"][0].tolist() == want_mask
    assert ids[P + len(first):P + len(first) + len(tail)] == tail
    v = d["versions"][0].tolist()
    assert [x for x, m in zip(v, want_mask) if not m] == [-1] * (P + len(tail))
    lp = d["logprobs"][0]
    assert torch.all(lp[~d["loss_mask"][0]] == 0) and torch.all(lp[d["loss_mask"][0]] < 0)
    assert d["seq_no_eos_mask"].tolist() == [False]


def test_multi_turn_stops_when_right_and_gives_up_after_max_turns(fake_engine, tok):
    eos = tok.eos_token_id
    eng = fake_engine(token_delay=0)
    eng.scripted = [enc(tok, "5") + [eos]] + [enc(tok, "7") + [eos]] * 2
    wf = MultiTurnWorkflow(exact_reward, GenerationConfig(max_new_tokens=4), tok, group_size=2, max_turns=2)
    traj = run(wf.arun_episode(eng, {"prompt": "What is 2+3?", "answer": "5"}))
    assert sorted(traj.data["n_turns"].tolist()) == [1, 2]
    r = dict(zip(traj.data["n_turns"].tolist(), traj.data["rewards"].tolist()))
    assert r == {1: 1.0, 2: 0.0}
    assert eng.n_requests == 3


def test_multi_turn_truncated_answer_gets_a_closing_token_outside_the_loss(fake_engine, tok):
    eng = fake_engine(token_delay=0)
    trunc = enc(tok, "6 6")
    eng.scripted = [trunc, enc(tok, "5") + [tok.eos_token_id]]
    wf = MultiTurnWorkflow(exact_reward, GenerationConfig(max_new_tokens=len(trunc)), tok, max_turns=2,
                           turn_discount=0.9)
    traj = run(wf.arun_episode(eng, {"messages": MSG, "answer": "5"}))
    P = len(enc(tok, render_chat(tok, MSG, add_generation_prompt=True)))
    ids = traj.data["input_ids"][0].tolist()
    after = P + len(trunc)
    assert ids[after] == tok.eos_token_id and not traj.data["loss_mask"][0, after]
    assert traj.data["rewards"].tolist() == [pytest.approx(0.9)]


def test_multi_turn_config_errors(tok):
    for kw, path in [({"max_turns": 0}, "workflow.max_turns"),
                     ({"turn_discount": 0.0}, "workflow.turn_discount")]:
        with pytest.raises(ConfigError) as ei:
            MultiTurnWorkflow(exact_reward, GenerationConfig(), tok, **kw)
        assert ei.value.path == path


def test_load_builtin_and_user_workflows(length_workflow, tok, tiny_model_dir):
    wf = load_workflow("rlvr", reward_fn=exact_reward, gconfig=GenerationConfig(), tokenizer=tiny_model_dir,
                       group_size=2)
    assert isinstance(wf, RLVRWorkflow) and wf.group_size == 2
    assert isinstance(load_workflow("rollout_fakes.LengthWorkflow"), length_workflow)
    assert isinstance(load_workflow("rollout_fakes:LengthWorkflow"), length_workflow)
    mt = build_workflow("multi_turn", reward_fn=exact_reward, gconfig=GenerationConfig(), tokenizer=tok,
                        group_size=1, max_turns=3, turn_discount=0.8)
    assert isinstance(mt, MultiTurnWorkflow) and mt.max_turns == 3 and mt.turn_discount == 0.8
    # a user workflow that takes nothing gets nothing it did not ask for
    assert isinstance(build_workflow("rollout_fakes.LengthWorkflow", reward_fn=exact_reward,
                                     gconfig=GenerationConfig(), tokenizer=tok, group_size=4), length_workflow)


@pytest.mark.parametrize("name,match", [
    ("nope", "unknown workflow"),
    ("no_such_pkg_xyz.Mod", "cannot import"),
    ("rollout_fakes.Missing", "no attribute"),
    ("rollout_fakes.FakeEngine", "not a RolloutWorkflow"),
])
def test_workflow_resolution_errors(name, match):
    with pytest.raises(ConfigError, match=match) as ei:
        resolve_workflow(name)
    assert ei.value.path == "workflow.name"


def test_unknown_kwarg_is_config_error():
    with pytest.raises(ConfigError) as ei:
        load_workflow("rollout_fakes.LengthWorkflow", temperature=3)
    assert ei.value.path == "workflow.kwargs"


def test_rlvr_through_the_executor(fake_engine, tok):
    from areal_cli.rollout import RolloutExecutor

    eng = fake_engine(token_delay=0.001)
    wf = RLVRWorkflow(exact_reward, GenerationConfig(max_new_tokens=3), tok, group_size=4)
    ex = RolloutExecutor(eng, wf, batch_size=2, max_concurrent=4, max_head_offpolicyness=1,
                         pad_token_id=tok.pad_token_id)
    try:
        data = [{"prompt": f"What is {i}+1?", "answer": str(i + 1), "id": i} for i in range(6)]
        batch = ex.prepare_batch(data, timeout=20)
        assert len(batch) == 8  # 2 episodes x 4 samples
        gids = batch.data["group_id"].tolist()
        assert len(set(gids)) == 2 and gids[:4] == [gids[0]] * 4
    finally:
        ex.destroy()


def test_build_workflow_from_config(tok):
    """The trainer's wiring (trainer/build.py, the one production path): workflow.* and rollout.*
    reach the constructor, the generation config stops on EOS, and bad kwargs are config errors."""
    from areal_cli.config.rollout import GenerationSettings, RolloutConfig
    from areal_cli.config.schema import ExperimentConfig
    from areal_cli.config.workflow import WorkflowConfig
    from areal_cli.rollout.build import build_workflow

    rcfg = RolloutConfig(group_size=3, gconfig=GenerationSettings(temperature=0.7, max_new_tokens=9))
    wcfg = WorkflowConfig(name="multi_turn", max_turns=4, turn_discount=0.5, feedback="Nope.",
                          kwargs={"success_threshold": 0.5})
    wf = build_workflow(ExperimentConfig(workflow=wcfg, rollout=rcfg), tok, reward_fn=exact_reward)
    assert isinstance(wf, MultiTurnWorkflow)
    got = (wf.group_size, wf.max_turns, wf.turn_discount, wf.feedback, wf.success_threshold)
    assert got == (3, 4, 0.5, "Nope.", 0.5)
    assert (wf.gconfig.temperature, wf.gconfig.max_new_tokens, wf.gconfig.n) == (0.7, 9, 1)
    assert tok.eos_token_id in wf.gconfig.stop_token_ids
    for kwargs, match in [({"bogus": 3}, "does not accept"), ({"max_turns": 3}, "own config keys")]:
        with pytest.raises(ConfigError, match=match) as ei:
            build_workflow(ExperimentConfig(workflow=WorkflowConfig(name="rlvr", kwargs=kwargs), rollout=rcfg),
                           tok, reward_fn=exact_reward)
        assert ei.value.path == "workflow.kwargs"


def test_build_reward_fn_rejects_unknown_reward_before_spawning():
    from areal_cli.config.schema import ExperimentConfig
    from areal_cli.config.workflow import WorkflowConfig
    from areal_cli.rollout.build import build_reward_fn

    with pytest.raises(ConfigError) as ei:
        build_reward_fn(ExperimentConfig(workflow=WorkflowConfig(reward="no_such_reward")))
    assert ei.value.path == "workflow.reward"


def test_the_user_workflow_example_in_the_docs_runs(fake_engine, tok, tmp_path, monkeypatch):
    """docs/rollout.md's EchoWorkflow, loaded by import path the way workflow.name does it."""
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[3] / "docs" / "rollout.md").read_text()
    code = re.search(r"```python\n(# my_pkg/wf\.py.*?)```", doc, re.S).group(1)
    pkg = tmp_path / "my_doc_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "wf.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    wf = build_workflow("my_doc_pkg.wf.EchoWorkflow", reward_fn=exact_reward,
                        gconfig=GenerationConfig(max_new_tokens=3), tokenizer=tok, group_size=4)
    traj = run(wf.arun_episode(fake_engine(token_delay=0), {"prompt": "hi"}))
    assert len(traj) == 1 and traj.data["rewards"].tolist() == [1.0]
    assert int(traj.data["loss_mask"].sum()) == 3


def test_the_online_workflow_gets_the_run_dir_from_the_trainers_wiring(tok, tmp_path):
    """``run_dir`` is an offered piece, not an environment variable: the online workflow built by the
    trainer's wiring writes its gateway file into the run dir it was handed, and refuses it as a kwarg."""
    from areal_cli.config.rollout import RolloutConfig
    from areal_cli.config.schema import ExperimentConfig
    from areal_cli.config.workflow import WorkflowConfig
    from areal_cli.rollout.build import build_workflow

    cfg = ExperimentConfig(workflow=WorkflowConfig(name="online"), rollout=RolloutConfig(group_size=1))
    wf = build_workflow(cfg, tok, reward_fn=exact_reward, run_dir=str(tmp_path))
    assert wf.gateway_file == str(tmp_path / "gateway.json")
    assert build_workflow(cfg, tok, reward_fn=exact_reward).gateway_file is None
    bad = ExperimentConfig(workflow=WorkflowConfig(name="online", kwargs={"run_dir": "/x"}),
                           rollout=RolloutConfig(group_size=1))
    with pytest.raises(ConfigError, match="own config keys"):
        build_workflow(bad, tok, reward_fn=exact_reward)
