"""Your own data through the real CLI in a subprocess: a field mapping that names no column is one line and
exit 1 before anything starts; a chat-formatted JSONL with a held-out share trains (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[3] / "src"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_COLOR": "1", "COLUMNS": "200",
       "PYTHONPATH": os.pathsep.join([str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])])}
ENV.pop("AREAL_DEBUG", None)


def areal(*args: str, timeout: float = 120, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "areal_cli.cli.main", *args], check=False, capture_output=True,
                          text=True, env=ENV, timeout=timeout, cwd=cwd)


def test_wrong_prompt_field_is_one_line_naming_the_columns(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps({"problem": f"{i}+1?", "solution": f"#### {i + 1}"}) + "\n"
                            for i in range(3)))
    p = areal("validate-config", f"dataset.train_path={path}", "dataset.prompt_field=wrong")
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert p.stderr.strip().splitlines() == [
        f"error: dataset.prompt_field: 'wrong' is not a column of {path} (columns: problem, solution; read from "
        "its first 3 rows) — fix: set dataset.prompt_field to one of its columns"]
    assert "Traceback" not in p.stdout + p.stderr
    p = areal("validate-config", "--json", f"dataset.train_path={path}", "dataset.prompt_field=problme")
    err = json.loads(p.stdout)["error"]
    assert p.returncode == 1 and err["path"] == "dataset.prompt_field" and "did you mean 'problem'?" in err["hint"]


def test_gsm8k_preset_needs_its_prepared_files(tmp_path):
    """dataset=gsm8k reads data/gsm8k/*.jsonl relative to where areal runs: missing there, one line that
    names the path; once `python -m areal_cli.data.prepare gsm8k` wrote them, the config is valid."""
    p = areal("validate-config", "dataset=gsm8k", cwd=tmp_path)
    assert p.returncode == 1 and p.stderr.startswith("error: dataset.train_path: dataset file "
                                                     "'data/gsm8k/train.jsonl' does not exist")
    src = tmp_path / "copy"
    src.mkdir()
    for split in ("train", "test"):
        (src / f"{split}.jsonl").write_text(json.dumps({"question": "1+1?", "answer": "1+1=2\n#### 2"}) + "\n")
    prep = subprocess.run([sys.executable, "-m", "areal_cli.data.prepare", "gsm8k", "--from", str(src)],
                          check=False, capture_output=True, text=True, env=ENV, timeout=120, cwd=tmp_path)
    assert prep.returncode == 0, prep.stderr
    p = areal("validate-config", "dataset=gsm8k", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "valid configuration" in p.stdout and "dataset" not in p.stdout + p.stderr  # no data warning


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_train_on_chat_jsonl_with_a_held_out_share(tmp_path):
    """SFT warm start + GRPO on a chat-formatted JSONL (system and few-shot turns); 20% held out for eval."""
    rows = [{"messages": [{"role": "system", "content": "Answer with the number only."},
                          {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
                          {"role": "user", "content": f"What is {i}+3?"}],
             "answer": f"{i}+3={i + 3}\n#### {i + 3}"} for i in range(40)]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    p = areal("train", f"cluster.fileroot={tmp_path / 'root'}", f"dataset.train_path={data}",
              "dataset.prompt_field=messages", "dataset.test_fraction=0.2", "dataset.max_prompt_len=128",
              "trainer.total_steps=2", "trainer.sft_warmup_steps=2", "trainer.eval_every=2", "algo.batch_size=2",
              "rollout.group_size=2", "stats.live=false", timeout=540)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    (run_dir,) = (tmp_path / "root" / "runs" / "cpu_default").iterdir()  # named by its start time
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in recs if r["kind"] == "train"] == [1, 2]
    evals = [r for r in recs if r["kind"] == "eval"]
    assert evals and all(r["eval/n_items"] == 8 for r in evals)  # 20% of 40 rows
