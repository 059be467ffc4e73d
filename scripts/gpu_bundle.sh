#!/usr/bin/env bash
# Build the offline bundle of the GPU check (docs/gpu_check.md) and report its size.
#
#   bash scripts/gpu_bundle.sh [OUT_DIR]        # default dist/gpu_bundle
#   GPU_BUNDLE_EXTRAS=deepspeed,megatron bash scripts/gpu_bundle.sh   # also the optional engines
#   GPU_BUNDLE_EXCLUDE='numpy|scipy|pyarrow|pandas' bash scripts/gpu_bundle.sh  # the GPU machine has these
#
# The bundle is the project's wheel (built from the committed HEAD), a wheel of every package it and the
# test runner (pytest, pytest-timeout) need at the versions installed here, and a tarball of the HEAD tree
# (tests/, scripts/, benchmarks/: what the check runs). Left out: torch and its CUDA stack (triton,
# nvidia-*, cuda-*), which the GPU machine already has. The wheels are for this machine's platform and
# Python (see the report's first line); build it on the same OS/arch/Python minor as the GPU machine.
set -euo pipefail

cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
OUT="${1:-dist/gpu_bundle}"
EXTRAS="${GPU_BUNDLE_EXTRAS:-}"
rm -rf "$OUT"
mkdir -p "$OUT/wheels"
OUT="$(cd "$OUT" && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# 1. the project, as committed (the shared working tree may hold others' unfinished edits)
mkdir "$tmp/proj"
git archive --format=tar HEAD | tar -x -C "$tmp/proj"
git archive --format=tar.gz -o "$OUT/areal-cli-src.tar.gz" --prefix=areal-cli/ HEAD
# from inside the tree: setuptools resolves the src/ layout against the working directory
(cd "$tmp/proj" && "$PY" -m pip wheel --quiet --no-deps --no-build-isolation -w "$OUT/wheels" .)

# 2. the dependency closure at the installed versions, from the installed metadata
"$PY" - "$EXTRAS" "${GPU_BUNDLE_EXCLUDE:-}" > "$tmp/reqs.txt" <<'EOF'
import re
import sys
from importlib import metadata

from packaging.requirements import Requirement

# what the GPU machine's CUDA PyTorch brings, plus what the caller says it already has
also = f"|{sys.argv[2]}" if sys.argv[2] else ""
EXCLUDE = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*|pytorch-triton.*" + also + r")$")
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()  # noqa: E731
extras = [e for e in sys.argv[1].split(",") if e]
todo = [("areal-cli", set(extras)), ("pytest", set()), ("pytest-timeout", set())]
seen: dict[str, str] = {}
while todo:
    name, want = todo.pop()
    dist = metadata.distribution(name)
    key = norm(dist.metadata["Name"])
    if key in seen and not want:
        continue
    seen[key] = dist.version
    for r in map(Requirement, dist.requires or []):
        env_extras = [""] + sorted(want)
        if r.marker and not any(r.marker.evaluate({"extra": e}) for e in env_extras):
            continue
        if EXCLUDE.match(norm(r.name)) or (norm(r.name) in seen and not r.extras):
            continue
        todo.append((r.name, set(r.extras)))
for key, version in sorted(seen.items()):
    if key != "areal-cli":
        print(f"{key}=={version}")
EOF
# pip wheel takes a registry wheel as it is and builds one from an sdist where none exists
"$PY" -m pip wheel --quiet --no-deps -w "$OUT/wheels" -r "$tmp/reqs.txt"
cp "$tmp/reqs.txt" "$OUT/requirements.txt"

# 3. report
n=$(ls "$OUT/wheels" | wc -l)
plat=$("$PY" -c 'import sys, sysconfig; print(sysconfig.get_platform(), "cp%d%d" % sys.version_info[:2])')
echo "gpu_bundle: $plat," \
     "extras: ${EXTRAS:-none}, excluded besides torch/CUDA: ${GPU_BUNDLE_EXCLUDE:-none}"
echo "gpu_bundle: largest wheels:"
ls -S "$OUT/wheels" | head -8 | while read -r w; do
    printf '    %6s  %s\n' "$(du -h "$OUT/wheels/$w" | cut -f1)" "$w"
done
echo "gpu_bundle: $n wheels $(du -sh "$OUT/wheels" | cut -f1)," \
     "source $(du -h "$OUT/areal-cli-src.tar.gz" | cut -f1)," \
     "total $(du -sh "$OUT" | cut -f1) in $OUT"
