"""Shared fixtures. Tiny models are built from configs at test time; nothing comes from a hub."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# shared helpers, gloo workers, plugins and fakes (tests/support) import by name from every test folder
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# What composing a config exports for the run's processes (plugins, --config-dir); an in-process test
# that composes one must not hand it to the tests after it (their subprocesses inherit os.environ).
_RUN_ENV = ("AREAL_PLUGINS", "AREAL_CONFIG_DIR", "PYTHONPATH")


@pytest.fixture(autouse=True)
def _restore_run_env():
    saved = {k: os.environ.get(k) for k in _RUN_ENV}
    path = list(sys.path)
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    sys.path[:] = path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A randomly initialised tiny Qwen2 (≈0.1M params) with a locally trained tokenizer."""
    from areal_cli.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_model"), seed=0)


@pytest.fixture(scope="session")
def tiny_model_dir_b(tmp_path_factory, tiny_model_dir) -> str:
    """Same architecture and tokenizer as ``tiny_model_dir`` but different weights (seed 1)."""
    from areal_cli.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_model_b"), tokenizer_dir=tiny_model_dir, seed=1)


@pytest.fixture(scope="session")
def model4(tmp_path_factory, tiny_model_dir) -> str:
    """A 4-layer tiny Qwen2 with tied embeddings (seed 3): enough layers for p2 with two virtual stages.
    Shared by the engine-vs-reference tests."""
    from areal_cli.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny4"), tokenizer_dir=tiny_model_dir, seed=3, num_layers=4)


@pytest.fixture(scope="session")
def moe_model(tmp_path_factory, tiny_model_dir) -> str:
    """A 2-layer tiny Qwen3-MoE (4 experts, top-2; seed 3) with the shared tokenizer. Shared by the archon
    and megatron expert-parallel tests."""
    from areal_cli.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_moe"), tokenizer_dir=tiny_model_dir, seed=3,
                           family="qwen3_moe", num_layers=2)


@pytest.fixture(scope="session")
def vl_dir(tmp_path_factory) -> str:
    """The built-in tiny Qwen2.5-VL (``builtin:tiny_vl``), built once per session."""
    from areal_cli.data.builtin_model import ensure_builtin_model

    return str(ensure_builtin_model(tmp_path_factory.mktemp("vl_fileroot"), "tiny_vl"))


@pytest.fixture(scope="session")
def vl_tok(vl_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(vl_dir)


@pytest.fixture
def fake_engine():
    """The in-process fake inference engine class (tests/support/rollout_fakes.py): token ``i`` of a prompt is
    a hash of (prompt, i), logprobs likewise, an optional delay per token, aborts and versions like a server.
    Call it to make one: ``fake_engine(token_delay=0)``."""
    from rollout_fakes import FakeEngine

    return FakeEngine


@pytest.fixture
def length_workflow():
    """A rollout workflow class whose reward is the completion length (tests/support/rollout_fakes.py)."""
    from rollout_fakes import LengthWorkflow

    return LengthWorkflow
