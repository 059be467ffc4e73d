"""The image sub-batch of the ``hf`` server's engine (Qwen2-VL-family models).

A prompt with images needs the vision tower in its prefill and mrope's 3-D positions (temporal, height,
width; ``model.get_rope_index``) for every token; the text runners (the fast path, and ``HFRunner`` with
its 1-D positions) assume neither. Requests with images therefore run here, beside the text batch, in
the same engine thread: at each token boundary the engine admits waiting image requests into this
sub-batch (one prefill, the model's own forward with ``pixel_values``) and advances it by one decode
step after the text batch's. Weight swaps, pauses and cancels reach both (one thread, one boundary).

Positions: the prefill's come from ``get_rope_index`` on the left-padded batch; after the prompt every
text position is ``index + rope_delta`` on all three axes (``rope_delta = max prompt position + 1 -
prompt length``), which is what the model computes itself when it generates, so decode passes
``lens + delta`` explicitly (rows of one batch have different deltas).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch

from areal_cli.inference.server.engine import HFRunner, Sequence, retire_rows

log = logging.getLogger("areal_cli.hf_server")


def is_vision_model(model) -> bool:
    return getattr(model.config, "vision_config", None) is not None and hasattr(
        getattr(model, "model", None), "get_rope_index")


def attach(engine) -> bool:
    """Give ``engine`` an image sub-batch when its model takes images (before ``engine.start()``)."""
    if not is_vision_model(engine.model):
        return False
    engine.vision = VisionBatch(engine)
    engine.banned_ids = vision_token_ids(engine.model.config)
    return True


def vision_token_ids(config) -> torch.Tensor:
    """The vision special tokens a vision-language model must never sample (text and image rows alike): a
    generated ``<|image_pad|>`` would be a second image placeholder when the sequence is sent again (a resumed
    request, a later turn), and the trainer would read it as a text token. ``<|vision_pad|>`` has no config
    key; Qwen's vocabularies (and tiny_vl's) put it between ``<|vision_end|>`` and ``<|image_pad|>``."""
    keys = ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")
    ids = {int(getattr(config, k)) for k in keys if getattr(config, k, None) is not None}
    end, pad = getattr(config, "vision_end_token_id", None), getattr(config, "image_token_id", None)
    if end is not None and pad is not None and int(pad) - int(end) == 2:
        ids.add(int(end) + 1)
    return torch.tensor(sorted(ids), dtype=torch.long)


class VisionRunner(HFRunner):
    """``HFRunner`` whose prefill feeds the images and whose positions are mrope's (see module doc)."""

    def __init__(self, model, device: torch.device, pad_id: int):
        super().__init__(model, device, pad_id)
        self.image_token_id = int(model.config.image_token_id)
        self.deltas: list[int] = []
        self.text_hooks = lambda: None  # the text runner's LoRA hooks on the same modules (set by VisionBatch)
        # transformers 5 names the cache argument ``cache`` (``past_key_values`` is deprecated there)
        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def _forward(self, ids, mask, pos, cache, last_only: bool, **extra):
        kwargs = {"input_ids": ids, "attention_mask": mask, "position_ids": pos, self._cache_kw: cache,
                  "use_cache": True, **extra}
        if last_only:
            kwargs["logits_to_keep"] = 1
        hooks = self.text_hooks()
        if hooks is not None:  # the text batch's LoRA hooks hold its rows' adapters; image rows run the base
            hooks.groups = []
        out = self.model(**kwargs)
        return out.logits[:, -1, :].float(), out.past_key_values

    @torch.no_grad()
    def prefill_images(self, seqs: list[list[int]], vis: list[Any]) -> torch.Tensor:
        from transformers import DynamicCache

        n_max = max(len(x) for x in seqs)
        ids = torch.full((len(seqs), n_max), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), n_max), dtype=torch.long)
        for i, x in enumerate(seqs):
            ids[i, n_max - len(x):] = torch.tensor(x, dtype=torch.long)
            mask[i, n_max - len(x):] = 1
        grid = torch.cat([v.image_grid_thw for v in vis]).to(self.device)
        dtype = next(self.model.parameters()).dtype
        pix = torch.cat([v.pixel_values for v in vis]).to(self.device, dtype)
        ids, mask = ids.to(self.device), mask.to(self.device)
        mm = (ids == self.image_token_id).int()
        pos, deltas = self.model.model.get_rope_index(ids, mm, image_grid_thw=grid, attention_mask=mask)
        cache = DynamicCache(config=self.model.config)
        logits, cache = self._forward(ids, mask, pos, cache, last_only=True, pixel_values=pix,
                                       image_grid_thw=grid)
        self._merge(cache, mask)
        self.lens.extend(len(x) for x in seqs)
        self.deltas.extend(int(d) for d in deltas.view(-1).tolist())
        return logits

    def _decode_positions(self) -> torch.Tensor:
        # mrope: a generated token sits at its text position shifted by the row's rope delta, on all 3 axes
        return torch.tensor([n + d for n, d in zip(self.lens, self.deltas)], dtype=torch.long,
                            device=self.device).view(1, -1, 1).expand(3, -1, -1)

    def keep(self, idx: list[int]) -> None:
        super().keep(idx)
        self.deltas = [self.deltas[i] for i in idx]

    def clear(self) -> None:
        super().clear()
        self.deltas = []


class VisionBatch:
    """The running image requests of an engine: admitted, decoded, sampled and retired with the engine's
    own sampling and stop rules, at the engine's token boundaries (engine thread only)."""

    def __init__(self, engine):
        self.engine = engine
        self.runner = VisionRunner(engine.model, engine.device, engine.pad_id)
        self.runner.text_hooks = lambda: getattr(engine.runner, "_hooks", None)
        self.running: list[Sequence] = []

    def admit(self, batch: list[Sequence]) -> None:
        eng = self.engine
        for s in batch:
            s.epoch = eng._epoch
        try:
            logits = self.runner.prefill_images([s.prompt_ids + s.out_ids for s in batch],
                                                [s.images for s in batch])
        except Exception as e:  # fails these requests only, not the text rows running beside them
            log.exception("image prefill failed")
            for s in batch:
                s.finish = {"type": "error", "message": f"image prefill failed: {type(e).__name__}: {e}"}
                eng._finish(s)
            return
        eng.stats["prefill_tokens"] += sum(len(s.prompt_ids) + len(s.out_ids) for s in batch)
        self.running.extend(batch)
        for s in batch:
            s.real_len = len(s.prompt_ids) + len(s.out_ids)
        self._sample(logits, list(range(len(self.running) - len(batch), len(self.running))))

    def step(self) -> None:
        logits = self.runner.decode([s.out_ids[-1] for s in self.running])
        for s in self.running:
            s.real_len += 1
        self._sample(logits, list(range(len(self.running))))

    def _sample(self, logits: torch.Tensor, rows: list[int]) -> None:
        done = self.engine._sample_into(logits, [self.running[i] for i in rows])
        if done:
            self.retire([rows[j] for j in done])

    def retire(self, rows: list[int]) -> None:
        self.running = retire_rows(self.running, rows, self.runner, self.engine._finish)

    def finish_all(self, finish: dict) -> int:
        n = len(self.running)
        for s in self.running:
            s.finish = dict(finish)
        if n:
            self.retire(list(range(n)))
        return n

    def drop_cancelled(self) -> None:
        gone = [i for i, s in enumerate(self.running) if s.cancelled]
        for i in gone:
            self.running[i].finish = {"type": "abort", "message": "client disconnected"}
        if gone:
            self.retire(gone)
