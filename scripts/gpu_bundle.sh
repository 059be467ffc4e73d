#!/usr/bin/env bash
# Build the offline bundle of the GPU check (docs/gpu_check.md) and report its size.
#
#   bash scripts/gpu_bundle.sh [OUT_DIR]     # default dist/gpu_bundle: what the check needs, ~38 MB
#   GPU_BUNDLE_INCLUDE=matplotlib,tensorboard bash scripts/gpu_bundle.sh   # also these EXPECTED packages
#   GPU_BUNDLE_FULL=1 bash scripts/gpu_bundle.sh      # every project dependency, EXPECTED ones included
#   GPU_BUNDLE_EXTRAS=deepspeed,megatron bash scripts/gpu_bundle.sh   # also the optional engines
#   GPU_BUNDLE_EXCLUDE='regex|of|names' bash scripts/gpu_bundle.sh    # leave out more: the machine has them
#   GPU_BUNDLE_PYTHON=3.12 bash scripts/gpu_bundle.sh   # wheels for the GPU machine's Python (manylinux x86_64)
#   bash scripts/gpu_bundle.sh --print-expected   # the EXPECTED names, one a line (gpu_check.sh reads them)
#
# The bundle is the project's wheel (built from the committed HEAD), a wheel of every package that the GPU
# check imports and that the GPU machine cannot be expected to have, at the versions installed here, and a
# tarball of the HEAD tree (tests/, scripts/, benchmarks/: what the check runs). The wheels are for this
# machine's platform and Python (see the report's first line); build it on the same OS/arch/Python minor as
# the GPU machine. expected.txt in the bundle lists what it leaves to the machine, and who needs each.
#
# Left out, so the GPU machine must have them (scripts/gpu_check.sh checks EXPECTED before it runs):
# - torch, its CUDA stack (triton, nvidia-*, cuda-*) and torch's own dependency closure, read from the
#   installed torch's metadata (sympy, mpmath, networkx, jinja2, markupsafe, fsspec, filelock,
#   typing-extensions, setuptools): a CUDA torch is installed with them.
# - EXPECTED below: heavy native packages that CUDA PyTorch images ship (the walk stops at them, so their
#   own dependencies are theirs: fonttools, kiwisolver, grpcio, tensorboard-data-server, ...).
# - LEFT_OUT below: the project's dependencies that the check never imports.
set -euo pipefail

cd "$(dirname "$0")/.."

# The project's dependencies (pyproject.toml) that neither the gpu-marked tests nor the `areal train` runs
# they start import: each is imported lazily, only on the path named. A fresh venv with torch, EXPECTED and
# this bundle passes the check (docs/gpu_check.md); grep the imports before adding one here.
LEFT_OUT=(
  "datasets              # data/datasets.py, dataset.* file paths; the check uses builtin:arith"
  "hydra-optuna-sweeper  # sweep/: areal sweep searches only (pulls optuna, sqlalchemy, alembic)"
  "peft                  # engines/lora.py: LoRA only; the check trains full weights"
  "submitit              # launchers/slurm.py: the SLURM launcher only"
  "math-verify           # rewards/math_reward.py: the math reward only; builtin:arith has its own"
  "openai                # rollout/openai_client.py: agent workflows and the proxy only"
)
# Packages that the check imports and that CUDA PyTorch images ship: most of the bundle's weight
# (docs/gpu_check.md gives the evidence and the sizes). A machine without one fails the preflight of
# scripts/gpu_check.sh, which names it and the option that bundles it (GPU_BUNDLE_INCLUDE, GPU_BUNDLE_FULL).
EXPECTED=(
  "numpy       # transformers, the engines; pytorch/pytorch images (conda) and NGC's PyTorch container"
  "pillow      # matplotlib, tensorboard; torchvision needs it, and both of those images ship torchvision"
  "tensorboard # trainer/stats.py SummaryWriter (stats.tensorboard=true); NGC's release notes list it"
  "matplotlib  # cli/report.py, learning_curve.png after areal train; not in the pytorch/pytorch images"
)
names() { local e; for e in "$@"; do echo "${e%%[[:space:]]*}"; done; }

