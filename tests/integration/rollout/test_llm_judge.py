"""The LLM judge (rewards/judge.py) over real HTTP against a deterministic judge server
(tests/support/judge_server.py): every failure kind gets its configured outcome and is counted;
parsed verdicts and scores; the concurrency bound; the rule reward; the stop after failures in a row;
the RLVR workflow dropping a group. The real hf server as a judge is in tests/integration/cli/test_train_judge.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket

import pytest
from judge_server import JudgeServer

from areal_cli.api.io_struct import GenerationConfig
from areal_cli.config.workflow import JudgeConfig
from areal_cli.rewards.judge import JudgeDown, JudgeReward
from areal_cli.rewards.outcome import Reward, correctness, is_dropped

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server():
    srv = JudgeServer()
    yield srv
    srv.close()


def _closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # bound then released: nothing listens there


def judge(base_url: str, **kw) -> JudgeReward:
    return JudgeReward(JudgeConfig(server="url", base_url=base_url, **kw))


async def _score(j: JudgeReward, *calls: tuple[str, str, object]) -> list[float]:
    try:
        return list(await asyncio.gather(*(j(*c) for c in calls)))
    finally:
        await j.aclose()


def score(j: JudgeReward, *calls: tuple[str, str, object]) -> list[float]:
    return asyncio.run(_score(j, *calls or [("What is 2+2?", "4", "#### 4")]))


KINDS = {  # failure kind -> server mode (None: an address nothing listens on)
    "timeout": "slow", "unparseable": "words", "unreachable": None, "error": "error",
}
OUTCOMES = {  # name -> (judge settings, calls made, final outcome)
    "zero": ({"on_failure": "zero"}, 1, "zero"),
    "drop": ({"on_failure": "drop"}, 1, "drop"),
    "retry_then_zero": ({"on_failure": "retry", "max_retries": 2, "after_retries": "zero"}, 3, "zero"),
    "retry_then_drop": ({"on_failure": "retry", "max_retries": 1, "after_retries": "drop"}, 2, "drop"),
}


@pytest.mark.parametrize("outcome", list(OUTCOMES))
@pytest.mark.parametrize("kind", list(KINDS))
def test_failure_kinds_get_their_configured_outcome(server, kind, outcome):
    settings, calls, final = OUTCOMES[outcome]
    mode = KINDS[kind]
    url = server.url(mode) if mode else _closed_port_url()
    before = server.requests[mode] if mode else 0
    # Short only where the timeout is the point: a loaded machine may take longer than that to answer.
    j = judge(url, timeout_s=0.5 if kind == "timeout" else 30.0, **settings)
    [value] = score(j)
    stats = j.take_stats()
    if final == "drop":
        assert is_dropped(value)
    else:  # zero, and no claim about correctness: the judge said nothing
        assert value == 0.0 and not is_dropped(value) and correctness(value) is None
    # Nothing lost: every call is counted once, by its kind, and reached the server when one listens.
    assert stats["judge/calls"] == calls and stats["judge/failures"] == calls
    assert stats[f"judge/failures/{kind}"] == calls
    assert stats["judge/retries"] == calls - 1 and stats["judge/ok"] == 0
    assert stats["judge/zeroed"] == (final == "zero") and stats["judge/dropped"] == (final == "drop")
    assert "judge/mean_score" not in stats
    if mode:
        assert server.requests[mode] - before == calls
    [sample] = stats["judge/samples"]
    assert sample["outcome"] == final and sample["failure"].startswith(kind) and sample["score"] is None
    # Taken: the next step starts from zero.
    assert j.take_stats()["judge/calls"] == 0


def test_garbage_bodies_are_unparseable(server):
    j = judge(server.url("garbage"))
    assert score(j) == [0.0]
    stats = j.take_stats()
    assert stats["judge/failures/unparseable"] == 1
    assert stats["judge/samples"][0]["judge_answer"].startswith("<html>")


@pytest.mark.parametrize("mode", ["words", "correct"])
def test_non_numbers_under_score_parsing_are_unparseable(server, mode):
    j = judge(server.url(mode), parse="score", on_failure="retry", max_retries=1, after_retries="zero")
    assert score(j) == [0.0]
    stats = j.take_stats()
    assert stats["judge/failures/unparseable"] == stats["judge/calls"] == 2 and stats["judge/zeroed"] == 1
    assert stats["judge/samples"][0]["failure"] == "unparseable: no number in the answer"


def test_verdicts_and_scores_are_parsed(server):
    j = judge(server.url("correct"))
    [r] = score(j, ("What is 2+2?", "4", "#### 4"))
    assert r == 1.0 and isinstance(r, Reward) and r.correct
    stats = j.take_stats()
    assert stats["judge/ok"] == 1 and stats["judge/mean_score"] == 1.0 and stats["judge/failures"] == 0
    assert stats["judge/samples"][0]["judge_answer"].endswith("Verdict: correct")
    prompt = server.prompts[-1]  # the built-in template with all three fields
    assert "What is 2+2?" in prompt and "#### 4" in prompt and "Response to grade:\n4\n" in prompt
    [r] = score(judge(server.url("incorrect")))
    assert r == 0.0 and correctness(r) is False
    j = judge(server.url("score10"), parse="score10", pass_threshold=0.8)
    [r] = score(j)
    assert r == pytest.approx(0.7) and correctness(r) is False
    assert j.take_stats()["judge/mean_score"] == pytest.approx(0.7)


def test_custom_template_file(server, tmp_path):
    f = tmp_path / "judge.txt"
    f.write_text("Q={question} A={response} REF={reference}. Say correct or incorrect.")
    score(judge(server.url("correct"), template=str(f)), ("q1", "a1", None))
    assert server.prompts[-1] == "Q=q1 A=a1 REF=(none given). Say correct or incorrect."


def test_concurrency_is_bounded(server):
    j = judge(server.url("busy"), max_concurrent=2)
    before = server.requests["busy"]
    out = score(j, *[(f"q{i}", "a", "r") for i in range(6)])
    assert out == [1.0] * 6 and server.requests["busy"] - before == 6
    assert server.max_inflight <= 2


def test_rule_reward_gates_or_adds(server):
    before = server.requests["correct"]
    j = judge(server.url("correct"), rule="exact", combine="gate")
    out = score(j, ("q", "5", "6"), ("q", "6", "6"))
    assert out == [0.0, 1.0]
    assert server.requests["correct"] - before == 1  # the wrong answer never reached the judge
    stats = j.take_stats()
    assert stats["judge/gated"] == 1 and stats["judge/calls"] == 1
    j = judge(server.url("score10"), parse="score10", rule="exact", combine="add", weight=0.5)
    assert score(j, ("q", "5", "6"), ("q", "6", "6")) == pytest.approx([0.35, 1.35])
    # A failed judge under add leaves the rule's part.
    assert score(judge(server.url("words"), rule="exact", combine="add"), ("q", "6", "6")) == [1.0]


def _three_calls_stop(j: JudgeReward) -> None:
    async def go() -> None:
        try:
            for _ in range(2):
                x = await j("q", "a", "r")
                assert x == 0.0 or is_dropped(x)
            with pytest.raises(JudgeDown, match="failed 3 calls in a row"):
                await j("q", "a", "r")
        finally:
            await j.aclose()

    asyncio.run(go())


@pytest.mark.parametrize("mode", ["error", "slow", None])
def test_a_judge_that_is_down_stops_the_run(server, mode):
    url = server.url(mode) if mode else _closed_port_url()
    _three_calls_stop(judge(url, timeout_s=0.3, max_failures_in_row=3))


def test_garbage_answers_stop_the_run_only_under_drop(server):
    # Up but answering garbage: every sample zeroed, the run goes on.
    assert score(judge(server.url("words"), max_failures_in_row=3), *[("q", "a", "r")] * 5) == [0.0] * 5
    # Under drop nothing would ever train: it stops.
    _three_calls_stop(judge(server.url("words"), on_failure="drop", max_failures_in_row=3))
    # Retries count too: the first sample's second attempt is the second failure in a row.
    j = judge(server.url("words"), on_failure="retry", max_retries=1, after_retries="drop", max_failures_in_row=2)
    with pytest.raises(JudgeDown, match="failed 2 calls in a row"):
        score(j)
    # 0 never stops.
    j = judge(server.url("error"), on_failure="drop", max_failures_in_row=0)
    assert all(is_dropped(x) for x in score(j, *[("q", "a", "r")] * 5))


def test_a_scored_call_breaks_the_streak(server):
    down, up = server.url("error"), server.url("correct")
    j = judge(down, max_failures_in_row=3)

    async def go() -> list[float]:
        try:
            out = [await j("q", "a", "r"), await j("q", "a", "r")]
            j.addresses = [up]
            out.append(await j("q", "a", "r"))
            j.addresses = [down]
            return out + [await j("q", "a", "r"), await j("q", "a", "r")]
        finally:
            await j.aclose()

    assert asyncio.run(go()) == [0.0, 0.0, 1.0, 0.0, 0.0]


def test_rlvr_drops_the_group_when_the_judge_drops_a_sample(server, fake_engine, tiny_model_dir):
    from transformers import AutoTokenizer

    from areal_cli.rollout.workflows.rlvr import RLVRWorkflow

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    item = {"prompt": "What is 2+3?", "answer": "5"}

    async def episode(j: JudgeReward):
        try:
            wf = RLVRWorkflow(j, GenerationConfig(max_new_tokens=4), tok, group_size=2)
            return await wf.arun_episode(fake_engine(token_delay=0), item)
        finally:
            await j.aclose()

    dropping = judge(server.url("words"), on_failure="drop")
    assert asyncio.run(episode(dropping)) is None
    assert dropping.take_stats()["judge/dropped"] == 2
    traj = asyncio.run(episode(judge(server.url("correct"), on_failure="drop")))
    assert traj.data["rewards"].tolist() == [1.0, 1.0] and traj.data["correct"].tolist() == [1, 1]


def test_rollout_servers_are_needed_and_followed():
    from areal_cli.errors import ConfigError

    with pytest.raises(ConfigError, match="no inference servers"):
        JudgeReward(JudgeConfig(server="rollout"), addresses=[])
    j = JudgeReward(dataclasses.replace(JudgeConfig(), server="rollout"), addresses=["127.0.0.1:1"])
    j.set_addresses(["127.0.0.1:2"])
    assert j.addresses == ["127.0.0.1:2"]
