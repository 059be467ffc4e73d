"""Does the built-in tiny VLM learn a built-in visual task? A plain PyTorch + transformers SFT probe (no areal
engine, no server): build ``builtin:tiny_vl`` (optionally with another spec), train on the task's train split
with the loss on the answer tokens only, and print the held-out accuracy every ``--eval-every`` steps.

    python benchmarks/vl_learnability.py                       # the vision default (count_all), 300 steps
    python benchmarks/vl_learnability.py --task count_shapes --steps 600 --eval-every 50
    python benchmarks/vl_learnability.py --diagnose            # do image features reach the LM?
    python benchmarks/vl_learnability.py --lr 2e-3             # the lr at which the tower's features collapse
    python benchmarks/vl_learnability.py --vision-lr-scale 0   # the tower frozen
    python benchmarks/vl_learnability.py --override vision_hidden_size=96 --override num_layers=3

Held-out accuracy (``--eval-mode forced``, the default) is teacher-forced: an item is right when the argmax at
every token of the answer's number ("There are N ...") is that token. The last checkpoint is also scored by
greedy decoding with ``generate`` and the answer's ``#### n`` (``--eval-mode generate`` scores every
checkpoint so; slower). ``train_acc`` is the forced accuracy on as many train items, to tell learning from
memorising. The majority rate is the most common held-out answer's share. One thread by default
(``torch.set_num_threads``); ``train_cpu_s`` is the process CPU time of the training steps alone (no
evaluation), so it does not grow with the host's load. Nothing is asserted: these are measurements
(docs/vision.md records them).
"""

from __future__ import annotations

import argparse
import io
import json
import random
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

_ANSWER = re.compile(r"####\s*(-?\d+)")


def _parse_override(s: str) -> tuple[str, object]:
    key, _, val = s.partition("=")
    try:
        return key, int(val)
    except ValueError:
        return key, val


def build(overrides: dict, fileroot: str):
    """The built-in model dir (``ensure_builtin_model``: the exact artefact ``model=tiny_vl`` uses; its
    tokenizer covers every built-in visual task's text), its processor and model."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    from areal_cli.data.builtin_model import ensure_builtin_model
    from areal_cli.models.tiny_vl import load_vl_processor

    d = ensure_builtin_model(fileroot, "tiny_vl", overrides=overrides or None)
    return d, load_vl_processor(d), Qwen2_5_VLForConditionalGeneration.from_pretrained(d)


def encode(proc, rows: list[dict]) -> list[dict]:
    """Per row: the full chat's ids, labels on the assistant answer only, and the image's patches (computed
    once: the image processor is the slow part of a batch)."""
    from PIL import Image

    tok = proc.tokenizer
    image_id = tok.convert_tokens_to_ids("<|image_pad|>")
    out = []
    for r in rows:
        img = Image.open(io.BytesIO(r["image"])).convert("RGB")
        prompt = proc.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False)
        full = prompt + r["answer"] + "<|im_end|>\n"
        b = proc(images=[img], text=[full], return_tensors="pt")
        n_prompt = len(proc(images=[img], text=[prompt], return_tensors="pt")["input_ids"][0])
        ids = b["input_ids"][0]
        labels = ids.clone()
        labels[:n_prompt] = -100
        labels[-1] = -100  # the trailing newline after <|im_end|> is not part of the answer
        # the answer's first number: "There are N ..." -> where N is predicted (for --eval-mode forced)
        ans_ids = ids[n_prompt:].tolist()
        first = next(i for i, t in enumerate(ans_ids) if tok.decode([t]).strip().isdigit())
        last = first
        while last + 1 < len(ans_ids) and tok.decode([ans_ids[last + 1]]).strip().isdigit():
            last += 1  # digits are single tokens: "12" is two
        out.append({"ids": ids, "labels": labels, "mm": (ids == image_id).long(), "pix": b["pixel_values"],
                    "thw": b["image_grid_thw"][0], "n_prompt": n_prompt,
                    "digits": range(first + n_prompt, last + n_prompt + 1),
                    "truth": r["ground_truth"]})
    return out


def collate(items: list[dict], pad_id: int) -> dict:
    import torch

    n = max(len(it["ids"]) for it in items)
    ids = torch.full((len(items), n), pad_id, dtype=torch.long)
    labels = torch.full((len(items), n), -100, dtype=torch.long)
    mask = torch.zeros((len(items), n), dtype=torch.long)
    mm = torch.zeros((len(items), n), dtype=torch.long)
    for i, it in enumerate(items):  # right padding: positions of the real tokens do not move
        k = len(it["ids"])
        ids[i, :k], labels[i, :k], mask[i, :k], mm[i, :k] = it["ids"], it["labels"], 1, it["mm"]
    return {"input_ids": ids, "attention_mask": mask, "mm_token_type_ids": mm, "labels": labels,
            "pixel_values": torch.cat([it["pix"] for it in items]),
            "image_grid_thw": torch.stack([it["thw"] for it in items])}


def eval_forced(model, items: list[dict], pad_id: int, bs: int = 64) -> float:
    """Teacher-forced: right when the argmax at every token of the answer's number is that token."""
    import torch

    model.eval()
    right = 0
    with torch.no_grad():
        for s in range(0, len(items), bs):
            chunk = items[s:s + bs]
            b = collate(chunk, pad_id)
            b.pop("labels")
            logits = model(**b).logits
            for i, it in enumerate(chunk):
                pos = torch.tensor(list(it["digits"]))
                right += bool((logits[i, pos - 1].argmax(-1) == it["ids"][pos]).all())
    model.train()
    return right / len(items)


