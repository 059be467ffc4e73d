#!/usr/bin/env bash
# The GPU check (docs/gpu_check.md): every `gpu`-marked test, on this machine's CUDA device, in one command.
#
#   bash scripts/gpu_check.sh [extra pytest args]
#   bash scripts/gpu_check.sh --preflight   # only the CUDA check and the preflight (run before installing)
#
# Without CUDA it prints one line saying why and exits 0, so it is safe anywhere (the CPU suite runs it).
# With CUDA it first runs a preflight: every package that the offline bundle leaves to this machine
# (`bash scripts/gpu_bundle.sh --print-expected`, plus any named in GPU_CHECK_EXPECT_ALSO) must be installed;
# if one is not, it prints one line naming them and the fix, and exits 3. Then it runs `pytest -m gpu` on the
# test files that carry the marker and leaves, under gpu_check_results/<UTC timestamp>/
# (or $GPU_CHECK_RESULTS/<timestamp>/): junit.xml, pytest.log, env.json (torch, CUDA, GPU, packages),
# the tests' own records (*.json: greedy rows, logprob differences, engine diffs, train steps, throughput)
# and summary.json. The last line printed says where; the exit code is pytest's.
# AREAL_GPU_CHECK_REHEARSE=cpu runs the whole kit on the CPU instead (checks the kit, not CUDA).
set -uo pipefail

preflight_only=""
if [ "${1:-}" = "--preflight" ]; then preflight_only=1; shift; fi

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

# Preflight: what the bundle expects on this machine. It needs neither the project nor the bundle, so
# `--preflight` can run before the offline install, whose pip would otherwise fail on the first one missing.
expected="$(bash scripts/gpu_bundle.sh --print-expected | tr '\n' ' ')"
pre=$("$PY" - "$expected" "${GPU_CHECK_EXPECT_ALSO:-}" 2>&1 <<'EOF'
import sys
from importlib import metadata

expected = sys.argv[1].split()
names = list(dict.fromkeys(expected + sys.argv[2].replace(",", " ").split()))
found, missing = {}, []
for n in names:
    try:
        found[n] = metadata.version(n)
    except metadata.PackageNotFoundError:
        missing.append(n)
if not missing:
    print("ok: " + ", ".join(f"{n} {v}" for n, v in found.items()))
    raise SystemExit
fix = [f"python -m pip install {' '.join(missing)} (where an index is reachable)"]
bundled = [n for n in missing if n in expected]
if bundled:
    fix.append(f"build the bundle with GPU_BUNDLE_INCLUDE={','.join(bundled)} bash scripts/gpu_bundle.sh "
               f"(or GPU_BUNDLE_FULL=1) and install it offline as before")
print(f"missing {', '.join(missing)}: the offline bundle expects {'it' if len(missing) == 1 else 'them'} "
      f"on this machine (docs/gpu_check.md). Fix: {'; or '.join(fix)}")
EOF
) || pre="the preflight failed to run ($PY): $(echo "$pre" | tail -n 1)"
if [ "${pre#ok: }" = "$pre" ]; then
    echo "gpu_check: $pre"
    exit 3
fi
if [ -n "$preflight_only" ]; then
    echo "gpu_check: preflight ok: ${pre#ok: }"
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

# Only the test files that carry the gpu marker: collecting all of tests/ would import every test module,
# and the bundle carries only what the gpu tests import (no hypothesis, submitit, openai-agents, ...).
# tests/integration/test_gpu_check_kit.py checks that this finds every test that `-m gpu tests` collects.
mapfile -t files < <(grep -rlE --include='test_*.py' 'mark\.gpu\b' tests | sort)
# -o addopts: the project's default addopts deselect `gpu`; keep only its -ra (the skip reasons).
"$PY" -m pytest "${files[@]}" -m gpu -o addopts="-ra" -p no:cacheprovider --basetemp="$out/tmp" \
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
