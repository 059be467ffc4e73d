"""``workflow.reward_model`` (a trained reward model scoring RL samples): every knob honoured or refused in one
line, its weights in the memory estimate, and the pure combination and normalisation of the scores."""

from __future__ import annotations

import shutil

import pytest
import torch

from areal_cli.errors import ConfigError
from areal_cli.plan.compose import load_config
from areal_cli.plan.validate import validate

KEY = "workflow.reward_model"


@pytest.fixture(scope="module")
def rm_export(tmp_path_factory, tiny_model_dir) -> str:
    """The tiny model's dir with a value head: what the checks read of an algo=rm export."""
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("rm") / "final"
    shutil.copytree(tiny_model_dir, d)
    save_file({"weight": torch.zeros(1, 8), "bias": torch.zeros(1)}, str(d / "value_head.safetensors"))
    return str(d)


@pytest.fixture(scope="module")
def foreign_rm(tmp_path_factory) -> str:
    from safetensors.torch import save_file

    from areal_cli.models.tiny import make_tiny_model

    corpus = [f"the quick brown fox {i} jumps over {i * 7} lazy dogs; zebras graze." for i in range(300)]
    d = make_tiny_model(tmp_path_factory.mktemp("rm_foreign"), corpus=corpus, seed=0)
    save_file({"weight": torch.zeros(1, 8), "bias": torch.zeros(1)}, f"{d}/value_head.safetensors")
    return d


def base(tiny_model_dir: str) -> list[str]:
    return [f"model.path={tiny_model_dir}", "trainer.sft_warmup_steps=0"]


