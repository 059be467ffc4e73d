"""Online service mode against a real ``hf`` server process: the rollout executor's staleness gate grants
sessions on a real gateway, an agent service (the real ``openai`` client, in a thread or a process of
its own) opens, rewards and ends them, and the executor hands out the ended sessions as trajectories.

- over-capacity opens are refused (429) until training consumes and the version advances;
- sessions that ended before a weight update train with the versions recorded at generation (the ones
  the service was shown), those after it with the new one; nothing is trained twice;
- a service that disappears mid-session (killed, or hung up during a call) leaves no row behind: its
  session is dropped whole, counted, and its episode frees its capacity.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import subprocess
import sys

import httpx
import openai
import pytest
import polling
from hf_server_helpers import start_hf_server

from areal_cli.api.io_struct import WeightUpdateMeta
from areal_cli.rollout import RolloutExecutor
from areal_cli.rollout.workflows.online import OnlineAgentWorkflow

wait_for = functools.partial(polling.wait_for, timeout=120.0)  # a real server under a loaded CI box

# A server of its own and a killed service process: end to end, outside the default suite (the fast
# form of these guarantees, on the fake engine, is tests/unit/rollout/test_online_gateway_parts.py).
pytestmark = [pytest.mark.timeout(600), pytest.mark.e2e]
KEY = "service-secret"


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    h = start_hf_server(tiny_model_dir, tmp_path_factory)
    yield h
    h.stop()


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _setup(server, tok, tmp_path, *, batch_size, k, **wf_kw):
    from areal_cli.inference.client import RemoteInferenceEngine

    engine = RemoteInferenceEngine([server.address], "hf", timeout_s=120)
    wf = OnlineAgentWorkflow(tok, gateway_file=str(tmp_path / "gateway.json"), service_key=KEY, **wf_kw)
    ex = RolloutExecutor(engine, wf, batch_size=batch_size, max_concurrent=16, max_head_offpolicyness=k,
                         pad_token_id=tok.pad_token_id)
    ex.set_version(max(ex.run_coroutine(engine.get_server_versions()).values()))
    srv = wf.start(engine)
    return engine, wf, ex, srv


def _teardown(engine, wf, ex):
    ex.run_coroutine(engine.close())
    ex.destroy()
    wf.close()


class ServiceSide:
    """What the external service does, with the real openai client; records what it was shown."""

    def __init__(self, url: str):
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
        self.shown: dict[str, list] = {}  # completion id -> token versions the service got back
        self.rewards: dict[str, float] = {}  # completion id of a session's last call -> its reward

    def open(self) -> httpx.Response:
        return self.http.post("/rl/start_session", json={"task_id": "t"})

    def run(self, s: dict, reward: float, turns: int = 2) -> list[str]:
        c = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
        msgs = [{"role": "user", "content": s["task"]["prompt"]}]
        ids = []
        for _ in range(turns):
            r = c.chat.completions.create(model="policy", messages=msgs, max_tokens=6, temperature=1.0)
            self.shown[r.id] = list(r.choices[0].token_versions)
            ids.append(r.id)
            msgs += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": "again"}]
        hdr = {"Authorization": f"Bearer {s['api_key']}"}
        assert self.http.post("/rl/set_reward", json={"reward": reward}, headers=hdr).status_code == 200
        end = self.http.post("/rl/end_session", headers=hdr)
        assert end.status_code == 200 and end.json()["interaction_count"] == turns
        # ended means handed to training: the key is gone, it cannot be ended or used again
        assert self.http.post("/rl/end_session", headers=hdr).status_code == 401
        self.rewards[ids[-1]] = reward
        return ids


def _rows(batch) -> list[tuple[list[str], list[int], float]]:
    """(interaction ids, versions of the trained tokens, reward) of every row of ``batch``."""
    d = batch.data
    out = []
    per_row = [row for episode in batch.meta["interaction_ids"] for row in episode]
    for i, ids in enumerate(per_row):
        mask = d["loss_mask"][i].bool()
        out.append((list(ids), d["versions"][i][mask].tolist(), float(d["rewards"][i])))
    return out


def _push(ex, engine, version: int, path: str) -> None:
    ex.pause()
    ex.run_coroutine(engine.pause_generation())
    meta = WeightUpdateMeta(type="disk", version=version, path=path)
    ex.run_coroutine(engine.update_weights_from_disk(meta))
    ex.run_coroutine(engine.continue_generation())
    ex.set_version(version)
    ex.resume()


def test_sessions_train_with_recorded_versions_once_and_capacity_is_gated(server, tok, tmp_path,
                                                                          tiny_model_dir_b):
    engine, wf, ex, srv = _setup(server, tok, tmp_path, batch_size=2, k=1)
    try:
        gw_file = json.loads((tmp_path / "gateway.json").read_text())
        assert gw_file["service_key"] == KEY and gw_file["base_url"] == f"{gw_file['url']}/v1"
        assert oct((tmp_path / "gateway.json").stat().st_mode & 0o777) == "0o600"
        svc = ServiceSide(gw_file["url"])
        v0 = ex.get_version()
        for i in range(6):
            ex.submit({"prompt": f"What is {i} plus 3?", "answer": str(i + 3), "id": i})
        # k=1, batch 2: the gate admits (k + 1) x 2 = 4 episodes at v0, so 4 sessions may open
        wait_for(lambda: wf.gateway.counters()["online/capacity"] == 4, "4 grants")
        first = [svc.open() for _ in range(4)]
        assert [r.status_code for r in first] == [200] * 4
        over = svc.open()
        assert over.status_code == 429 and "no capacity" in over.json()["error"]["message"]
        # the service cannot grant itself capacity nor take a session from training
        assert svc.http.post("/rl/grant_capacity", json={"n": 5}).status_code == 403
        taken = first[0].json()["session_id"]
        assert svc.http.post("/rl/export", json={"session_id": taken}).status_code == 403
        before = {}
        for n, r in enumerate(first):
            ids = svc.run(r.json(), reward=float(n))
            before.update({i: v0 for i in ids})
        batches = [ex.wait(2, timeout=120)]
        # a weight update: the two sessions still waiting ended at v0 and are consumed at v0 + 1
        _push(ex, engine, v0 + 1, tiny_model_dir_b)
        batches.append(ex.wait(2, timeout=120))
        # consuming opened the gate again: two more sessions, generated at the new version
        wait_for(lambda: wf.gateway.counters()["online/capacity"] == 2, "2 grants after the update")
        after = {}
        for r in [svc.open() for _ in range(2)]:
            assert r.status_code == 200
            after.update({i: v0 + 1 for i in svc.run(r.json(), reward=7.0)})
        assert svc.open().status_code == 429
        batches.append(ex.wait(2, timeout=120))

        rows = [row for b in batches for row in _rows(b)]
        trained = [i for ids, _, _ in rows for i in ids]
        assert len(trained) == len(set(trained)), "a call was trained twice"
        assert set(trained) == set(svc.shown) == set(before) | set(after)
        for ids, versions, reward in rows:
            # per_leaf: one row per conversation, every sampled token at the version it was shown with
            assert versions == [v for i in ids for v in svc.shown[i]]
            assert set(versions) == {before.get(ids[0], after.get(ids[0]))}
            assert reward == svc.rewards[ids[-1]]
        assert {v for _, vs, _ in _rows(batches[1]) for v in vs} == {v0}  # ended before the update
        assert {v for _, vs, _ in _rows(batches[2]) for v in vs} == {v0 + 1}
        c = wf.gateway.counters()
        assert (c["online/opened"], c["online/ended"], c["online/abandoned"]) == (6, 6, 0)
        assert ex.get_stats()["rollout/ready"] == 0
    finally:
        _teardown(engine, wf, ex)


SERVICE_THAT_DIES = """
import json, sys, time, httpx, openai
url, key = sys.argv[1], sys.argv[2]
s = httpx.post(url + "/rl/start_session", json={}, headers={"Authorization": "Bearer " + key}).json()
c = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
r = c.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
print(json.dumps({"session_id": s["session_id"], "api_key": s["api_key"], "id": r.id}), flush=True)
time.sleep(3600)  # never ends its session: killed here
"""


def test_a_service_that_disappears_leaves_no_half_row(server, tok, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="areal_cli.rollout.gateway")
    engine, wf, ex, srv = _setup(server, tok, tmp_path, batch_size=1, k=2, session_timeout_s=5.0)
    url = f"http://{srv.address}"
    try:
        for i in range(3):
            ex.submit({"prompt": f"What is {i} plus 1?", "answer": str(i + 1), "id": i})
        wait_for(lambda: wf.gateway.counters()["online/capacity"] == 3, "3 grants")
        svc = ServiceSide(url)

        # 1. a service process killed mid-session: one call made, never ended
        proc = subprocess.Popen([sys.executable, "-c", SERVICE_THAT_DIES, url, KEY], stdout=subprocess.PIPE,
                                text=True)
        try:
            killed = json.loads(proc.stdout.readline())
        finally:
            proc.kill()
            proc.wait()

        # 2. a service that hangs up during a call: the request is held on a paused server until the
        #    connection is gone, so the gateway sees the hang-up when the call returns
        hung = svc.open().json()
        ex.run_coroutine(engine.pause_generation())
        body = json.dumps({"model": "policy", "messages": [{"role": "user", "content": "hi"}],
                           "max_tokens": 4})
        host, port = srv.address.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
                          f"Authorization: Bearer {hung['api_key']}\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
            wait_for(lambda: wf.gateway._sessions[hung["session_id"]].busy == 1, "the held call")
        ex.run_coroutine(engine.continue_generation())

        # 3. a session ended properly
        good = svc.run(svc.open().json(), reward=1.0)
        batch = ex.wait(1, timeout=120)
        wait_for(lambda: wf.gateway.counters()["online/abandoned"] == 2, "both dropped")
        wait_for(lambda: ex.get_stats()["rollout/running"] == 0, "the dropped episodes to finish")

        assert batch.meta["interaction_ids"] == [[good]]  # one episode of one row: the ended session
        stats = ex.get_stats()
        assert (stats["rollout/rejected"], stats["rollout/accepted"], stats["rollout/ready"]) == (2, 1, 0)
        with pytest.raises(TimeoutError):  # nothing else, whole or half, is waiting to be trained
            ex.wait(1, timeout=1.0)
        msgs = [r.getMessage() for r in caplog.records]
        assert any(killed["session_id"] in m and "session_timeout_s" in m for m in msgs), msgs
        assert any(hung["session_id"] in m and "disconnected" in m for m in msgs), msgs
        gone = {"Authorization": f"Bearer {killed['api_key']}"}
        assert httpx.post(f"{url}/rl/end_session", headers=gone).status_code == 401  # too late to end it
        # the capacity of the dropped sessions came back: the gate admits two more episodes
        for i in range(2):
            ex.submit({"prompt": "What is 1 plus 1?", "answer": "2", "id": 10 + i})
        wait_for(lambda: wf.gateway.counters()["online/capacity"] == 2, "2 more grants")
    finally:
        _teardown(engine, wf, ex)
    assert not os.path.exists(tmp_path / "gateway.json")  # removed with the gateway
