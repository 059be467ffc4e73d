"""Server argv/env builders, readiness failures with log tail + likely cause, sampling math."""

from __future__ import annotations

import sys

import pytest
import torch

from areal_cli.errors import LaunchError
from areal_cli.inference.launch import build_server_cmd, likely_cause, wait_until_ready
from areal_cli.inference.server.sampling import SamplingParams, sample_next
from areal_cli.utils.network import find_free_port
from areal_cli.utils.procs import ManagedProcess


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_hf_cmd():
    argv, env = build_server_cmd("hf", "/m", "127.0.0.1", 1234, tp_size=1, dtype="bf16", device="cpu", seed=3,
                                 api_key="k", context_length=512, extra=["--max-running-requests", "8"])
    assert argv[:3] == [sys.executable, "-m", "areal_cli.inference.hf_server"]
    assert _flag(argv, "--model-path") == "/m" and _flag(argv, "--port") == "1234"
    assert _flag(argv, "--dtype") == "bfloat16" and _flag(argv, "--random-seed") == "3"
    assert _flag(argv, "--api-key") == "k" and _flag(argv, "--context-length") == "512"
    assert argv[-2:] == ["--max-running-requests", "8"] and env["HF_HUB_OFFLINE"] == "1"
    from areal_cli.inference.hf_server import build_parser

    ns = build_parser().parse_args(argv[3:])  # every flag we emit is one the server accepts
    assert ns.model_path == "/m" and ns.port == 1234 and ns.api_key == "k"


def test_sglang_cmd():
    argv, _ = build_server_cmd("sglang", "/m", "0.0.0.0", 30000, tp=2, dtype="float16", device="cuda")
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    assert _flag(argv, "--tp-size") == "2" and _flag(argv, "--dtype") == "float16"
    assert _flag(argv, "--device") == "cuda" and _flag(argv, "--host") == "0.0.0.0"



def test_sglang_cmd_pp_health_and_extra_flags():
    argv, env = build_server_cmd("sglang", "/m", "127.0.0.1", 30000, tp=2, pp=2,
                                 extra=["--mem-fraction-static", "0.8", "--trust-remote-code"])
    assert _flag(argv, "--pp-size") == "2" and _flag(argv, "--tp-size") == "2"
    assert argv[-3:] == ["--mem-fraction-static", "0.8", "--trust-remote-code"]  # last: they win
    assert env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "0"
    vargv, _ = build_server_cmd("vllm", "/m", "127.0.0.1", 8000, pp=3, python="/p")
    assert _flag(vargv, "--pipeline-parallel-size") == "3"
    with pytest.raises(LaunchError, match="pp=2"):
        build_server_cmd("hf", "/m", "127.0.0.1", 1, pp=2)


def test_launcher_server_args_reach_every_server(tmp_path):
    from areal_cli.config.schema import ExperimentConfig
    from areal_cli.job.layout import ServerSpec
    from areal_cli.launchers.local import server_argv

    cfg = ExperimentConfig()
    cfg.launcher.server_args = ["--max-running-requests", "4"]
    spec = ServerSpec(index=0, backend="hf", tp=1, pp=1)
    argv, _ = server_argv(cfg, spec, 1234, str(tmp_path / "m"), "127.0.0.1", str(tmp_path))
    assert argv[-2:] == ["--max-running-requests", "4"]


def test_the_hf_prefix_cache_is_off_for_single_turn_runs_and_the_users_flag_wins(tmp_path):
    """A single-turn RL run never continues a finished row, so its servers keep no prefix cache; multi-turn
    runs get the automatic budget. The parsed command line is what the server sees."""
    import argparse

    from areal_cli.config.schema import ExperimentConfig
    from areal_cli.inference.hf_server import build_parser
    from areal_cli.job.layout import ServerSpec
    from areal_cli.launchers.local import server_argv

    def budget(workflow: str, user: list[str]) -> int:
        cfg = ExperimentConfig()
        cfg.workflow.name, cfg.launcher.server_args = workflow, user
        argv, _ = server_argv(cfg, ServerSpec(index=0, backend="hf", tp=1, pp=1), 1234, str(tmp_path / "m"),
                              "127.0.0.1", str(tmp_path))
        args, _ = build_parser().parse_known_args(argv[argv.index("-m") + 2:])
        assert isinstance(args, argparse.Namespace)
        return args.prefix_cache_tokens

    assert budget("rlvr", []) == 0
    assert budget("multi_turn", []) == -1
    assert budget("rlvr", ["--prefix-cache-tokens", "4096"]) == 4096


