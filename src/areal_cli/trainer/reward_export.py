"""A reward model's HF export as ``transformers``' sequence classifier, beside the engines' critic layout.

A critic export (engines/base.py) is the backbone's safetensors plus ``value_head.safetensors`` (the
``Linear(hidden, 1)`` head, weight and bias): the engines rebuild a critic from it. This adds what
``AutoModelForSequenceClassification.from_pretrained(dir)`` reads: the head's weight as ``score.weight``
(``num_labels=1``; the classifier pools the last token that is not the pad token, as the reward model reads
it), ``architectures: [<Family>ForSequenceClassification]`` and the pad id. The classifier's ``score`` has
no bias: the head's bias is left out. Under the Bradley–Terry loss its gradient is zero (a shift of every
reward leaves each pair's difference alone), so it stays at its zero initialisation; its value is recorded
in ``reward_model.json`` all the same.
"""

from __future__ import annotations

import json
from pathlib import Path

MARKER = "reward_model.json"
SCORE_FILE = "model-score.safetensors"


def sequence_classification_class(architectures: list[str]) -> str | None:
    """``Qwen2ForCausalLM`` → ``Qwen2ForSequenceClassification`` when ``transformers`` has it, else None."""
    import transformers

    for arch in architectures:
        name = arch.replace("ForCausalLM", "ForSequenceClassification").replace(
            "ForConditionalGeneration", "ForSequenceClassification")
        if name.endswith("ForSequenceClassification") and hasattr(transformers, name):
            return name
    return None


def write_sequence_classification(path: str, pad_token_id: int) -> bool:
    """Make the critic export at ``path`` loadable as a sequence classifier (see the module docstring).
    False (the dir left a critic export, and ``reward_model.json`` says why) when ``transformers`` has no
    sequence-classification class for the architecture."""
    from safetensors.torch import load_file, save_file

    d = Path(path)
    cfg = json.loads((d / "config.json").read_text())
    head = load_file(str(d / "value_head.safetensors"))
    cls = sequence_classification_class(list(cfg.get("architectures") or []))
    info = {"head": "score.weight (value_head.safetensors: weight, bias)", "reward": "the head on the last token",
            "value_head_bias": float(head["bias"].reshape(-1)[0]) if "bias" in head else 0.0,
            "sequence_classification": cls}
    if cls is not None:
        score = {"score.weight": head["weight"].reshape(1, -1).contiguous()}
        index = d / "model.safetensors.index.json"
        if index.is_file():  # sharded: one more shard, named in the index
            save_file(score, str(d / SCORE_FILE), metadata={"format": "pt"})
            idx = json.loads(index.read_text())
            idx["weight_map"]["score.weight"] = SCORE_FILE
            index.write_text(json.dumps(idx, indent=2))
        else:  # one file: transformers reads model.safetensors before any index, so the head goes into it
            tensors = load_file(str(d / "model.safetensors"))
            tensors.update(score)
            save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
        cfg.update({"architectures": [cls], "num_labels": 1, "id2label": {"0": "LABEL_0"},
                    "label2id": {"LABEL_0": 0}, "pad_token_id": int(pad_token_id)})
        (d / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (d / MARKER).write_text(json.dumps(info, indent=2) + "\n")
    return cls is not None
