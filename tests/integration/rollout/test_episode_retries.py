"""What the episode runner retries, against a real hf server and a real dead address.

An episode whose server is unreachable is run again until the retry window ends (the launcher may be
restarting the server). An episode whose request the server refuses (4xx: here, longer than the server's
context) fails at once with the server's reason: retrying would be refused again, and a run used to wait
out the whole window (300 s) with nothing in its logs.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from hf_server_helpers import prompts, start_hf_server

from areal_cli.api.io_struct import GenerationConfig, ModelRequest
from areal_cli.inference.client import RemoteInferenceEngine, RequestRejected
from areal_cli.rollout.data_stream import StreamItem
from areal_cli.rollout.episodes import EpisodeRunner, is_transport_error
from areal_cli.utils.network import find_free_port


class OneRequest:
    """A workflow of one generation request."""

    def __init__(self, prompt: list[int], max_new_tokens: int):
        self.prompt, self.max_new_tokens = prompt, max_new_tokens

    async def arun_episode(self, engine, data):
        g = GenerationConfig(max_new_tokens=self.max_new_tokens, min_new_tokens=self.max_new_tokens)
        resp = await engine.agenerate(ModelRequest(input_ids=self.prompt, gconfig=g))
        return SimpleNamespace(tokens=resp.output_tokens, meta={})


@pytest.fixture(scope="module")
def small_context_server(tiny_model_dir, tmp_path_factory):
    h = start_hf_server(tiny_model_dir, tmp_path_factory, context_length=64)
    yield h
    h.stop()


def _prompt(model_dir: str) -> list[int]:
    from transformers import AutoTokenizer

    return prompts(AutoTokenizer.from_pretrained(model_dir), 1, seed=0)[0]


def test_a_refused_request_fails_the_episode_at_once(small_context_server, tiny_model_dir):
    prompt = _prompt(tiny_model_dir)
    runner = EpisodeRunner(OneRequest(prompt, 64), retry_window_s=60, wait_s=0.2)
    engine = RemoteInferenceEngine([small_context_server.address], "hf", timeout_s=30)
    t0 = time.monotonic()
    with pytest.raises(RequestRejected) as e:
        asyncio.run(runner.arun_episode(engine, StreamItem({}, 0)))
    assert e.value.status == 400 and "context length 64" in str(e.value)
    assert runner.retried == 0 and time.monotonic() - t0 < 30
    # the same workflow within the context runs
    ok = EpisodeRunner(OneRequest(prompt, 64 - len(prompt)), retry_window_s=60, wait_s=0.2)
    out = asyncio.run(ok.arun_episode(engine, StreamItem({}, 0)))
    assert len(out.tokens) == 64 - len(prompt) and out.positions == [0]


def test_an_unreachable_server_is_retried_until_the_window_ends(tiny_model_dir):
    runner = EpisodeRunner(OneRequest(_prompt(tiny_model_dir), 4), retry_window_s=5.0, wait_s=0.2)
    engine = RemoteInferenceEngine([f"127.0.0.1:{find_free_port()}"], "hf", timeout_s=5, retries=0, backoff_s=0.05)
    with pytest.raises(Exception) as e:
        asyncio.run(runner.arun_episode(engine, StreamItem({}, 0)))
    assert is_transport_error(e.value) and runner.retried >= 1
