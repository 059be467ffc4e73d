#!/usr/bin/env bash
# SGLang's own code for the contract tests (tests/integration/inference/test_sglang_contract.py), without SGLang's
# runtime: the pinned sglang wheel and the few pure-Python/small packages its request models
# (srt/managers/io_struct.py), HTTP routes (srt/entrypoints/http_server.py), weight updater and
# process-group helper (init_custom_process_group) need at import time, installed with --no-deps into
# a plain directory (.venv-sglang/site) that only the tests' SGLang subprocesses put on sys.path.
#
# Why not the main env: sglang 0.5.23 requires torch==2.14.1, transformers==5.19.0, openai==2.8.0 and
# a CUDA stack (flashinfer, sglang-kernel, triton, ...); installing it normally would replace the CPU
# torch. Nothing here installs torch: the SGLang subprocesses use the main env's torch 2.13.0+cpu.
# triton (1 GB) and torchvision (CUDA-linked on PyPI) are not installed; the tests stub them at import
# time (tests/support/sglang_harness.py), as SGLang's own _platform_stubs does on macOS.
#
# Usage: bash scripts/setup_sglang_contract.sh [DIR]   (default .venv-sglang/site; idempotent)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-.venv-sglang/site}"
SGLANG_VERSION="0.5.23"
# Exact pins: what sglang 0.5.23 pins itself, else the versions this setup was verified with.
PKGS=(
  "sglang==${SGLANG_VERSION}"
  "msgspec==0.22.0" "orjson==3.13.0" "pybase64==1.5.1" "pyzmq==27.3.0"
  "ipython==9.18.1" "traitlets==5.16.1" "apache-tvm-ffi==0.1.11" "sentencepiece==0.2.1"
  "compressed-tensors==0.18.0" "loguru==0.7.3" "gguf==0.19.0" "partial-json-parser==0.2.1.1.post7"
  "setproctitle==1.3.8" "einops==0.8.2" "xgrammar==0.2.8" "soundfile==0.14.0" "python-multipart==0.0.34"
)
STAMP="$DIR/.areal-sglang-${SGLANG_VERSION}"
if [ -f "$STAMP" ]; then
  exit 0
fi
rm -rf "$DIR"
mkdir -p "$DIR"
python -m pip install -q --no-deps --no-compile --target "$DIR" "${PKGS[@]}"
# --no-deps cannot pull torch, but check anyway: a torch in $DIR would shadow the CPU build.
if [ -e "$DIR/torch" ]; then
  echo "setup_sglang_contract: a torch landed in $DIR; refusing" >&2
  exit 1
fi
touch "$STAMP"
echo "setup_sglang_contract: sglang ${SGLANG_VERSION} in $DIR"
