#!/usr/bin/env bash
# Installs areal-cli (editable, with the test extra) into the current Python (3.11-3.13), torch first.
#
#   bash scripts/install.sh                              CPU torch 2.13.0+cpu, then areal-cli
#   bash scripts/install.sh megatron,deepspeed           ... plus those extras (or AREAL_EXTRAS=megatron,deepspeed)
#   AREAL_TORCH=cuda bash scripts/install.sh megatron,sglang      a GPU node (docs/install.md)
#
# AREAL_TORCH=cpu (default): torch is exactly the CPU build 2.13.0+cpu. A plain `pip install torch==2.13.0`
#   from PyPI is the multi-GB CUDA build (it got into a fresh venv whose HOME had no pip.conf), so the wheel
#   comes from a local wheel dir when one holds it for this Python (PIP_FIND_LINKS, or /opt/wheels on this
#   project's machines; /opt/wheels has the cp311 wheel only), else from PyTorch's CPU index
#   (AREAL_TORCH_INDEX, default https://download.pytorch.org/whl/cpu). An unreachable index fails in one line
#   rather than after pip's retries.
# AREAL_TORCH=cuda: a CUDA torch already in the env (a CUDA image's) is kept when it is in areal-cli's range;
#   without one, pip picks the CUDA torch together with the extras (sglang pins its own torch), from PyPI or
#   from AREAL_TORCH_INDEX (e.g. https://download.pytorch.org/whl/cu128) when set.
# Either way the torch chosen first is never swapped by what comes after: the package and its extras install
# under a constraint that pins it, and an extra that needs another torch fails with its name.
# Extras that do not go into this env: vllm (its own venv: scripts/setup_vllm_env.sh on CPU; `pip install
# vllm` in a venv of its own on GPU nodes, then AREAL_VLLM_PYTHON) and skypilot (installed into
# ~/.cache/areal/skypilot-venv, where launcher=skypilot looks: in the main env it downgrades click and uvicorn).
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python -m pip"
TORCH=2.13.0
KIND="${AREAL_TORCH:-cpu}"
EXTRAS="${1:-${AREAL_EXTRAS:-}}"
die() { echo "install.sh: $*" >&2; exit 1; }

python - <<'PY' || die "areal-cli needs Python 3.11, 3.12 or 3.13; this is $(python -V 2>&1) ($(command -v python))"
import sys
sys.exit(0 if (3, 11) <= sys.version_info[:2] < (3, 14) else 1)
PY
case "$KIND" in cpu|cuda) ;; *) die "AREAL_TORCH must be cpu or cuda, not '$KIND'" ;; esac

# torch state: "ok" when it is what this run wants, else why not (missing, a CUDA build, a version out of range)
torch_state() {
  python - "$TORCH" "$KIND" <<'PY' 2>/dev/null || echo "not importable"
import sys
want, kind = sys.argv[1], sys.argv[2]
try:
    import torch
except ImportError:
    print("missing"); sys.exit(0)
v = torch.__version__
major, minor = (int(x) for x in v.split("+")[0].split(".")[:2])
if kind == "cpu":
    ok = v.split("+")[0] == want and torch.version.cuda is None
else:
    ok = torch.version.cuda is not None and (2, 6) <= (major, minor) < (2, 15)
print("ok" if ok else f"torch {v} ({'CUDA ' + torch.version.cuda if torch.version.cuda else 'CPU'} build)")
PY
}

# the local CPU wheel for this Python and machine, if a wheel dir holds one
local_cpu_wheel_dir() {
  local tag arch d
  tag=$(python -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  arch=$(uname -m)
  for d in ${PIP_FIND_LINKS:-} /opt/wheels; do
    if compgen -G "$d/torch-$TORCH+cpu-$tag-$tag-*_$arch.whl" >/dev/null; then echo "$d"; return 0; fi
  done
  return 1
}

reachable() {
  python - "$1" <<'PY' >/dev/null 2>&1
import sys, urllib.request
urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=15)
PY
}

