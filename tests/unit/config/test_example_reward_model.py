"""examples/reward_model at the shape it is sized for: both experiments compose and validate offline on one
8-GPU node with a real model's values, step 2 places the reward model beside the actor and counts it, and
the pairs script writes rows algo=rm reads."""

from __future__ import annotations

import json
import runpy

import pytest
from support_paths import REPO

from areal_cli.cli.common import compose_and_validate
from areal_cli.errors import ConfigError

ANYWHERE = ("is not visible on this machine", "the nodes that run this plan need it")


def _real_shape(cfg, plan, spec: str, algo: str) -> None:
    assert cfg.model.path == "Qwen/Qwen2.5-1.5B-Instruct" and cfg.cluster.device == "cuda"
    assert cfg.cluster.n_nodes == 1 and cfg.cluster.n_gpus_per_node == 8 and plan.spec == spec
    assert cfg.algo.name == algo and cfg.engine.dtype == "bfloat16" and cfg.algo.optim.lr <= 1e-5
    assert not [w for w in plan.warnings if not any(a in w for a in ANYWHERE)], plan.warnings
    for t in plan.trains:
        assert t.memory.total_gb < t.memory.device_gb


def test_step_1_trains_a_reward_model_on_the_node():
    cfg, plan = compose_and_validate(["experiment=reward_model_train"])
    _real_shape(cfg, plan, "fsdp:d8", "rm")
    assert not plan.inferences and cfg.trainer.sft_warmup_steps == 0
    assert cfg.dataset.train_path == "data/gsm8k_prefs/train.jsonl"


def test_step_2_scores_with_step_1s_export(tmp_path):
    # before step 1 ran: one line saying to train it first
    with pytest.raises(ConfigError, match="workflow.reward_model.path.*does not exist.*train the reward model"):
        compose_and_validate(["experiment=reward_model_rl"])
    cfg, _ = compose_and_validate(["experiment=reward_model_train"])
    export = tmp_path / "final"  # what step 1 writes, as far as validation reads it: the config and the head
    export.mkdir()
    facts = {"architectures": ["Qwen2ForSequenceClassification"], "model_type": "qwen2", "hidden_size": 1536,
             "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
             "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True}
    (export / "config.json").write_text(json.dumps(facts))
    (export / "value_head.safetensors").write_bytes(b"")
    cfg, plan = compose_and_validate(["experiment=reward_model_rl", f"workflow.reward_model.path={export}"])
    _real_shape(cfg, plan, "sglang:d4+fsdp:d4", "grpo")
    r = cfg.workflow.reward_model
    assert r.combine == "rm_only" and r.normalize == "none" and cfg.workflow.reward == "numeric"
    note = [n for n in plan.notes if n.startswith("workflow.reward_model")]
    assert len(note) == 1 and f"+{plan.train.memory.weights_gb:.2f} GB" in note[0]
    with pytest.raises(ConfigError, match="colocated with the actor"):
        compose_and_validate(["experiment=reward_model_rl", f"workflow.reward_model.path={export}",
                              "allocation_mode.spec=sglang:d4+fsdp[actor]:d3+fsdp[rm]:d1"])


def test_pairs_script_writes_pairs_algo_rm_reads(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    from areal_cli.data.preferences import build_pairs

    src = tmp_path / "gsm8k"
    src.mkdir()
    row = {"question": "Natalia sold 48 clips in April and half as many in May. How many altogether?",
           "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nAltogether 48+24 = <<48+24=72>>72.\n#### 72"}
    for split in ("train", "test"):
        (src / f"{split}.jsonl").write_text(json.dumps(row) + "\n")
    script = REPO / "examples" / "reward_model" / "scripts" / "make_pairs.py"
    main = runpy.run_path(str(script))["main"]
    main(str(src), str(tmp_path / "prefs"))
    rows = [json.loads(x) for x in (tmp_path / "prefs" / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["chosen"] == row["answer"] and rows[0]["prompt"] == row["question"]
    wrong = int(rows[0]["rejected"].rsplit("####", 1)[1])
    assert wrong != 72 and 0 <= wrong and abs(wrong - 72) <= 20
    assert rows[0]["rejected"].startswith("Natalia sold 48/2 = <<48/2=24>>24 clips in May.")
    assert f">>{wrong}." in rows[0]["rejected"]  # the last step's result moved with the answer
    pairs, report = build_pairs(rows, AutoTokenizer.from_pretrained(tiny_model_dir), source="prefs/train.jsonl")
    assert report.kept == 1 and pairs[0]["chosen_ids"] != pairs[0]["rejected_ids"]

