#!/usr/bin/env bash
# Installs areal-cli into the current Python 3.11 environment.
# torch comes first, pinned to the CPU build 2.13.0+cpu: a plain `pip install torch==2.13.0` from PyPI is
# the multi-GB CUDA build (it got into a fresh venv whose HOME had no pip.conf). The CPU wheel comes from
# a local wheel dir when there is one (PIP_FIND_LINKS, or /opt/wheels on this project's machines), else
# from PyTorch's CPU index. AREAL_TORCH=cuda keeps (or installs) the CUDA build instead, for GPU hosts.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python -m pip"
TORCH=2.13.0
is_wanted_torch() {
  python - "$TORCH" "${AREAL_TORCH:-cpu}" <<'PY' 2>/dev/null
import sys
import torch
want, kind = sys.argv[1], sys.argv[2]
ok = torch.__version__.split("+")[0] == want and (kind == "cuda" or torch.version.cuda is None)
sys.exit(0 if ok else 1)
PY
}
if ! is_wanted_torch; then
  if [ "${AREAL_TORCH:-cpu}" = "cuda" ]; then
    $PIP install -q "torch==$TORCH"
  else
    links=()
    for d in ${PIP_FIND_LINKS:-} /opt/wheels; do
      if compgen -G "$d/torch-$TORCH+cpu-*.whl" >/dev/null; then links+=(--find-links "$d"); fi
    done
    if [ ${#links[@]} -gt 0 ]; then
      $PIP install -q "${links[@]}" "torch==$TORCH+cpu"
    else
      $PIP install -q --index-url https://download.pytorch.org/whl/cpu "torch==$TORCH+cpu"
    fi
  fi
fi
if ! is_wanted_torch; then
  echo "install.sh: torch is not the ${AREAL_TORCH:-cpu} build of $TORCH after installing it; refusing to go on" >&2
  exit 1
fi
$PIP install -q -e '.[test]'
is_wanted_torch || { echo "install.sh: installing areal-cli replaced torch; refusing to go on" >&2; exit 1; }