# the wheel pip itself would take for torch==$TORCH (the machine's pip config may point at local wheel dirs or
# indexes other than /opt/wheels), when that is a file on this disk: a machine's own provided wheel is its CPU
# build, and taking it downloads nothing; anything remote (PyPI's CUDA build) is refused here
pip_local_wheel() {
  local report
  report=$(mktemp)
  $PIP install -q --dry-run --no-deps --ignore-installed --report "$report" "torch==$TORCH" >/dev/null 2>&1 || { rm -f "$report"; return 1; }
  python - "$report" <<'PY'
import json, sys, urllib.parse
items = json.load(open(sys.argv[1])).get("install", [])
url = items[0]["download_info"]["url"] if items else ""
if not url.startswith("file://"):
    sys.exit(1)
print(urllib.parse.unquote(url[len("file://"):]))
PY
  local rc=$?
  rm -f "$report"
  return $rc
}

install_cpu_torch() {
  local dir index wheel
  if dir=$(local_cpu_wheel_dir); then
    $PIP install -q --find-links "$dir" "torch==$TORCH+cpu"
    return
  fi
  if wheel=$(pip_local_wheel); then
    $PIP install -q "$wheel"
    return
  fi
  index="${AREAL_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
  reachable "$index" || die "no local torch-$TORCH+cpu wheel for $(python -V 2>&1) in ${PIP_FIND_LINKS:-/opt/wheels}, and PyTorch's CPU index $index is unreachable: put that wheel in a dir and set PIP_FIND_LINKS=<dir>, or set AREAL_TORCH_INDEX to a mirror of the CPU index"
  $PIP install -q --index-url "$index" "torch==$TORCH+cpu"
}

state=$(torch_state)
if [ "$state" != ok ]; then
  if [ "$KIND" = cpu ]; then
    install_cpu_torch
  else
    # a CPU torch would satisfy areal-cli's range and stay: remove it so that pip picks a CUDA one, together
    # with the extras (one download even when an extra pins its own torch)
    echo "install.sh: no CUDA torch in areal-cli's range here ($state); pip picks one with areal-cli and its extras" >&2
    if [ "$state" != missing ]; then $PIP uninstall -q -y torch; fi
  fi
fi

# the extras that go into this env, checked against pyproject.toml's list
PIP_EXTRAS=test
SKY=0
for e in ${EXTRAS//,/ }; do
  python - "$e" <<'PY' || die "unknown extra '$e'; known: $(python -c 'import tomllib; print(", ".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]))')"
import sys, tomllib
sys.exit(0 if sys.argv[1] in tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"] else 1)
PY
  case "$e" in
    vllm) echo "install.sh: vllm goes into its own venv: bash scripts/setup_vllm_env.sh (CPU), or pip install vllm in a venv of its own on GPU nodes and set AREAL_VLLM_PYTHON to its python" >&2 ;;
    skypilot) SKY=1 ;;
    *) PIP_EXTRAS="$PIP_EXTRAS,$e" ;;
  esac
done

pin=$(mktemp)
trap 'rm -f "$pin"' EXIT
python -c 'import torch; print("torch==" + torch.__version__)' >"$pin" 2>/dev/null || : >"$pin"
index=()
if [ -n "${AREAL_TORCH_INDEX:-}" ] && [ "$KIND" = cuda ]; then
  index=(--extra-index-url "$AREAL_TORCH_INDEX")  # its +cuXYZ builds outrank PyPI's same version
fi
# DS_BUILD_OPS=0: deepspeed (an sdist) builds no C++ op at install time; it needs none on CPU and JIT-builds on GPUs
DS_BUILD_OPS=0 $PIP install -q -c "$pin" ${index[@]+"${index[@]}"} -e ".[$PIP_EXTRAS]" \
  || die "installing areal-cli[$PIP_EXTRAS] failed (above); if pip reports a torch conflict, an extra needs another torch than $(cat "$pin" || true) (sglang 0.5.23 pins torch==2.14.1: GPU nodes only)"
state=$(torch_state)
[ "$state" = ok ] || die "torch is not the $KIND build this script wants after installing areal-cli ($state); refusing to go on"

if [ "$SKY" = 1 ]; then
  venv=~/.cache/areal/skypilot-venv
  [ -x "$venv/bin/sky" ] || { python -m venv "$venv" && "$venv/bin/pip" install -q skypilot; } \
    || die "skypilot could not be installed into $venv"
fi
