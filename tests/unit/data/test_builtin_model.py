"""The built-in tiny model: built once, cached under the fileroot, safe under concurrent first use."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from areal_cli.data.builtin_model import (
    BUILTIN_SPECS,
    READY_MARKER,
    builtin_model_dir,
    ensure_builtin_model,
    ensure_builtin_model_ex,
    parse_builtin_model_path,
    resolve_spec,
)
from areal_cli.errors import ConfigError

# A smaller-than-default spec keeps the test fast; the build path is the same.
FAST = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
        "intermediate_size": 64, "vocab_size": 300}


def test_concurrent_first_use_builds_once(tmp_path):
    # flock locks belong to open file descriptions, so two threads that each open the lock file
    # exclude each other exactly like two processes do (and threads keep the test cheap).
    with ThreadPoolExecutor(2) as pool:
        futs = [pool.submit(ensure_builtin_model_ex, tmp_path, "tiny", overrides=FAST) for _ in range(2)]
        results = [f.result(timeout=300) for f in futs]
    paths = {r[0] for r in results}
    assert len(paths) == 1 and sorted(r[1] for r in results) == [False, True]
    model_dir = Path(paths.pop())
    assert model_dir.parent == tmp_path / "models" and model_dir.name.startswith("builtin-")
    assert not [p for p in model_dir.parent.iterdir() if ".tmp-" in p.name]
    # Cached: a third call returns at once without building.
    assert ensure_builtin_model_ex(tmp_path, "tiny", overrides=FAST) == (str(model_dir), False)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["hidden_size"] == 32 and cfg["num_hidden_layers"] == 1
    assert model.config.vocab_size == len(tok) <= 300
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|pad|>"
    # Digits are single tokens and the task's words are merged (short prompts, learnable sums).
    ids = tok("Tom has 173 apples", add_special_tokens=False)["input_ids"]
    pieces = [tok.decode([i]) for i in ids]
    assert "".join(pieces) == "Tom has 173 apples"
    start = pieces.index("1")
    assert pieces[start:start + 3] == ["1", "7", "3"]
    assert len(ids) < len("Tom has 173 apples")  # BPE merged some characters
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                     tokenize=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_spec_hash_and_resolution(tmp_path):
    assert parse_builtin_model_path("builtin:tiny") == "tiny"
    assert parse_builtin_model_path("/models/qwen") is None
    a = builtin_model_dir(tmp_path, "tiny")
    assert a == builtin_model_dir(tmp_path, BUILTIN_SPECS["tiny"])
    assert a != builtin_model_dir(tmp_path, resolve_spec("tiny", {"seed": 1}))
    with pytest.raises(ConfigError) as e:
        resolve_spec("huge")
    assert e.value.path == "model.path" and "builtin:tiny" in e.value.hint
    with pytest.raises(ConfigError):
        resolve_spec("tiny", {"hidden_size": 100, "num_heads": 3})


def test_half_built_dir_is_rebuilt(tmp_path):
    spec = resolve_spec("tiny", FAST)
    final = builtin_model_dir(tmp_path, spec)
    final.mkdir(parents=True)
    (final / "garbage").write_text("crash leftovers")  # no READY marker: not trusted
    path = ensure_builtin_model(tmp_path, spec)
    assert (Path(path) / READY_MARKER).exists() and not (Path(path) / "garbage").exists()


def test_overrides_from_model_config_match_default_spec():
    from areal_cli.config.model import ModelConfig
    from areal_cli.data.builtin_model import overrides_from_model_config

    tiny = BUILTIN_SPECS["tiny"]
    cfg = ModelConfig(hidden_size=tiny.hidden_size, num_hidden_layers=tiny.num_layers,
                      num_attention_heads=tiny.num_heads, num_key_value_heads=tiny.num_kv_heads,
                      intermediate_size=tiny.intermediate_size)
    assert resolve_spec("tiny", overrides_from_model_config(cfg)) == tiny
    wider = resolve_spec("tiny", overrides_from_model_config(ModelConfig(hidden_size=256,
                                                                        intermediate_size=1024)))
    assert wider.hidden_size == 256 and wider.digest() != tiny.digest()


@pytest.mark.parametrize("name", sorted(BUILTIN_SPECS))
def test_every_builtin_model_is_an_option_of_the_model_group(name):
    """``model=<name>`` reaches each built-in spec with that spec's facts (validation and the memory
    estimate read the group's facts, so a spec without its preset would be checked as another model)."""
    from areal_cli.plan.compose import load_config

    cfg = load_config([f"model={name}"])
    spec = BUILTIN_SPECS[name]
    m = cfg.model
    assert parse_builtin_model_path(m.path) == name
    facts = (m.hidden_size, m.num_hidden_layers, m.num_attention_heads, m.num_key_value_heads, m.vocab_size,
             m.max_position_embeddings, m.intermediate_size, m.num_experts, m.num_experts_per_tok)
    assert facts == (spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.vocab_size,
                     spec.max_position_embeddings, spec.intermediate_size, spec.num_experts,
                     spec.num_experts_per_tok)