def test_vllm_cmd_env_for_cpu(tmp_path):
    argv, env = build_server_cmd("vllm", "/m", "127.0.0.1", 8000, dtype="float32", device="cpu",
                                 cache_root=str(tmp_path), python="/venv/bin/python", context_length=256)
    assert argv[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert _flag(argv, "--model") == "/m" and _flag(argv, "--tensor-parallel-size") == "1"
    assert _flag(argv, "--logprobs-mode") == "processed_logprobs" and _flag(argv, "--max-model-len") == "256"
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and env["VLLM_CACHE_ROOT"] == str(tmp_path)
    assert env["VLLM_SERVER_DEV_MODE"] == "1"


def test_vllm_cmd_for_a_dir_with_its_own_processor(tmp_path):
    """The built-in tiny VLM's dir (its processor_config.json maps AutoProcessor to processing_tiny_vl.py) is
    served through vLLM's Transformers backend with its code trusted; any other dir is not."""
    import json

    (tmp_path / "processor_config.json").write_text(json.dumps(
        {"processor_class": "Qwen2_5_VLProcessor",
         "auto_map": {"AutoProcessor": "processing_tiny_vl.ImagesOnlyQwen2_5_VLProcessor"}}))
    argv, _ = build_server_cmd("vllm", str(tmp_path), "127.0.0.1", 8000, python="/p")
    assert _flag(argv, "--model-impl") == "transformers" and "--trust-remote-code" in argv
    assert "--enable-scale-out" in argv  # routes the token-in endpoint that takes images
    (tmp_path / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2_5_VLProcessor"}))
    argv, _ = build_server_cmd("vllm", str(tmp_path), "127.0.0.1", 8000, python="/p")
    assert "--trust-remote-code" not in argv and "--model-impl" not in argv


def test_bad_backend_or_dtype():
    with pytest.raises(LaunchError, match="unknown inference backend"):
        build_server_cmd("tgi", "/m", "h", 1)
    with pytest.raises(LaunchError, match="unknown dtype"):
        build_server_cmd("hf", "/m", "h", 1, dtype="int3")


@pytest.mark.parametrize("log, cause", [
    ("OSError: [Errno 98] Address already in use", "port is already taken"),
    ("ModuleNotFoundError: No module named 'vllm'", "setup_vllm_env.sh"),
    ("ModuleNotFoundError: No module named 'flash_attn'", "'flash_attn'"),
    ("torch.OutOfMemoryError: CUDA out of memory. Tried", "GPU ran out of memory"),
    ("error: --model-path /x is not a directory", "model path is wrong"),
    ("", "unknown"),
])
def test_likely_cause(log, cause):
    assert cause in likely_cause(log)


def test_wait_until_ready_reports_log_tail_and_cause(tmp_path):
    log = str(tmp_path / "srv.log")
    proc = ManagedProcess("fake", [sys.executable, "-c",
                                   "import sys; print('loading...'); print('OSError: [Errno 98] Address already "
                                   "in use'); sys.exit(3)"], log).start()
    with pytest.raises(LaunchError) as ei:
        wait_until_ready(f"127.0.0.1:{find_free_port()}", 30, proc, log, poll_s=0.1)
    msg = str(ei.value)
    assert "exit code 3" in msg and "Address already in use" in msg and "port is already taken" in msg


def test_wait_until_ready_times_out(tmp_path):
    log = str(tmp_path / "srv.log")
    proc = ManagedProcess("sleeper", [sys.executable, "-c", "import time; print('stuck'); time.sleep(60)"],
                          log).start()
    try:
        with pytest.raises(LaunchError, match="not ready after 1s"):
            wait_until_ready(f"127.0.0.1:{find_free_port()}", 1, proc, log, poll_s=0.1)
    finally:
        proc.stop(timeout=5)
    assert not proc.alive()


def test_sampling_logprob_convention_and_truncation():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.5, top_k=1),
              SamplingParams(temperature=2.0, top_k=3), SamplingParams(temperature=0.7, top_p=0.3)]
    g = torch.Generator().manual_seed(0)
    seen = [set() for _ in params]
    for _ in range(200):
        ids, lps = sample_next(logits, params, [5] * 4, set(), g)
        for i, t in enumerate(ids.tolist()):
            seen[i].add(t)
        temps = torch.tensor([1.0, 1.0, 2.0, 0.7]).unsqueeze(1)
        want = torch.log_softmax(logits / temps, -1).gather(1, ids.unsqueeze(1)).squeeze(1)
        assert torch.allclose(lps, want)
    assert seen[0] == {int(logits[0].argmax())} and seen[1] == {int(logits[1].argmax())}
    assert seen[2] <= set(logits[2].topk(3).indices.tolist()) and len(seen[2]) > 1
    probs = torch.softmax(logits[3] / 0.7, -1)
    order = probs.argsort(descending=True)
    nucleus = set()
    mass = 0.0
    for t in order.tolist():
        nucleus.add(t)
        mass += float(probs[t])
        if mass >= 0.3:
            break
    assert seen[3] <= nucleus


def test_min_new_tokens_blocks_stop_ids():
    logits = torch.full((1, 10), -5.0)
    logits[0, 3] = 10.0  # token 3 (eos) dominates
    p = SamplingParams(temperature=0.0, min_new_tokens=2)
    ids, _ = sample_next(logits, [p], [0], {3}, torch.Generator())
    assert ids.item() != 3
    ids, _ = sample_next(logits, [p], [2], {3}, torch.Generator())
    assert ids.item() == 3
