#!/usr/bin/env bash
# Installs areal-cli into the current Python 3.11 environment.
# torch comes first and pinned: torch==2.13.0 is the CPU wheel on this machine's disk; any looser
# requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python -m pip"
if ! python -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null; then
  $PIP install -q torch==2.13.0
fi
$PIP install -q -e '.[test]'