def err(*overrides: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        validate(load_config(list(overrides)))
    assert "\n" not in str(info.value)
    return info.value


def test_off_by_default_and_a_valid_export_plans_with_a_note(tiny_model_dir, rm_export):
    assert not load_config(base(tiny_model_dir)).workflow.reward_model.enabled
    plan = validate(load_config([*base(tiny_model_dir), f"{KEY}.path={rm_export}", f"{KEY}.combine=rm_only"]))
    note = [n for n in plan.notes if n.startswith(KEY)]
    assert len(note) == 1 and "colocated with the actor" in note[0] and "1 × score" in note[0]


@pytest.mark.parametrize("overrides,path,words", [
    (["algo=sft"], f"{KEY}.path", "samples no completions"),
    ([f"{KEY}.combine=max"], f"{KEY}.combine", "unknown value 'max'"),
    ([f"{KEY}.normalize=group"], f"{KEY}.normalize", "unknown value 'group'"),
    ([f"{KEY}.combine=rm_only", f"{KEY}.rule_weight=0.5"], f"{KEY}.rule_weight", "rm_only leaves out"),
    (["workflow=multi_turn"], f"{KEY}.path", "workflow=multi_turn"),
    (["algo.dynamic_sampling=true"], "algo.dynamic_sampling", "before the trainer's reward model"),
    (["allocation_mode.spec=hf:d1+fsdp[actor]:d1+fsdp[rm]:d1", "cluster.n_gpus_per_node=3"],
     "allocation_mode.spec", "colocated with the actor"),
])
def test_each_mistake_is_one_line(tiny_model_dir, rm_export, overrides, path, words):
    e = err(*base(tiny_model_dir), f"{KEY}.path={rm_export}", *overrides)
    assert e.path == path and words in str(e)


def test_the_path_must_be_a_reward_model_export(tiny_model_dir, tmp_path):
    e = err(*base(tiny_model_dir), f"{KEY}.path={tiny_model_dir}")  # a policy: no value head
    assert e.path == f"{KEY}.path" and "not a reward-model export" in str(e) and "algo=rm" in e.hint
    e = err(*base(tiny_model_dir), f"{KEY}.path={tmp_path}")
    assert e.path == f"{KEY}.path" and "no config.json" in str(e)
    e = err(*base(tiny_model_dir), f"{KEY}.path=builtin:tiny")
    assert "not a reward model" in str(e)


def test_a_reward_model_with_another_tokenizer_is_refused(tiny_model_dir, foreign_rm):
    e = err(*base(tiny_model_dir), f"{KEY}.path={foreign_rm}")
    assert e.path == f"{KEY}.path" and "reward model" in str(e) and "cannot score the student's tokens" in str(e)


def test_an_engine_without_a_critic_path_is_refused(tiny_model_dir, rm_export, tmp_path, monkeypatch):
    (tmp_path / "rm_loop_plain_engine.py").write_text(
        "from areal_cli.api.engine_api import TrainEngine\n\n\nclass Engine(TrainEngine):\n    dims = 'd'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    e = err(*base(tiny_model_dir), f"{KEY}.path={rm_export}", "engine.name=rm_loop_plain_engine:Engine")
    assert e.path == f"{KEY}.path" and "no critic path" in str(e)


def test_reward_model_counts_in_the_memory_and_time_estimates(tiny_model_dir, rm_export):
    from areal_cli.allocation.estimate import ModelFacts
    from areal_cli.plan.reward_model import rm_size_ratio
    from areal_cli.planner.memory import trainer_memory
    from areal_cli.planner.timing import train_passes

    off = load_config([*base(tiny_model_dir), "algo.kl_coef=0"])
    on = load_config([*base(tiny_model_dir), "algo.kl_coef=0", f"{KEY}.path={rm_export}"])
    ratio = rm_size_ratio(on)
    assert rm_size_ratio(off) == 0.0 and ratio == pytest.approx(1.0)  # the export is the policy's size
    part_off, part_on = validate(off).trains[0], validate(on).trains[0]
    facts = ModelFacts.from_config(on.model)
    w_off = trainer_memory(off, part_off, facts, 0.0).weights_gb
    w_on = trainer_memory(on, part_on, facts, 0.0).weights_gb
    assert w_on == pytest.approx(w_off + ratio * part_on.memory.weights_gb)
    assert train_passes(on)[1] == pytest.approx(train_passes(off)[1] + ratio)


def test_combine_rewards():
    from areal_cli.algorithms.rm_reward import combine_rewards

    rule = torch.tensor([1.0, 0.0, 1.0, 0.0])
    score = torch.tensor([0.5, 2.0, -1.0, -3.0])
    torch.testing.assert_close(combine_rewards(rule, score, "rm_only", 2.0, 1.0), 2 * score)
    torch.testing.assert_close(combine_rewards(rule, score, "sum", 2.0, 0.5),
                               torch.tensor([1.5, 4.0, -1.5, -6.0]))
    # gate: the reward model only ranks what the rule passed; a failed row keeps the rule's reward
    torch.testing.assert_close(combine_rewards(rule, score, "gate", 2.0, 0.5),
                               torch.tensor([1.5, 0.0, -1.5, 0.0]))
    with pytest.raises(ValueError):
        combine_rewards(rule, score, "max", 1.0, 1.0)


def test_normalize_scores_over_the_batch_and_its_replicas():
    from areal_cli.algorithms.rm_reward import normalize_scores, score_moments

    s = torch.tensor([1.0, 2.0, 3.0, 6.0])
    rule = torch.tensor([0.0, 1.0, 1.0, 0.0])

    def normalize(x, r, how, reduce=None):
        n, mean, std, _ = score_moments(x, r, reduce)
        return normalize_scores(x, how, n, mean, std)

    assert torch.equal(normalize(s, rule, "none"), s)
    want = (s - s.mean()) / (s.std() + 1e-6)
    torch.testing.assert_close(normalize(s, rule, "batch"), want)
    assert score_moments(s, rule)[3] == 0.5  # the rule's mean rides in the same reduction
    # two replicas, each with half the rows: the reducer's sums give every replica the whole batch's stats
    halves = [(s[:2], rule[:2]), (s[2:], rule[2:])]

    def reduce(t):
        return sum(torch.stack([torch.tensor(float(h.numel()), dtype=torch.float64), h.double().sum(),
                                (h.double() ** 2).sum(), r.double().sum()]) for h, r in halves)

    torch.testing.assert_close(torch.cat([normalize(h, r, "batch", reduce) for h, r in halves]), want)
    assert score_moments(*halves[0], reduce)[3] == 0.5


def test_rows_read_as_a_rendered_chat_turn(tiny_model_dir):
    from transformers import AutoTokenizer

    from areal_cli.algorithms.rm_reward import rm_rows, turn_close_ids

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    close = turn_close_ids(tok, True)
    text = tok.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                                   tokenize=False)
    assert close and text.endswith(tok.decode(close))
    assert turn_close_ids(tok, False) == []
    ids = torch.tensor([[5, 6, tok.eos_token_id, 0], [5, 6, 7, 8]])
    attn = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    rows = rm_rows({"input_ids": ids, "attention_mask": attn}, close, tok.eos_token_id, 99)
    n0, n1 = int(rows["attention_mask"][0].sum()), int(rows["attention_mask"][1].sum())
    assert rows["input_ids"][0, :n0].tolist() == [5, 6, *close, 99]  # eos off, the template's close on
    assert rows["input_ids"][1, :n1].tolist() == [5, 6, 7, 8, *close, 99]  # a truncated completion is closed
    assert rows["loss_mask"][0, n0 - 1] == 1 and rows["loss_mask"].sum() == 2
