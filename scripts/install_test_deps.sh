#!/usr/bin/env bash
# Test-only system pieces the default and slurm suites use. Idempotent: quick when already present.
# - s3fs + moto: check-storage against a local S3-compatible server (botocore pinned to what awscli
#   on the machine wants; a plain `pip install s3fs` would upgrade it)
# - skypilot in its own venv: installing it globally downgrades click and uvicorn
# - sglang's own request models, routes and weight-update helper for the SGLang contract tests:
#   scripts/setup_sglang_contract.sh (pinned, --no-deps, into .venv-sglang/site; never a torch)
# - megatron-core, pinned, --no-deps: its deps are numpy, packaging and torch, all present; letting pip
#   resolve them could swap the CPU torch for a CUDA one
# - ray[default], pinned (the `ray` extra; [default] brings the dashboard that `ray list actors` asks):
#   it does not depend on torch, and the torch check below proves it left the CPU build alone
# - deepspeed, pinned: an sdist, built against the venv's torch (--no-build-isolation, DS_BUILD_OPS=0: no
#   C++ op is compiled, then or at run time) with --no-deps so pip cannot swap the CPU torch; its small
#   pure-Python deps are named here (numpy, packaging, psutil, pydantic, tqdm are already installed; wheel
#   lets an older setuptools build the sdist)
# - slurm-wlm + munge come from slurm/local-cluster.sh, which the slurm suite runs itself
set -uo pipefail
cd "$(dirname "$0")/.."
if ! python -c "import s3fs, moto" 2>/dev/null; then
  BOTO=$(python -c "import botocore; print(botocore.__version__)" 2>/dev/null || true)
  python -m pip install -q s3fs "moto[server]" ${BOTO:+"botocore==$BOTO"} \
    || echo "install_test_deps: s3fs/moto not installed; S3 tests will skip"
fi
SKY=~/.cache/areal/skypilot-venv
if [ ! -x "$SKY/bin/sky" ]; then
  (python -m venv "$SKY" && "$SKY/bin/pip" install -q skypilot) >/dev/null 2>&1 \
    || echo "install_test_deps: skypilot venv not created; SkyPilot YAML validation tests will skip"
fi
if ! python -c "import importlib.metadata as m, sys; sys.exit(m.version('megatron-core') != '0.16.1')" 2>/dev/null; then
  python -m pip install -q --no-deps "megatron-core==0.16.1" \
    || echo "install_test_deps: megatron-core not installed; megatron tests will skip"
fi
# agent frameworks (the "agents" extra): openai-agents and langchain-openai for tests/integration/rollout/test_openai_agents.py;
# neither depends on torch, and the torch check below catches a swap all the same
if ! python -c "import agents, langchain_openai" 2>/dev/null; then
  python -m pip install -q "openai-agents>=0.24" "langchain-openai>=1.7" \
    || echo "install_test_deps: openai-agents/langchain-openai not installed; their agent tests will skip"
  python -c "import torch, sys; sys.exit(not torch.__version__.endswith('+cpu'))" \
    || echo "install_test_deps: WARNING: torch is no longer the +cpu build after installing the agent frameworks"
fi
if ! python -c "import importlib.metadata as m, sys; sys.exit(m.version('ray') != '2.60.0')" 2>/dev/null; then
  python -m pip install -q "ray[default]==2.60.0" \
    || echo "install_test_deps: ray not installed; the launcher=ray tests will skip"
  python -c "import torch, sys; sys.exit(not torch.__version__.endswith('+cpu'))" 2>/dev/null \
    || echo "install_test_deps: torch is no longer the +cpu build after installing ray"
fi
if ! python -c "import importlib.metadata as m, sys; sys.exit(m.version('deepspeed') != '0.19.8')" 2>/dev/null; then
  python -m pip install -q hjson msgpack py-cpuinfo einops wheel \
    && DS_BUILD_OPS=0 python -m pip install -q --no-deps --no-build-isolation "deepspeed==0.19.8" \
    || echo "install_test_deps: deepspeed not installed; engine=deepspeed tests will skip"
  python -c "import torch, sys; sys.exit(not torch.__version__.endswith('+cpu'))" 2>/dev/null \
    || echo "install_test_deps: torch is no longer the +cpu build after installing deepspeed"
fi
bash scripts/setup_sglang_contract.sh \
  || echo "install_test_deps: sglang contract packages not installed; SGLang contract tests will fail in CI"
exit 0
