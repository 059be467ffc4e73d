"""Prompt lengths for ``areal plan`` from the run's own dataset, rendered and tokenized as the trainer does.

Without them the planner takes half of ``dataset.max_prompt_len`` as the mean and the cap as the longest,
which can be far off: a cap is set for the longest prompt a user tolerates, not the usual one. When the
training split and the model's tokenizer are on this machine, a sample of rows goes through
:func:`areal_cli.data.datasets.build_items` (the chat template, the system prompt, the length filter) and
the planner uses its mean and maximum. Nothing is downloaded and nothing is written: a built-in model that
has not been built yet gets its tokenizer trained in a temporary directory (a second or two), a hub model is
read from the local Hugging Face cache only.
"""

from __future__ import annotations

import logging
import os
import random
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from areal_cli.config.schema import ExperimentConfig

log = logging.getLogger(__name__)

SAMPLE_ROWS = 512


@dataclass(frozen=True)
class PromptLengths:
    mean: float
    max: int
    rows: int  # rows sampled
    source: str  # where they came from, for the plan's header

    def describe(self) -> str:
        return f"{self.source}: {self.rows} prompts, mean {self.mean:.1f} and max {self.max} tokens"


def _load(path: str, **kw):
    """A fast tokenizer straight from its ``tokenizer.json``. Not ``AutoTokenizer``: it imports torch (~5 s
    more on two cores, and ``areal plan`` stays torch-free); a model with a slow tokenizer only is planned
    at the caps."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(path, **kw)


def _tokenizer(cfg: ExperimentConfig):
    """The run's tokenizer if it can be had without a download or a side effect (else an exception)."""
    path = cfg.model.path
    if isinstance(path, str) and path.startswith("builtin:"):
        from areal_cli.data import builtin
        from areal_cli.data.builtin_model import READY_MARKER, builtin_model_dir, overrides_from_model_config
        from areal_cli.data.builtin_model import resolve_spec

        spec = resolve_spec(path.split(":", 1)[1] or "tiny", overrides_from_model_config(cfg.model))
        built = builtin_model_dir(os.path.expanduser(cfg.cluster.fileroot), spec)
        if (built / READY_MARKER).exists():
            return _load(str(built))
        from areal_cli.models.tiny import train_tokenizer

        with tempfile.TemporaryDirectory(prefix="areal_plan_tok_") as tmp:
            train_tokenizer(tmp, builtin.corpus(spec.task), vocab_size=spec.vocab_size,
                            model_max_length=spec.max_position_embeddings)
            return _load(tmp)
    from areal_cli.models.hub import is_hub_id

    if is_hub_id(path):
        return _load(path, revision=cfg.model.revision, local_files_only=True)
    return _load(os.path.expanduser(path))


def dataset_prompt_lengths(cfg: ExperimentConfig, sample: int = SAMPLE_ROWS,
                           seed: int = 0) -> PromptLengths | None:
    """Mean and longest prompt of up to ``sample`` training rows, or None (with the reason logged at debug
    level) when the data or the tokenizer is not on this machine. Never raises for missing inputs: the
    planner then falls back to the caps and says so."""
    from areal_cli.data import builtin
    from areal_cli.data.datasets import _load_rows, build_items

    d = cfg.dataset
    try:
        tok = _tokenizer(cfg)
        task = builtin.parse_builtin_path(d.train_path)
        if task is not None:
            rows, _ = builtin.generate_splits(task, min(d.train_size, sample), 0, seed=seed)
            field, answer, where = "question", "answer", f"builtin:{task}"
        else:
            rows = _load_rows(d.train_path, "dataset.train_path")
            field, answer, where = d.prompt_field, d.answer_field, str(d.train_path)
    except Exception as e:  # offline hub id, missing file, ...: the caps stand in
        log.debug("no prompt lengths from the dataset: %s", e)
        return None
    if len(rows) > sample:
        rows = random.Random(seed).sample(rows, sample)
    try:
        items, _ = build_items(rows, tok, prompt_field=field, answer_field=answer,
                               use_chat_template=d.use_chat_template, system_prompt=d.system_prompt,
                               max_prompt_len=d.max_prompt_len, source=where)
    except Exception as e:  # a field mapping the trainer would refuse: validation and the run say so
        log.debug("no prompt lengths from the dataset: %s", e)
        return None
    if not items:
        return None
    lens = [len(it["prompt_ids"]) for it in items]
    return PromptLengths(sum(lens) / len(lens), max(lens), len(lens), where)
