"""Worker process for the vision-language engine tests (one process per rank, gloo on CPU).

Run through :func:`fsdp_worker.launch` with ``script=`` this file and a JSON spec whose ``variants`` each name
an engine layout over the tiny Qwen2.5-VL (``model_dir``). Every variant builds the engine (fp32, seed 0),
runs a forward on :func:`image_batch` (before training), trains ``steps`` steps on image batches (image and
text rows mixed, each row's images in ``multi_modal``), and rank 0 saves stats, full weights (hub names) and
logprobs to ``<out>/<name>.pt``; ``export`` writes the HF dir after the steps and ``probe`` the logprobs then.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def image_batch(model_dir: str, seed: int = 0, n_img: int = 4, n_text: int = 3) -> dict:
    """Rows of the built-in count_shapes task (the question, then its answer) with their images, one
    of them 48x64 px (a 6x8 patch grid: not square), and plain text rows, in a seeded order."""
    import torch
    from PIL import Image

    from areal_cli.data import builtin_vision as bv
    from areal_cli.models.tiny_vl import load_vl_processor

    proc = load_vl_processor(model_dir)
    rows = bv.generate_splits("count_shapes", n_img, 1, seed=seed)[0]
    seqs, mm = [], []
    for i, row in enumerate(rows):
        img = Image.open(io.BytesIO(row["image"])).convert("RGB")
        if i == 1:
            img = img.resize((48, 64))
        prompt = proc.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=False)
        out = proc(images=[img], text=[prompt + row["answer"]], return_tensors="pt")
        seqs.append(out["input_ids"][0])
        mm.append({"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]})
    for j in range(n_text):
        seqs.append(torch.tensor(proc.tokenizer(f"{seed + j} + {j + 3} = {seed + 2 * j + 3}")["input_ids"]))
        mm.append(None)
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(seqs), generator=g).tolist()
    seqs, mm = [seqs[i] for i in order], [mm[i] for i in order]
    B, L = len(seqs), max(len(s) for s in seqs)
    ids = torch.zeros(B, L, dtype=torch.long)
    am = torch.zeros(B, L, dtype=torch.bool)
    for r, s in enumerate(seqs):
        ids[r, :len(s)] = s
        am[r, :len(s)] = True
    lm = am.float()
    lm[:, :4] = 0
    return {"input_ids": ids, "attention_mask": am, "loss_mask": lm, "advantages": torch.randn(B, L, generator=g),
            "multi_modal": mm}


def hf_logprobs(model, batch: dict):
    """Per-row logprobs of a plain HF forward (one row at a time, the model's own positions), in the
    engine's position convention."""
    import torch

    from areal_cli.engines.vision import token_types

    out = torch.zeros(batch["input_ids"].shape)
    for r in range(out.shape[0]):
        n = int(batch["attention_mask"][r].sum())
        ids = batch["input_ids"][r:r + 1, :n]
        kw = batch["multi_modal"][r] or {}
        with torch.no_grad():
            logits = model(input_ids=ids, mm_token_type_ids=token_types(ids, model.config), **kw).logits[0].float()
        out[r, 1:n] = torch.log_softmax(logits, -1)[:-1].gather(-1, ids[0, 1:, None])[:, 0]
    return out


def tower_weights(weights: dict) -> dict:
    return {k: v for k, v in weights.items() if k.startswith("visual.")}


def run_variant(v: dict, model_dir: str, out_dir: str) -> None:
    from areal_cli.api.io_struct import ParallelStrategy
    from areal_cli.config.algo import OptimConfig
    from areal_cli.engines import get_engine_cls
    from fsdp_worker import engine_config, finish_variant, full_weights, local_batch, loss_fn, loss_weight_fn

    ocfg = OptimConfig(**{"lr": 1e-3, "grad_clip": 1e9, **v.get("optim", {})})
    kw = {}
    if v.get("lora"):
        from areal_cli.config.model import LoRAConfig

        kw["lora"] = LoRAConfig(rank=int(v["lora"]))
    engine = get_engine_cls(v.get("cls", "fsdp"))(engine_config(v.get("engine", {})), ocfg, total_steps=4, seed=0,
                                                  **kw)
    engine.initialize(ParallelStrategy(**v.get("parallel", {})), model_dir,
                      freeze_vision_tower=bool(v.get("freeze", False)))
    head = engine.is_dp_head
    res: dict = {"logprobs": engine.forward(image_batch(model_dir, 0) if head else None), "stats": []}
    res["weights_before"] = full_weights(engine) if v.get("freeze") or v.get("lora") else None
    res["n_trainable"] = sum(p.numel() for p in engine.model.parameters() if p.requires_grad)
    res["n_optimized"] = sum(p.numel() for g in engine.optimizer.param_groups for p in g["params"])
    for step in range(v.get("steps", 2)):
        res["stats"].append(engine.train_batch(local_batch(engine, image_batch(model_dir, 1 + step)),
                                               loss_fn, loss_weight_fn))
    res["weights"] = full_weights(engine)
    if v.get("lora"):
        res["adapter"] = engine.adapter_tensors()
    if v.get("probe"):
        res["probe"] = engine.forward(image_batch(model_dir, 7) if head else None)["logprobs"]
    finish_variant(engine, v, res, out_dir)


if __name__ == "__main__":
    from fsdp_worker import variants_main

    from areal_cli.utils.dist import exit_after

    exit_after(lambda: variants_main(run_variant))
