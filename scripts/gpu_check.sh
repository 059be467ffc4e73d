#!/usr/bin/env bash
# The GPU check (docs/gpu_check.md): every `gpu`-marked test, on this machine's CUDA device, in one command.
#
#   bash scripts/gpu_check.sh [extra pytest args]
#
# Without CUDA it prints one line saying why and exits 0, so it is safe anywhere (the CPU suite runs it).
# With CUDA it runs `pytest -m gpu tests` and leaves, under gpu_check_results/<UTC timestamp>/
# (or $GPU_CHECK_RESULTS/<timestamp>/): junit.xml, pytest.log, env.json (torch, CUDA, GPU, packages),
# the tests' own records (*.json: greedy rows, logprob differences, engine diffs, train steps, throughput)
# and summary.json. The last line printed says where; the exit code is pytest's.
# AREAL_GPU_CHECK_REHEARSE=cpu runs the whole kit on the CPU instead (checks the kit, not CUDA).
set -uo pipefail

cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"

# Why there is no CUDA (empty when there is one). Python's own warnings go nowhere: one line only.
why=$("$PY" - 2>/dev/null <<'EOF'
import os
try:
    import torch
except Exception as e:  # noqa: BLE001
    print(f"torch is not importable ({type(e).__name__}: {e})")
    raise SystemExit
if torch.cuda.is_available() or os.environ.get("AREAL_GPU_CHECK_REHEARSE") == "cpu":
    raise SystemExit
if torch.version.cuda is None:
    print(f"torch {torch.__version__} is a CPU build (no CUDA support)")
else:
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"
          f" (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!s})")
EOF
) || why="python ($PY) failed to start"
if [ -n "$why" ]; then
    echo "gpu_check: skipped, no CUDA: $why"
    exit 0
fi

out="${GPU_CHECK_RESULTS:-gpu_check_results}/$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
export AREAL_GPU_CHECK_OUT="$out"

"$PY" - "$out/env.json" <<'EOF'
import json, platform, sys
from importlib import metadata

import torch

info = {"python": sys.version.split()[0], "platform": platform.platform(), "torch": torch.__version__,
        "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "packages": {n: metadata.version(n) for n in (
            "areal-cli", "transformers", "megatron-core", "deepspeed", "transformer-engine", "flash-attn")
            if any(True for _ in metadata.distributions(name=n))}}
json.dump(info, open(sys.argv[1], "w"), indent=2)
print(f"gpu_check: torch {info['torch']}, CUDA {info['cuda']}, GPUs {info['gpus'] or 'none (rehearsal)'}")
EOF

# -o addopts: the project's default addopts deselect `gpu`; keep only its -ra (the skip reasons).
"$PY" -m pytest tests -m gpu -o addopts="-ra" -p no:cacheprovider --basetemp="$out/tmp" \
    --junitxml="$out/junit.xml" "$@" 2>&1 | tee "$out/pytest.log"
rc=${PIPESTATUS[0]}

"$PY" - "$out" "$rc" <<'EOF'
import json, sys
import xml.etree.ElementTree as ET
from pathlib import Path

out, rc = Path(sys.argv[1]), int(sys.argv[2])
tests = []
if (out / "junit.xml").exists():
    for case in ET.parse(out / "junit.xml").getroot().iter("testcase"):
        outcome, detail = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome, detail = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag], \
                    (el.get("message") or "")[:500]
                break
        tests.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": float(case.get("time") or 0), "detail": detail})
counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error", "skipped")}
records = sorted(p.name for p in out.glob("*.json") if p.name not in ("summary.json", "env.json"))
summary = {"pytest_exit_code": rc, "counts": counts, "tests": tests, "records": records,
           "env": json.loads((out / "env.json").read_text()) if (out / "env.json").exists() else None}
(out / "summary.json").write_text(json.dumps(summary, indent=2))
print(f"gpu_check: {counts['passed']} passed, {counts['failed'] + counts['error']} failed, "
      f"{counts['skipped']} skipped (pytest exit {rc}); results in {out} (summary.json)")
EOF
exit "$rc"
