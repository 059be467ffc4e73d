"""Online service mode, fast: the real gateway (served over HTTP), the real rollout executor and the real
``openai`` client, on the in-process fake engine (the dependency, not the thing under test). The same
guarantees against a real ``hf`` server, a weight update and a killed service process:
tests/integration/rollout/test_online_gateway.py (``-m e2e``)."""

from __future__ import annotations


import httpx
import openai
import pytest
from polling import wait_for
from rollout_fakes import FakeEngine

from areal_cli.errors import ConfigError
from areal_cli.rollout import RolloutExecutor
from areal_cli.rollout.workflows.online import OnlineAgentWorkflow

KEY = "svc-key"


@pytest.fixture
def online(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    engine = FakeEngine(token_delay=0)
    wf = OnlineAgentWorkflow(AutoTokenizer.from_pretrained(tiny_model_dir), service_key=KEY,
                             gateway_file=str(tmp_path / "gateway.json"), session_timeout_s=3.0)
    ex = RolloutExecutor(engine, wf, batch_size=1, max_concurrent=8, max_head_offpolicyness=1, pad_token_id=0)
    srv = wf.start(engine)
    http = httpx.Client(base_url=f"http://{srv.address}", headers={"Authorization": f"Bearer {KEY}"},
                        timeout=30)
    yield engine, wf, ex, http
    ex.destroy()
    wf.close()


def _call(s: dict) -> tuple[str, list[int]]:
    c = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
    r = c.chat.completions.create(model="p", messages=[{"role": "user", "content": s["task"]["prompt"]}],
                                  max_tokens=4)
    return r.id, list(r.choices[0].token_versions)


def _end(http: httpx.Client, s: dict, reward: float) -> None:
    hdr = {"Authorization": f"Bearer {s['api_key']}"}
    assert http.post("/rl/set_reward", json={"reward": reward}, headers=hdr).status_code == 200
    assert http.post("/rl/end_session", headers=hdr).status_code == 200
    assert http.post("/rl/end_session", headers=hdr).status_code == 401  # gone to training, once


def test_gate_versions_once_and_abandoned_sessions(online):
    engine, wf, ex, http = online
    for i in range(4):
        ex.submit({"prompt": f"q{i}", "answer": "1", "id": i})
    wait_for(lambda: wf.gateway.counters()["online/capacity"] == 2, "(k + 1) x batch = 2 grants")
    a, b = http.post("/rl/start_session", json={}).json(), http.post("/rl/start_session", json={}).json()
    r = http.post("/rl/start_session", json={})
    assert r.status_code == 429 and "staleness gate" in r.json()["error"]["message"]
    assert http.post("/rl/grant_capacity", json={"n": 1}).status_code == 403
    assert http.post("/rl/export", json={"session_id": a["session_id"]}).status_code == 403
    assert a["task"]["prompt"] in ("q0", "q1") and a["base_url"].endswith("/v1")

    a_id, a_versions = _call(a)
    _end(http, a, 1.0)
    _call(b)  # b is abandoned after its call: no end, no request for session_timeout_s
    first = ex.wait(1, timeout=30)
    wait_for(lambda: wf.gateway.counters()["online/abandoned"] == 1, "b to be dropped")
    assert first.meta["interaction_ids"] == [[[a_id]]] and float(first.data["rewards"][0]) == 1.0

    engine.version = 1  # a weight update: the next sessions generate at version 1
    ex.set_version(1)
    wait_for(lambda: wf.gateway.counters()["online/capacity"] == 2, "capacity back after consume + drop")
    c = http.post("/rl/start_session", json={}).json()
    c_id, c_versions = _call(c)
    _end(http, c, 0.5)
    second = ex.wait(1, timeout=30)
    assert second.meta["interaction_ids"] == [[[c_id]]]
    for batch, want in ((first, a_versions), (second, c_versions)):
        mask = batch.data["loss_mask"][0].bool()
        assert batch.data["versions"][0][mask].tolist() == want
    assert a_versions == [0] * len(a_versions) and c_versions == [1] * len(c_versions)
    with pytest.raises(TimeoutError):  # b's call is nowhere: not whole, not half
        ex.wait(1, timeout=0.5)
    stats = ex.get_stats()
    assert (stats["rollout/accepted"], stats["rollout/rejected"]) == (2, 1)
    got = wf.rollout_stats()
    assert (got["online/opened"], got["online/ended"], got["online/abandoned"]) == (3, 2, 1)


def test_an_empty_session_trains_nothing_and_frees_its_capacity(online):
    _, wf, ex, http = online
    ex.submit({"prompt": "q", "answer": "1"})
    wait_for(lambda: wf.gateway.counters()["online/capacity"] == 1, "a grant")
    s = http.post("/rl/start_session", json={}).json()
    hdr = {"Authorization": f"Bearer {s['api_key']}"}
    assert http.post("/rl/end_session", headers=hdr).status_code == 200
    wait_for(lambda: ex.get_stats()["rollout/rejected"] == 1, "the empty episode")
    assert wf.rollout_stats()["online/empty"] == 1


def test_config_errors_name_the_key(tiny_model_dir):
    with pytest.raises(ConfigError, match="rollout.group_size"):
        OnlineAgentWorkflow(tiny_model_dir, group_size=8)
    with pytest.raises(ConfigError, match="workflow.kwargs.session_timeout_s"):
        OnlineAgentWorkflow(tiny_model_dir, session_timeout_s=0)
    with pytest.raises(ConfigError, match="workflow.kwargs.export_style"):
        OnlineAgentWorkflow(tiny_model_dir, export_style="rows")


def test_validation_refuses_a_group_before_anything_starts():
    from areal_cli.cli.common import compose_and_validate

    with pytest.raises(ConfigError, match="rollout.group_size") as e:
        compose_and_validate(["workflow=online", "algo=reinforce_pp"])  # the default group_size is 8
    assert e.value.path == "rollout.group_size" and "algo=reinforce_pp" in e.value.hint
    cfg, _ = compose_and_validate(["workflow=online", "algo=reinforce_pp", "rollout.group_size=1"])
    assert cfg.workflow.name == "online"