def eval_generate(model, tok, items: list[dict], max_new_tokens: int = 16) -> float:
    """Greedy decoding, one prompt at a time (no padding to get wrong), scored on ``#### n``."""
    import torch

    model.eval()
    right = 0
    with torch.no_grad():
        for it in items:
            n = it["n_prompt"]
            out = model.generate(input_ids=it["ids"][None, :n], attention_mask=torch.ones_like(it["ids"][None, :n]),
                                 mm_token_type_ids=it["mm"][None, :n], pixel_values=it["pix"],
                                 image_grid_thw=it["thw"][None], max_new_tokens=max_new_tokens,
                                 do_sample=False)
            m = _ANSWER.search(tok.decode(out[0, n:], skip_special_tokens=True))
            right += bool(m) and m.group(1) == it["truth"]
    model.train()
    return right / len(items)


def diagnose(model, items: list[dict], pad_id: int) -> dict:
    """Do image features reach the language model? The gradient of the answer loss into ``visual.*``, and how
    much swapping the image (same text) moves the logits at the answer's number."""
    import torch

    b = collate(items[:8], pad_id)
    model.zero_grad()
    model(**b).loss.backward()
    gnorm = {"visual": 0.0, "language": 0.0}
    for name, p in model.named_parameters():
        if p.grad is not None:
            gnorm["visual" if ".visual." in f".{name}" else "language"] += p.grad.float().norm().item() ** 2
    model.zero_grad()
    with torch.no_grad():
        a = collate([items[0]], pad_id)
        swapped = dict(a, pixel_values=items[1]["pix"], image_grid_thw=items[1]["thw"][None])
        pos = items[0]["digits"][0] - 1
        la = model(**{k: v for k, v in a.items() if k != "labels"}).logits[0, pos]
        lb = model(**{k: v for k, v in swapped.items() if k != "labels"}).logits[0, pos]
    return {"grad_norm_visual": gnorm["visual"] ** 0.5, "grad_norm_language": gnorm["language"] ** 0.5,
            "answer_logit_change_on_image_swap": (la - lb).abs().max().item(),
            "answer_logit_scale": la.abs().max().item()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default=None, help="a built-in visual task (default: the vision default's)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=int, default=20, help="linear lr warmup steps (then constant)")
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--eval-mode", choices=["generate", "forced"], default="forced")
    ap.add_argument("--train-size", type=int, default=4000)
    ap.add_argument("--test-size", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0, help="data split and batch order")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--override", action="append", default=[], metavar="FIELD=VALUE",
                    help="a BuiltinModelSpec field of the built model (repeatable): vision_hidden_size=96")
    ap.add_argument("--vision-lr-scale", type=float, default=1.0,
                    help="the tower's lr as a multiple of --lr (0 freezes it)")
    ap.add_argument("--fileroot", default=None, help="where the built model is cached (default: a temp dir)")
    ap.add_argument("--diagnose", action="store_true", help="only print the image-to-logits checks")
    ap.add_argument("--json", default=None, help="write the curve and settings here")
    args = ap.parse_args(argv)

    import torch

    from areal_cli.data import builtin_vision as bv

    torch.set_num_threads(args.threads)
    task = args.task or bv.DEFAULT_TASK
    overrides = dict(_parse_override(s) for s in args.override)
    fileroot = args.fileroot or tempfile.mkdtemp(prefix="areal_vl_probe_")
    model_dir, proc, model = build(overrides, fileroot)
    tok = proc.tokenizer
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    n_params = sum(p.numel() for p in model.parameters())
    n_visual = sum(p.numel() for p in model.model.visual.parameters())
    train_rows, test_rows = bv.generate_splits(task, args.train_size, args.test_size, seed=args.seed)
    train, test = encode(proc, train_rows), encode(proc, test_rows)
    counts = Counter(r["ground_truth"] for r in test_rows)
    majority = counts.most_common(1)[0][1] / len(test_rows)
    print(f"task={task} params={n_params:,} (tower {n_visual:,}) train={len(train)} test={len(test)} "
          f"majority={majority:.3f} answers={dict(sorted(counts.items()))} model={model_dir}", flush=True)

    if args.diagnose:
        print(json.dumps(diagnose(model, train, pad_id), indent=1))
        return 0

    def evaluate() -> float:
        if args.eval_mode == "forced":
            return eval_forced(model, test, pad_id)
        return eval_generate(model, tok, test)

    visual = [p for n, p in model.named_parameters() if ".visual." in f".{n}"]
    ids_visual = {id(p) for p in visual}
    groups = [{"params": [p for p in model.parameters() if id(p) not in ids_visual], "lr": args.lr}]
    if args.vision_lr_scale > 0:
        groups.append({"params": visual, "lr": args.lr * args.vision_lr_scale})
    else:
        for p in visual:
            p.requires_grad_(False)
    opt = torch.optim.AdamW(groups, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, args.warmup)))
    rng = random.Random(args.seed)
    order: list[int] = []
    curve = [{"step": 0, "train_s": 0.0, "acc": evaluate()}]
    print(f"step 0 acc {curve[0]['acc']:.3f}", flush=True)
    train_s = 0.0
    model.train()
    for step in range(1, args.steps + 1):
        if len(order) < args.batch:
            order += rng.sample(range(len(train)), len(train))
        idx, order = order[:args.batch], order[args.batch:]
        t0 = time.process_time()
        loss = model(**collate([train[i] for i in idx], pad_id)).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        train_s += time.process_time() - t0
        if step % args.eval_every == 0 or step == args.steps:
            acc = evaluate()
            seen = eval_forced(model, train[:len(test)], pad_id)  # memorising shows as seen >> acc
            curve.append({"step": step, "train_s": round(train_s, 1), "loss": round(loss.item(), 4),
                          "acc": acc, "train_acc": seen})
            print(f"step {step} train_cpu_s {train_s:.0f} loss {loss.item():.3f} acc {acc:.3f} "
                  f"train_acc {seen:.3f}", flush=True)
    if args.eval_mode == "forced":  # the forced figure must be what decoding gets
        curve[-1]["acc_generate"] = eval_generate(model, tok, test)
        print(f"step {curve[-1]['step']} acc (greedy generate, #### n) {curve[-1]['acc_generate']:.3f}",
              flush=True)
    print("after training:", json.dumps(diagnose(model, test, pad_id)), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"task": task, "overrides": overrides, "params": n_params,
                                               "majority": majority, "args": vars(args), "curve": curve},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
