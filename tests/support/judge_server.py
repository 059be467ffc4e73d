"""A deterministic judge for tests: a real HTTP server (aiohttp, in a thread of the test process) that
speaks the OpenAI ``/v1/chat/completions`` protocol the LLM judge uses and answers by a fixed rule,
chosen by the first path segment of the base URL (``http://127.0.0.1:PORT/<mode>``):

- ``correct`` / ``incorrect``: that verdict after some reasoning ("... Verdict: correct");
- ``score10``: "Score: 7/10";
- ``parity``: "correct" when the graded response (between the default template's markers) has an even
  number of characters, else "incorrect" — varied but reproducible verdicts for a training run;
- ``words``: an answer with no verdict and no number;
- ``garbage``: a 200 whose body is not JSON;
- ``error``: a 500;
- ``slow``: sleeps ``SLOW_S`` seconds before answering (past any test's judge timeout);
- ``busy``: "correct" after 0.2 s (``max_inflight`` shows how many calls were in flight at once).

``JudgeServer.prompts`` keeps every prompt received, ``requests`` counts them per mode.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import threading

from aiohttp import web

SLOW_S = 30.0


def _response_of(prompt: str) -> str:
    start = prompt.find("Response to grade:\n")
    end = prompt.find("\n\n", start + 19)
    return prompt[start + 19:end] if start >= 0 else prompt


def _answer(mode: str, prompt: str) -> str:
    if mode == "slow":  # answered only after the caller gave up
        return "correct"
    if mode in ("correct", "incorrect"):
        return f"The response was checked against the reference. Verdict: {mode}"
    if mode == "score10":
        return "Score: 7/10"
    if mode == "parity":
        return "correct" if len(_response_of(prompt)) % 2 == 0 else "incorrect"
    if mode == "words":
        return "I cannot tell."
    raise KeyError(mode)


class JudgeServer:
    def __init__(self) -> None:
        self.prompts: list[str] = []
        self.requests: collections.Counter[str] = collections.Counter()
        self.inflight = self.max_inflight = 0
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="judge-server")
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the test judge server did not start")

    def url(self, mode: str) -> str:
        return f"http://127.0.0.1:{self.port}/{mode}"

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        mode = request.match_info["mode"]
        body = await request.json()
        prompt = body["messages"][-1]["content"]
        self.prompts.append(prompt)
        self.requests[mode] += 1
        if mode == "busy":
            self.inflight += 1
            self.max_inflight = max(self.max_inflight, self.inflight)
            await asyncio.sleep(0.2)
            self.inflight -= 1
            mode = "correct"
        if mode == "slow":
            try:  # cut short when the server closes, so close() does not wait on it
                await asyncio.wait_for(self._stopping.wait(), SLOW_S)
            except TimeoutError:
                pass
        if mode == "garbage":
            return web.Response(text="<html>not json</html>", content_type="text/html")
        if mode == "error":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        text = _answer(mode, prompt)
        return web.json_response({"id": "x", "object": "chat.completion", "model": "judge",
                                  "choices": [{"index": 0, "finish_reason": "stop",
                                               "message": {"role": "assistant", "content": text}}]})

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._stopping = asyncio.Event()
        app = web.Application()
        app.router.add_post("/{mode}/v1/chat/completions", self._chat)
        runner = web.AppRunner(app)
        self._loop.run_until_complete(runner.setup())
        self._loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        self._runner = runner
        self._ready.set()
        self._loop.run_forever()

    def close(self) -> None:
        async def stop() -> None:
            self._stopping.set()
            await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