if [ "${1:-}" = "--print-expected" ]; then
    names "${EXPECTED[@]}"
    exit 0
fi

PY="${PYTHON:-python}"
OUT="${1:-dist/gpu_bundle}"
EXTRAS="${GPU_BUNDLE_EXTRAS:-}"
FULL="${GPU_BUNDLE_FULL:-}"
INCLUDE="${GPU_BUNDLE_INCLUDE:-}"
TARGET_PY="${GPU_BUNDLE_PYTHON:-}"  # e.g. 3.12: wheels for the GPU machine's Python (default: this one's)
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
"$PY" - "$EXTRAS" "${GPU_BUNDLE_EXCLUDE:-}" "$FULL" "$INCLUDE" "$(names "${LEFT_OUT[@]}")" \
    "$(names "${EXPECTED[@]}")" "$tmp/reqs.txt" "$OUT/expected.txt" <<'EOF'
import re
import sys
from importlib import metadata

from packaging.requirements import Requirement

(extras_arg, exclude_arg, full, include_arg, left_out_arg, expected_arg,
 reqs_path, expected_path) = sys.argv[1:]
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()  # noqa: E731
full = full not in ("", "0")
CUDA = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*|pytorch-triton.*)$")
USER_EXCLUDE = re.compile(rf"^({exclude_arg})$") if exclude_arg else None
LEFT_OUT = set() if full else {norm(n) for n in left_out_arg.split()}
INCLUDE = {norm(n) for n in include_arg.replace(",", " ").split()}
EXPECTED = {norm(n) for n in expected_arg.split()}
unknown = INCLUDE - EXPECTED
if unknown:
    sys.exit(f"gpu_bundle: GPU_BUNDLE_INCLUDE names {sorted(unknown)}, which are not expected on the GPU "
             f"machine (expected: {sorted(EXPECTED)}); the bundle has every other package the check needs")
if not full:
    EXPECTED -= INCLUDE
else:
    EXPECTED = set()


def wanted(r: Requirement, extras: set[str]) -> bool:
    return not r.marker or any(r.marker.evaluate({"extra": e}) for e in [""] + sorted(extras))


# torch's own closure: a CUDA torch is installed with these
torch_deps: set[str] = set()
todo = ["torch"]
while todo:
    for r in map(Requirement, metadata.requires(todo.pop()) or []):
        if wanted(r, set()) and not CUDA.match(norm(r.name)) and norm(r.name) not in torch_deps:
            torch_deps.add(norm(r.name))
            todo.append(r.name)


def brought_by(key: str) -> str | None:
    """Why the GPU machine has ``key`` already (None: the bundle must carry it)."""
    if CUDA.match(key):
        return "torch"
    if key in torch_deps:
        return "torch's dependency"
    if key in EXPECTED:
        return "expected"
    if USER_EXCLUDE and USER_EXCLUDE.match(key):
        return "GPU_BUNDLE_EXCLUDE"
    return None


direct = {norm(Requirement(r).name) for r in metadata.requires("areal-cli") or []}
if LEFT_OUT - direct:
    sys.exit(f"gpu_bundle: LEFT_OUT names {sorted(LEFT_OUT - direct)}, which areal-cli does not depend on: "
             f"update the list in scripts/gpu_bundle.sh (is areal-cli installed from this tree?)")
extras = {e for e in extras_arg.split(",") if e}
queue = [("areal-cli", extras), ("pytest", set()), ("pytest-timeout", set())]
seen: dict[str, str] = {}
outside: dict[str, tuple[str, set[str]]] = {}  # left to the GPU machine: why, who needs it
unpinned: set[str] = set()  # required, but not installed here: the registry's latest goes in
while queue:
    name, want = queue.pop()
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        unpinned.add(norm(name))
        continue
    key = norm(dist.metadata["Name"])
    if key in seen and not want:
        continue
    seen[key] = dist.version
    for r in map(Requirement, dist.requires or []):
        rkey = norm(r.name)
        if not wanted(r, want) or (key == "areal-cli" and rkey in LEFT_OUT):
            continue
        why = brought_by(rkey)
        if why:
            outside.setdefault(rkey, (why, set()))[1].add(key)
            continue
        if rkey in seen and not r.extras:
            continue
        queue.append((r.name, set(r.extras)))

