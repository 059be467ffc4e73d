"""An evaluation interrupted by a dead server goes on where it stopped (trainer/evaluation.py ``done``):
the second call generates only the completions the first one had not scored, and the metrics equal an
uninterrupted evaluation's. The real-server version is tests/integration/cli/test_train_server_restart.py."""

from __future__ import annotations

import pytest
from rollout_fakes import FakeEngine

from areal_cli.errors import InferenceError


class DiesAfter(FakeEngine):
    """A server that answers ``n_ok`` requests and then refuses every other one."""

    def __init__(self, n_ok: int | None):
        super().__init__(token_delay=0)
        self.n_ok = n_ok
        self.prompts: list[tuple[int, ...]] = []

    async def agenerate(self, req):
        if self.n_ok is not None and len(self.prompts) >= self.n_ok:
            raise InferenceError("generation failed after 4 attempt(s): no healthy inference server")
        self.prompts.append(tuple(req.input_ids))
        return await super().agenerate(req)


def _reward(prompt, completion, answer):
    from areal_cli.rewards.outcome import Reward

    return Reward(len(completion) % 3 / 2, correct=len(completion) % 2 == 0)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_interrupted_evaluation_keeps_what_it_scored(tok, monkeypatch):
    from areal_cli.plan.compose import load_config
    from areal_cli.rollout import build
    from areal_cli.trainer import evaluation

    cfg = load_config(["rollout.gconfig.max_new_tokens=6", "rollout.eval_gconfig.max_new_tokens=6",
                       "trainer.eval_n_samples=3"])
    items = [{"prompt": f"{a}+{a}?", "answer": str(2 * a)} for a in range(8)]
    n_requests = len(items) * (1 + 3)

    def run(engine, done=None):
        monkeypatch.setattr(build, "build_client", lambda *a, **k: engine)
        return evaluation.evaluate_on_servers(cfg, ["unused:0"], "hf", tok, items, reward_fn=_reward,
                                              concurrency=1, done=done)

    whole = run(DiesAfter(None))
    done: dict = {}
    dying = DiesAfter(11)
    with pytest.raises(InferenceError):
        run(dying, done)
    kept = len(done)  # answered and scored before the failure (a reward still running is dropped)
    assert 0 < kept <= 11
    restarted = DiesAfter(None)
    again = run(restarted, done)
    assert len(restarted.prompts) == n_requests - kept  # nothing scored before is generated again
    assert len(done) == n_requests
    whole.pop("eval/time_s"), again.pop("eval/time_s")
    assert again == whole
