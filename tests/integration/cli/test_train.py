"""A short real `areal train`: CLI → local launcher → hf server + torchrun trainer (2 processes).

One run is interrupted with SIGINT once its first recover state exists (Ctrl-C: no orphans, no
stale ports), then resumed with resume=auto; the resumed run must continue from the recovered step
and finish. The final HF export must load into the hf server and greedy-decode like transformers.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from train_runs import _areal, _descendants_alive, _env, _overrides, _records

pytestmark = pytest.mark.timeout(400)


@pytest.mark.e2e  # a real run interrupted and resumed: CI's e2e phase
def test_train_interrupt_resume_and_export(tmp_path, tiny_model_dir):
    import psutil

    run_dir = tmp_path / "runs" / "itest" / "t0"
    proc = _areal(_overrides(tmp_path, tiny_model_dir))
    # Wait for the first recover state, then Ctrl-C the whole `areal train`.
    deadline = time.time() + 240
    children: list[int] = []
    while time.time() < deadline and proc.poll() is None:
        try:
            children = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)] or children
        except psutil.NoSuchProcess:
            break
        if (run_dir / "recover" / "latest.json").exists():
            break
        time.sleep(0.5)
    assert proc.poll() is None, f"areal train ended early:\n{proc.communicate()[0][-3000:]}"
    assert (run_dir / "recover" / "latest.json").exists(), "no recover state within the deadline"
    servers = [json.loads(p.read_text()) for p in (run_dir / "servers").glob("*.json")]
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out[-3000:]
    assert "interrupted" in out
    time.sleep(0.5)
    assert _descendants_alive(children) == [], "children survived Ctrl-C"
    from areal_cli.utils.network import port_is_free

    for rec in servers:
        assert port_is_free(int(rec["address"].rsplit(":", 1)[1])), f"stale port {rec['address']}"
    recovered = json.loads((run_dir / "recover" / "latest.json").read_text())["step"]
    assert recovered >= 2 and recovered % 2 == 0

    # Resume: continues after the recovered step and finishes.
    res = subprocess.run([sys.executable, "-m", "areal_cli.cli.main", "train",
                          *_overrides(tmp_path, tiny_model_dir, resume="auto")],
                         capture_output=True, text=True, env=_env(), timeout=300)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    recs = _records(run_dir)
    starts = [r for r in recs if r["kind"] == "event" and r["event"] == "start"]
    assert starts[-1]["resumed_from"] == recovered
    steps = [r["step"] for r in recs if r["kind"] == "train"]
    assert steps == list(range(1, 7)), steps  # no gap, no duplicate after truncation at the recover step
    for r in recs:
        if r["kind"] == "train":
            assert 0.0 <= r["reward/mean"] <= 1.0 and r["staleness/max"] <= 1  # the bound holds across resume
    # The async step's threads (StepThreads): the rule replayed on the logged step and wait times gives
    # the count every step ran with; each (resumed) segment starts on one.
    from areal_cli.utils.concurrency import StepThreads, cores_per_rank

    train = [r for r in recs if r["kind"] == "train"]
    rule = None
    for r in train:
        if r["step"] in (1, recovered + 1):
            rule = StepThreads(cores_per_rank(1), sync=False)
        assert r["perf/train_threads"] == rule.n, (r["step"], [x["perf/train_threads"] for x in train])
        rule.observe(r["perf/gen_wait_s"], r["perf/step_s"])
    assert train[0]["perf/train_threads"] == 1
    # Async-mode resume guarantee: no prompt is trained on twice, before and after the resume.
    positions = [p for r in recs if r["kind"] == "train" for p in r["data/positions"]]
    assert len(positions) == len(set(positions)) == 6 * 2
    evals = [r for r in recs if r["kind"] == "eval"]
    assert evals and evals[-1]["step"] == 6 and 0.0 <= evals[-1]["eval/pass@1"] <= 1.0
    assert (run_dir / "learning_curve.png").stat().st_size > 1000
    assert (run_dir / "summary.json").exists()
    assert any((run_dir / "tensorboard").iterdir())

    # The final HF export loads into the hf server and decodes like transformers.
    final = run_dir / "checkpoints" / "final"
    assert (final / "config.json").exists()
    _check_hf_export_serves(str(final), tmp_path)


def _check_hf_export_serves(model_dir: str, tmp_path: Path) -> None:
    import httpx
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from areal_cli.utils.network import find_free_port
    from areal_cli.utils.procs import ManagedProcess

    port = find_free_port()
    srv = ManagedProcess("hf", [sys.executable, "-m", "areal_cli.inference.hf_server", "--model-path", model_dir,
                                "--host", "127.0.0.1", "--port", str(port)], str(tmp_path / "export_server.log"),
                         env={"OMP_NUM_THREADS": "1"}).start()
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            assert srv.alive(), srv.tail()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        tok = AutoTokenizer.from_pretrained(model_dir)
        ids = tok.apply_chat_template([{"role": "user", "content": "Tom has 3 apples and buys 4 more."}],
                                      add_generation_prompt=True, tokenize=True)["input_ids"]
        r = httpx.post(f"http://127.0.0.1:{port}/generate", timeout=60, json={
            "input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}})
        assert r.status_code == 200, r.text
        served = r.json()["output_ids"]
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        ref = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()
        if ref and ref[-1] == tok.eos_token_id and served and served[-1] != tok.eos_token_id:
            ref = ref[:-1]
        assert served[: len(ref)] == ref
    finally:
        srv.stop()
