"""``workflow.reward=judge``: an LLM judge scores each completion through an OpenAI-compatible server.

Each call renders the prompt template (:mod:`.judge_prompt`) with the question, the completion and the
reference, sends it to ``/v1/chat/completions`` of the judge server (the run's own inference servers,
round robin, or ``workflow.judge.base_url``), and reads a score in [0, 1] from the answer. Calls run on
the rollout's event loop, at most ``max_concurrent`` at a time, each bounded by ``timeout_s``.

A call fails in one of four ways, each counted: ``timeout``, ``unreachable`` (no connection),
``error`` (an HTTP error status) and ``unparseable`` (a body that is not a chat completion, or an
answer with no verdict or score). A failed sample gets ``on_failure``: ``zero`` (the judge's score
is 0), ``drop`` (:class:`~areal_cli.rewards.outcome.Dropped`: the workflow drops the episode) or
``retry`` (up to ``max_retries`` more calls, then ``after_retries``). Never an exception, never a
silent 1 — except after ``max_failures_in_row`` calls in a row failed because the judge is down
(timeout, unreachable, error; under ``drop``, failed in any way), which stop the run with
:class:`JudgeDown`: a judge that is down would otherwise train on zeros, or under ``drop`` starve
the batch for ever. A judge that answers garbage is up: its samples get their outcome and the run
goes on.

:meth:`JudgeReward.take_stats` returns the ``judge/*`` counters since its last call and a few recent
verdicts (``judge/samples``); the rollout service adds them to each step's metrics.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import logging
import os
import threading
from typing import Any

import aiohttp

from areal_cli.errors import ArealError, ConfigError
from areal_cli.rewards.judge_prompt import Parser, Unparseable, load_template, render
from areal_cli.rewards.outcome import Dropped, Reward, as_outcome, correctness

logger = logging.getLogger(__name__)

KINDS = ("timeout", "unreachable", "error", "unparseable")
_CLIP = 500  # characters of each text kept in a logged verdict


class JudgeDown(ArealError):
    """The judge failed ``max_failures_in_row`` calls in a row: the run stops rather than train blind."""


class _Failed(Exception):
    def __init__(self, kind: str, message: str, answer: str | None = None):
        super().__init__(message)
        self.kind, self.answer = kind, answer


async def _close_on_shutdown(session: aiohttp.ClientSession) -> Any:
    try:
        yield
    finally:
        await session.close()


class JudgeReward:
    """``await judge(prompt, completion, answer) -> float`` (a :class:`Reward`, or :class:`Dropped`).

    ``addresses``: the run's inference servers, for ``workflow.judge.server=rollout``; ``api_key``: their
    bearer token. With ``server=url`` the judge is ``base_url`` and its key the ``api_key_env`` variable."""

    def __init__(self, j: Any, addresses: list[str] | None = None, api_key: str | None = None):
        self.cfg = j
        if j.server == "url":
            if not j.base_url:
                raise ConfigError("workflow.judge.base_url", "judge.server=url needs the judge's address",
                                  "set workflow.judge.base_url=http://host:port")
            self.addresses = [str(j.base_url)]
            self.api_key = os.environ.get(j.api_key_env) if j.api_key_env else None
        else:
            if not addresses:
                raise ConfigError("workflow.judge.server", "judge.server=rollout but this process has no "
                                  "inference servers to call", "set workflow.judge.server=url and "
                                  "workflow.judge.base_url=http://host:port")
            self.addresses = list(addresses)
            self.api_key = api_key
        self.template = load_template(j.template, j.parse)
        self.parse = Parser.from_config(j)
        self.rule = None
        if j.rule:
            from areal_cli.rewards.registry import get_reward_fn

            self.rule = get_reward_fn(j.rule, "workflow.judge.rule")
        self._rr = itertools.count()
        self._lock = threading.Lock()  # counters are read by the trainer's thread while the loop writes
        self._counts: collections.Counter[str] = collections.Counter()
        self._score_sum = 0.0
        self._samples: collections.deque[dict[str, Any]] = collections.deque(maxlen=max(0, int(j.log_samples)))
        self._in_row = 0
        self._drops = "drop" in (j.on_failure, j.after_retries if j.on_failure == "retry" else None)
        self._warned: set[str] = set()
        self._per_loop: dict[int, tuple[aiohttp.ClientSession, asyncio.Semaphore, Any]] = {}

    def set_addresses(self, addresses: list[str]) -> None:
        """The rollout servers moved (a restart): a judge on them follows; a ``base_url`` judge stays."""
        if self.cfg.server == "rollout" and addresses:
            self.addresses = list(addresses)

    # ------------------------------------------------------------------ transport
    async def _session(self) -> tuple[aiohttp.ClientSession, asyncio.Semaphore]:
        key = id(asyncio.get_running_loop())
        got = self._per_loop.get(key)
        if got is None or got[0].closed:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            session = aiohttp.ClientSession(headers=headers)
            # Closed when its loop shuts down (the loop finalises async generators).
            keeper = _close_on_shutdown(session)
            await keeper.__anext__()
            got = (session, asyncio.Semaphore(int(self.cfg.max_concurrent)), keeper)
            self._per_loop[key] = got
        return got[0], got[1]

    async def _ask(self, prompt: str) -> str:
        """The judge's answer text, or :class:`_Failed` with its kind."""
        j = self.cfg
        body: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}],
                                "max_tokens": int(j.max_new_tokens), "temperature": float(j.temperature)}
        if j.model:
            body["model"] = j.model
        base = self.addresses[next(self._rr) % len(self.addresses)]
        base = base if base.startswith(("http://", "https://")) else f"http://{base}"
        url = base.rstrip("/") + ("/chat/completions" if base.rstrip("/").endswith("/v1") else "/v1/chat/completions")
        session, sem = await self._session()
        async with sem:
            try:
                async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=float(j.timeout_s))) as r:
                    status, raw = r.status, await r.read()
            except (TimeoutError, aiohttp.ServerTimeoutError):
                raise _Failed("timeout", f"no answer from {base} within {j.timeout_s:g}s") from None
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
                raise _Failed("unreachable", f"{base}: {type(e).__name__}: {e}") from None
        text = raw.decode("utf-8", errors="replace")
        if status >= 400:
            raise _Failed("error", f"{base} answered {status}: {text[:200]}")
        try:
            content = json.loads(text)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise _Failed("unparseable", f"not a chat completion: {text[:200]!r}", text) from None
        if not isinstance(content, str):
            raise _Failed("unparseable", f"the completion's content is {type(content).__name__}", text)
        return content

    # ------------------------------------------------------------------ scoring
    async def __call__(self, prompt: str, completion: str, answer: Any, **_: Any) -> float:
        j = self.cfg
        rule = None
        if self.rule is not None:
            rule = as_outcome(self.rule(prompt, completion, answer))
            if j.combine == "gate" and float(rule) <= 0.0:
                self._count(gated=1)
                return rule
        text = render(self.template, prompt, completion, answer)
        attempts = 1 + (int(j.max_retries) if j.on_failure == "retry" else 0)
        fail: _Failed | None = None
        for attempt in range(attempts):
            if attempt:
                self._count(retries=1)
                await asyncio.sleep(min(2.0, 0.25 * 2 ** (attempt - 1)))
            answer_text = None
            try:
                answer_text = await self._ask(text)
                score = self.parse(answer_text)
            except Unparseable as e:
                fail = _Failed("unparseable", str(e), answer_text)
            except _Failed as e:
                fail = e
            else:
                self._succeeded(score, prompt, completion, answer, answer_text)
                return self._combine(rule, score)
            self._failed(fail)
        assert fail is not None
        outcome = j.on_failure if j.on_failure != "retry" else j.after_retries
        self._count(**{"dropped" if outcome == "drop" else "zeroed": 1})
        self._log_sample(prompt, completion, answer, fail.answer, None, f"{fail.kind}: {fail}", outcome)
        if outcome == "drop":
            return Dropped()
        return self._combine(rule, None)

    def _combine(self, rule: Any, score: float | None) -> float:
        """The judge's score (0 when it failed: correctness unknown) with the rule reward, if any. Correct:
        the judge's score reaches ``pass_threshold``; with ``combine=add``, also the rule's verdict when
        it states one."""
        j = self.cfg
        if score is None:  # a failed judge says nothing about correctness
            return float(rule) if rule is not None and j.combine == "add" else 0.0
        ok = score >= float(j.pass_threshold)
        if rule is None or j.combine == "gate":
            return Reward(score, ok)
        rule_ok = correctness(rule)
        return Reward(float(rule) + float(j.weight) * score, ok and (rule_ok is None or rule_ok))

    # ------------------------------------------------------------------ accounting
    def _count(self, **inc: int) -> None:
        with self._lock:
            self._counts.update(inc)

    def _succeeded(self, score: float, prompt: str, completion: str, answer: Any, text: str) -> None:
        with self._lock:
            self._counts.update(calls=1, ok=1)
            self._score_sum += score
            self._in_row = 0
        self._log_sample(prompt, completion, answer, text, score, None, "scored")

    def _failed(self, fail: _Failed) -> None:
        limit = int(self.cfg.max_failures_in_row)
        with self._lock:
            first = fail.kind not in self._warned
            self._warned.add(fail.kind)
            self._counts.update({"calls": 1, f"failures/{fail.kind}": 1})
            # An unparseable answer means the judge is up: it breaks a streak, unless failed samples are
            # dropped, where any failure leaves nothing to train on.
            self._in_row = self._in_row + 1 if fail.kind != "unparseable" or self._drops else 0
            in_row = self._in_row
        # The first failure of each kind is a warning; the rest are counted (judge/failures/*) and sampled
        # (judge.jsonl) rather than logged one by one.
        logger.log(logging.WARNING if first else logging.DEBUG, "judge call failed (%s): %s", fail.kind, fail)
        if limit and in_row >= limit:
            raise JudgeDown(f"the LLM judge failed {in_row} calls in a row (last: {fail.kind}: {fail}) — fix: "
                            "check workflow.judge.server / base_url / template, or raise "
                            "workflow.judge.max_failures_in_row (0: never stop)")

    def _log_sample(self, prompt: str, completion: str, answer: Any, text: str | None, score: float | None,
                    failure: str | None, outcome: str) -> None:
        if self._samples.maxlen == 0:
            return
        rec = {"question": prompt[:_CLIP], "response": completion[:_CLIP],
               "reference": None if answer is None else str(answer)[:_CLIP],
               "judge_answer": None if text is None else text[:_CLIP], "score": score, "outcome": outcome}
        if failure is not None:
            rec["failure"] = failure[:_CLIP]
        with self._lock:
            self._samples.append(rec)

    def take_stats(self) -> dict[str, Any]:
        """The ``judge/*`` counters since the last call (every key, zeros included) plus
        ``judge/mean_score`` over the scored calls, when there were any, and ``judge/samples``: the
        most recent verdicts (at most ``log_samples``)."""
        with self._lock:
            c, self._counts = self._counts, collections.Counter()
            total, self._score_sum = self._score_sum, 0.0
            samples = list(self._samples)
            self._samples.clear()
        out: dict[str, Any] = {f"judge/{k}": float(c[k]) for k in ("calls", "ok", "retries", "zeroed", "dropped")}
        out["judge/failures"] = float(sum(c[f"failures/{k}"] for k in KINDS))
        out.update({f"judge/failures/{k}": float(c[f"failures/{k}"]) for k in KINDS})
        if self.rule is not None:
            out["judge/gated"] = float(c["gated"])
        if c["ok"]:
            out["judge/mean_score"] = total / c["ok"]
        out["judge/samples"] = samples
        return out

    async def aclose(self) -> None:
        got = self._per_loop.pop(id(asyncio.get_running_loop()), None)
        if got is not None:
            await got[0].close()
