"""The LLM judge's prompt templates, the reading of its answers, and validate-config's judge rules."""

from __future__ import annotations

import dataclasses

import pytest

from areal_cli.plan.compose import load_config
from areal_cli.plan.validate import validate
from areal_cli.config.workflow import JudgeConfig
from areal_cli.errors import ConfigError
from areal_cli.rewards.judge_prompt import (
    DEFAULT_TEMPLATES,
    NO_REFERENCE,
    Parser,
    Unparseable,
    check_judge_config,
    load_template,
    render,
)


def parser(**kw) -> Parser:
    return Parser.from_config(JudgeConfig(**kw))


@pytest.mark.parametrize("text,score", [
    ("correct", 1.0), ("Incorrect.", 0.0), ("It looks correct at first, but the verdict: INCORRECT", 0.0),
    ("This is incorrect... no wait, it is correct", 1.0),
])
def test_verdict_is_the_last_verdict_word(text, score):
    assert parser()(text) == score


@pytest.mark.parametrize("text", ["", "I cannot tell", "incorrectly", "correctness unclear", "7"])
def test_no_whole_verdict_word_is_unparseable(text):
    with pytest.raises(Unparseable):
        parser()(text)


def test_custom_verdict_words():
    p = parser(verdicts={"yes": 1.0, "partly": 0.5, "no": 0.0})
    assert p("Partly.") == 0.5 and p("no") == 0.0
    with pytest.raises(Unparseable):
        p("correct")


@pytest.mark.parametrize("mode,text,score", [
    ("score", "0.75", 0.75), ("score", "Score: 1", 1.0), ("score", "0 out of 1", 0.0),
    ("score10", "Score: 7/10", 0.7), ("score10", "10", 1.0), ("score10", ".5 points", 0.05),
])
def test_scores(mode, text, score):
    assert parser(parse=mode)(text) == pytest.approx(score)


@pytest.mark.parametrize("mode,text", [("score", "7"), ("score", "-0.5"), ("score10", "11"), ("score", "none"),
                                       ("score10", "")])
def test_out_of_range_or_missing_scores_are_unparseable(mode, text):
    with pytest.raises(Unparseable):
        parser(parse=mode)(text)


def test_regex_picks_where_to_read():
    p = parser(parse="score10", regex=r"FINAL:\s*(\S+)")
    assert p("step 1 gives 3; FINAL: 9") == pytest.approx(0.9)
    with pytest.raises(Unparseable):
        p("9")
    assert parser(regex=r"\[\[(\w+)\]\]")("the answer is correct? [[incorrect]]") == 0.0


def test_default_templates_render_every_field():
    for mode, t in DEFAULT_TEMPLATES.items():
        assert load_template("", mode) == t
        text = render(t, "Q?", "R!", "#### 4")
        assert "Q?" in text and "R!" in text and "#### 4" in text
    assert NO_REFERENCE in render(DEFAULT_TEMPLATES["verdict"], "Q?", "R!", None)


def test_template_from_text_and_file(tmp_path):
    assert load_template("Grade {response} for {question}; {{json}}", "verdict").startswith("Grade")
    f = tmp_path / "judge.txt"
    f.write_text("Q: {question}\nA: {response}\nRef: {reference}\n")
    t = load_template(str(f), "verdict")
    assert render(t, "q", "a", "r") == "Q: q\nA: a\nRef: r\n"


@pytest.mark.parametrize("template,words", [
    ("Grade {answer}", "unknown placeholder {answer}"),
    ("Grade {question} only", "no {response}"),
    ("Grade {response:>10}", "formats {response}"),
    ("Grade {response", "does not parse"),
    ("/no/such/judge_template.txt", "neither a file nor a template"),
])
def test_bad_templates_are_refused(template, words):
    with pytest.raises(ConfigError, match="workflow.judge.template") as e:
        load_template(template, "verdict")
    assert words in str(e.value)


@pytest.mark.parametrize("change,path,words", [
    ({"on_failure": "skip"}, "workflow.judge.on_failure", "unknown value 'skip'"),
    ({"after_retries": "retry"}, "workflow.judge.after_retries", "unknown value"),
    ({"parse": "stars"}, "workflow.judge.parse", "unknown value"),
    ({"server": "url"}, "workflow.judge.base_url", "needs the judge's address"),
    ({"server": "url", "base_url": "localhost:8000"}, "workflow.judge.base_url", "needs the judge's address"),
    ({"verdicts": {}}, "workflow.judge.verdicts", "no verdict words"),
    ({"verdicts": {"correct": 2.0}}, "workflow.judge.verdicts.correct", "not a number in [0, 1]"),
    ({"regex": "("}, "workflow.judge.regex", "not a regular expression"),
    ({"regex": "(a)(b)"}, "workflow.judge.regex", "2 groups"),
    ({"template": "{answer}"}, "workflow.judge.template", "unknown placeholder"),
    ({"rule": "math"}, "workflow.judge.rule", "not a cheap in-process rule reward"),
    ({"rule": "judge"}, "workflow.judge.rule", "not a cheap in-process rule reward"),
])
def test_check_judge_config_refuses_nonsense(change, path, words):
    j = dataclasses.replace(JudgeConfig(), **change)
    with pytest.raises(ConfigError) as e:
        check_judge_config(j, workflow="rlvr", inference_names=[None])
    assert e.value.path == path and words in str(e.value)


def test_drop_needs_the_rlvr_workflow_and_a_judge_component_is_refused():
    for j in (JudgeConfig(on_failure="drop"), JudgeConfig(on_failure="retry", after_retries="drop")):
        check_judge_config(j, workflow="rlvr", inference_names=[None])
        with pytest.raises(ConfigError, match="supported by workflow rlvr"):
            check_judge_config(j, workflow="multi_turn", inference_names=[None])
    with pytest.raises(ConfigError, match="separately launched judge is not built yet"):
        check_judge_config(JudgeConfig(), workflow="rlvr", inference_names=["rollout", "judge"])


def test_validate_config_runs_the_judge_rules():
    ok = validate(load_config(["workflow.reward=judge", "workflow.judge.rule=numeric"]))
    assert ok.inferences
    with pytest.raises(ConfigError, match="workflow.judge.on_failure"):
        validate(load_config(["workflow.reward=judge", "workflow.judge.on_failure=sometimes"]))
    # A judge is not checked when the reward is something else.
    validate(load_config(["workflow.reward=numeric", "workflow.judge.on_failure=sometimes"]))
