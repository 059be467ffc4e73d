"""An agent service outside the trainer: it runs agents in a loop against the run's online gateway.

A plain Python process (the ``openai`` and ``httpx`` packages, nothing of areal): for each session it

1. opens a session on the gateway (``POST /rl/start_session``; a 429 means the trainer's staleness gate
   has no room yet, so it waits and tries again),
2. runs a small agent with the real ``openai`` client on the session's ``base_url`` / ``api_key``:
   answer an arithmetic question, and once more after "your answer is wrong" when it was,
3. posts the reward (1 for the right final number, else 0) and ends the session, which sends it to
   training.

The gateway's address and key come from the run's ``gateway.json`` (``--gateway-file``, waited for
until the trainer writes it), or from ``--url`` / ``$AREAL_GATEWAY_URL`` and ``$AREAL_GATEWAY_KEY``.
The question is the session's ``task`` (the trainer's dataset item) when it has one, else one of the
service's own. It stops after ``--sessions`` sessions (0: never), or once the gateway has been gone
for ``--give-up-s`` seconds (the run ended).

    python examples/online_agent/service.py --gateway-file <run dir>/gateway.json --workers 4
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import threading
import time

import httpx
import openai

WRONG = "Your answer is wrong. Try again."


def read_gateway(args: argparse.Namespace) -> tuple[str, str]:
    url = args.url or os.environ.get("AREAL_GATEWAY_URL")
    if url:
        return url.rstrip("/"), os.environ.get("AREAL_GATEWAY_KEY", "")
    deadline = time.monotonic() + args.wait_s
    while not os.path.exists(args.gateway_file):  # the trainer writes it when its rollout starts
        if time.monotonic() > deadline:
            sys.exit(f"no gateway file at {args.gateway_file} after {args.wait_s:.0f}s")
        time.sleep(0.5)
    with open(args.gateway_file) as f:
        g = json.load(f)
    return g["url"], g["service_key"]


def final_number(text: str) -> str | None:
    found = re.findall(r"-?\d+(?:\.\d+)?", text.replace(",", ""))
    return found[-1] if found else None


def own_task(rng: random.Random) -> dict:
    a, b = rng.randint(2, 20), rng.randint(2, 20)
    return {"question": f"What is {a} plus {b}?", "answer": f"#### {a + b}"}


class Service:
    def __init__(self, url: str, key: str, args: argparse.Namespace):
        self.url, self.args = url, args
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=600)
        self.lock = threading.Lock()
        self.done = 0
        self.claimed = 0  # sessions the workers have taken on (for --sessions)
        self.rewards: list[float] = []

    def follow_gateway(self) -> None:
        """A resumed run serves a new gateway (another port and key): follow its gateway file."""
        if self.args.url or os.environ.get("AREAL_GATEWAY_URL"):
            return
        try:
            with open(self.args.gateway_file) as f:
                g = json.load(f)
        except (OSError, ValueError):
            return
        if g["url"] != self.url:
            self.url = g["url"]
            key = {"Authorization": f"Bearer {g['service_key']}"}
            self.http = httpx.Client(base_url=self.url, headers=key, timeout=600)

    def open_session(self) -> dict | None:
        """A session, or None once the gateway has been unreachable for ``--give-up-s``."""
        wait, gone_since = 0.1, None
        while True:
            try:
                r = self.http.post("/rl/start_session", json={"task_id": "svc"})
                gone_since = None
                if r.status_code != 429:
                    r.raise_for_status()
                    return r.json()
            except httpx.TransportError:
                gone_since = gone_since or time.monotonic()
                if time.monotonic() - gone_since > self.args.give_up_s:
                    return None
                self.follow_gateway()
            time.sleep(wait)  # no capacity (or no gateway) yet: the trainer has to consume first
            wait = min(wait * 2, 2.0)

    def run_agent(self, s: dict, rng: random.Random) -> float:
        task = s.get("task") or {}  # the trainer's dataset item: its chat (system prompt included)
        if not (task.get("messages") or task.get("question")):
            task = own_task(rng)
        gold = final_number(str(task.get("answer", "")).split("####")[-1])
        client = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"], max_retries=0)
        messages = list(task.get("messages") or [{"role": "user", "content": task["question"]}])
        reward = 0.0
        for turn in range(self.args.turns):
            r = client.chat.completions.create(model="policy", messages=messages,
                                               max_tokens=self.args.max_tokens)
            text = r.choices[0].message.content or ""
            if gold is not None and final_number(text) == gold:
                reward = 1.0
                break
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": WRONG}]
        return reward

    def session(self, rng: random.Random) -> bool:
        s = self.open_session()
        if s is None:
            return False
        session_key = {"Authorization": f"Bearer {s['api_key']}"}
        try:
            reward = self.run_agent(s, rng)
            self.http.post("/rl/set_reward", json={"reward": reward}, headers=session_key).raise_for_status()
            self.http.post("/rl/end_session", headers=session_key).raise_for_status()
        except (httpx.HTTPError, openai.APIError) as e:
            # The gateway went away (the run ended) or dropped the session (idle too long): the trainer
            # keeps nothing of it, so there is nothing to clean up; go on with the next one.
            print(f"session {s['session_id']} lost: {type(e).__name__}: {e}", flush=True)
            return True
        with self.lock:
            self.done += 1
            self.rewards.append(reward)
            print(f"session {s['session_id']} ended, reward {reward}", flush=True)
        return True

    def worker(self, seed: int) -> None:
        rng = random.Random(seed)
        while True:
            with self.lock:
                if self.args.sessions and self.claimed >= self.args.sessions:
                    return
                self.claimed += 1
            if not self.session(rng):
                return


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gateway-file", default="gateway.json", help="the run's <run dir>/gateway.json")
    p.add_argument("--url", default=None, help="the gateway's URL, instead of the file")
    p.add_argument("--sessions", type=int, default=0, help="stop after this many sessions (0: never)")
    p.add_argument("--workers", type=int, default=2, help="agents running at once")
    p.add_argument("--turns", type=int, default=2, help="answers per session (retries after 'wrong')")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per answer")
    p.add_argument("--wait-s", type=float, default=900.0, help="how long to wait for the gateway file")
    p.add_argument("--give-up-s", type=float, default=60.0, help="exit once the gateway is gone this long")
    args = p.parse_args(argv)
    url, key = read_gateway(args)
    svc = Service(url, key, args)
    threads = [threading.Thread(target=svc.worker, args=(i,), daemon=True) for i in range(args.workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    mean = sum(svc.rewards) / len(svc.rewards) if svc.rewards else 0.0
    print(f"{svc.done} sessions, mean reward {mean:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