with open(reqs_path, "w") as f:
    for key, version in sorted(seen.items()):
        if key != "areal-cli":
            print(f"{key}=={version}", file=f)
    for key in sorted(unpinned - set(seen)):
        print(key, file=f)
        print(f"gpu_bundle: {key} is not installed here; the bundle takes the registry's latest", file=sys.stderr)
with open(expected_path, "w") as f:
    print("# Not in this bundle: the GPU machine must have these (the version tested here).", file=f)
    for key, (why, users) in sorted(outside.items()):
        try:
            here = f"=={metadata.version(key)}"
        except metadata.PackageNotFoundError:
            here = ""
        print(f"{key}{here}  # {why}; needed by {', '.join(sorted(users))}", file=f)
EOF
if [ -z "$TARGET_PY" ]; then
    # pip wheel takes a registry wheel as it is and builds one from an sdist where none exists
    "$PY" -m pip wheel --quiet --no-deps -w "$OUT/wheels" -r "$tmp/reqs.txt"
else
    # Another Python on the GPU machine: the registry's wheels for it, one package at a time, so that a
    # pure-Python package published only as an sdist can be built here instead (its wheel runs anywhere).
    plats=(); for p in 2_28 2_27 2_24 2_17 2014 2_5 1; do
        case $p in 2014|1) plats+=(--platform "manylinux${p}_x86_64");; *) plats+=(--platform "manylinux_${p}_x86_64");; esac
    done
    while read -r req; do
        "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$TARGET_PY" \
            --implementation cp "${plats[@]}" -d "$OUT/wheels" "$req" 2>/dev/null && continue
        "$PY" -m pip wheel --quiet --no-deps -w "$tmp/built" "$req"
        for w in "$tmp"/built/*.whl; do
            case "$w" in *-py3-none-any.whl|*-py2.py3-none-any.whl) mv "$w" "$OUT/wheels/";;
            *) echo "gpu_bundle: $req has no wheel for Python $TARGET_PY and builds only for this one" >&2; exit 1;;
            esac
        done
    done < "$tmp/reqs.txt"
fi
cp "$tmp/reqs.txt" "$OUT/requirements.txt"

# 3. report
n=$(ls "$OUT/wheels" | wc -l)
plat=$("$PY" -c 'import sys, sysconfig; print(sysconfig.get_platform(), "cp%d%d" % sys.version_info[:2])')
[ -n "$TARGET_PY" ] && plat="manylinux x86_64 cp${TARGET_PY/./} (GPU_BUNDLE_PYTHON)"
if [ -n "$FULL" ] && [ "$FULL" != 0 ]; then kind="full (every dependency; expected ones included)"
else kind="default (what the check imports)${INCLUDE:+, also bundled: $INCLUDE}"; fi
echo "gpu_bundle: $plat, $kind, extras: ${EXTRAS:-none}, GPU_BUNDLE_EXCLUDE: ${GPU_BUNDLE_EXCLUDE:-none}"
echo "gpu_bundle: left to the GPU machine besides torch and its dependencies (expected.txt):" \
     "$(grep -v '^#' "$OUT/expected.txt" | grep -v "# torch" | cut -d' ' -f1 | paste -sd' ')" \
     "(scripts/gpu_check.sh checks for: $(names "${EXPECTED[@]}" | paste -sd' '))"
echo "gpu_bundle: largest wheels:"
ls -S "$OUT/wheels" | sed -n 1,8p | while read -r w; do
    printf '    %6s  %s\n' "$(du -h "$OUT/wheels/$w" | cut -f1)" "$w"
done
echo "gpu_bundle: $n wheels $(du -sh "$OUT/wheels" | cut -f1)," \
     "source $(du -h "$OUT/areal-cli-src.tar.gz" | cut -f1)," \
     "total $(du -sh "$OUT" | cut -f1) in $OUT"
