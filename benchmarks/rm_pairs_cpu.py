"""The preference pairs behind docs/rewards.md's CPU result "RL against the reward model alone" (RM-B, RM-D).

Both read an RL run of the CPU default (its ``config.yaml`` and its SFT warm start ``sft_warmup/hf``), so the
pairs come from the same built-in task, split and prompt rendering as the RL runs that use them:

    # on-policy pairs (RM-B): 8 samples at temperature 1 per train prompt from the warm start, a right one
    # (the number after ####) against up to 2 wrong ones of the same prompt; 1 in 20 pairs held out
    python benchmarks/rm_pairs_cpu.py onpolicy RUN_DIR onpolicy/ --prompts 20000
    # RM-D's training pairs: every train problem's solution against its result moved by 1-3 (near misses),
    # plus the on-policy pairs, shuffled
    python benchmarks/rm_pairs_cpu.py nearmiss RUN_DIR onpolicy/ mixed_train.jsonl

RM-D trains on ``mixed_train.jsonl`` and is evaluated on ``onpolicy/test.jsonl`` (docs/rewards.md has the
``areal train algo=rm`` command). No held-out question of the task occurs in either file (checked).
``examples/reward_model/scripts/`` has the same two kinds of pairs for GSM8K on a GPU.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
from pathlib import Path


def _run(run_dir: str):
    from transformers import AutoTokenizer

    from areal_cli.config.io import load_config_file
    from areal_cli.trainer.build import build_datasets

    cfg = load_config_file(str(Path(run_dir) / "config.yaml"))
    policy = str(Path(run_dir) / "sft_warmup" / "hf")
    tok = AutoTokenizer.from_pretrained(policy)
    train, test = build_datasets(cfg, tok)
    return policy, tok, train, test


def _correct(text: str, answer) -> bool:
    m = re.findall(r"####\s*(-?\d+)", text)
    return bool(m) and int(m[-1]) == int(answer)


def onpolicy(run_dir: str, out: str, prompts: int, samples: int = 8, batch: int = 16, new_tokens: int = 16) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    policy_dir, tok, train, test = _run(run_dir)
    torch.manual_seed(0)
    rng = random.Random(0)
    policy = AutoModelForCausalLM.from_pretrained(policy_dir).eval()
    held_out = {t["question"] for t in test}
    rows, t0 = [], time.time()
    items = train[:prompts]
    for k in range(0, len(items), batch):
        chunk = items[k:k + batch]
        width = max(len(it["prompt_ids"]) for it in chunk)
        ids = torch.full((len(chunk), width), tok.pad_token_id)
        attn = torch.zeros(len(chunk), width, dtype=torch.long)
        for i, it in enumerate(chunk):  # left-padded for generate
            ids[i, width - len(it["prompt_ids"]):] = torch.tensor(it["prompt_ids"])
            attn[i, width - len(it["prompt_ids"]):] = 1
        with torch.no_grad():
            gen = policy.generate(ids, attention_mask=attn, do_sample=True, temperature=1.0,
                                  max_new_tokens=new_tokens, num_return_sequences=samples,
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)[:, width:]
        for i, it in enumerate(chunk):
            texts = [tok.decode(g, skip_special_tokens=True) for g in gen[i * samples:(i + 1) * samples]]
            right = sorted({t for t in texts if _correct(t, it["answer"])})
            wrong = sorted({t for t in texts if not _correct(t, it["answer"])})
            if right and wrong and it["question"] not in held_out:
                for w in wrong[:2]:
                    rows.append({"id": f"{it['id']}-{len(rows)}", "prompt": it["question"],
                                 "chosen": rng.choice(right), "rejected": w})
        if k % 800 == 0:
            print(k, len(rows), f"{time.time() - t0:.0f}s", flush=True)
    rng.shuffle(rows)
    n_test = max(1, len(rows) // 20)
    dst = Path(out)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[n_test:]))
    (dst / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:n_test]))
    print("pairs", len(rows), "test", n_test, f"{time.time() - t0:.0f}s")


def nearmiss(run_dir: str, onpolicy_dir: str, out: str) -> None:
    _, _, train, test = _run(run_dir)
    held_out = {t["question"] for t in test}
    rng = random.Random(5)
    rows = []
    for r in train:
        if r["question"] in held_out:
            raise SystemExit(f"a held-out question is in the train split: {r['question']!r}")
        right = int(r["answer"])
        head = r["solution"].rsplit("####", 1)[0].rstrip("\n").rpartition("=")[0]
        wrong = right
        while wrong == right or wrong < 0:
            wrong = right + rng.choice([-3, -2, -1, 1, 2, 3])
        rows.append({"id": r["id"], "prompt": r["question"], "chosen": r["solution"],
                     "rejected": f"{head}={wrong}\n#### {wrong}"})
    sampled = [json.loads(line) for line in open(Path(onpolicy_dir) / "train.jsonl")]
    if any(o["prompt"] in held_out for o in sampled):
        raise SystemExit("a held-out question is in the on-policy pairs")
    rows += sampled
    rng.shuffle(rows)
    Path(out).write_text("".join(json.dumps(x) + "\n" for x in rows))
    print(f"{out}: {len(rows)} pairs ({len(train)} near misses, {len(sampled)} on-policy)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("onpolicy")
    a.add_argument("run_dir")
    a.add_argument("out")
    a.add_argument("--prompts", type=int, default=20000)
    a.add_argument("--threads", type=int, default=1)
    b = sub.add_parser("nearmiss")
    b.add_argument("run_dir")
    b.add_argument("onpolicy_dir")
    b.add_argument("out")
    args = ap.parse_args()
    if args.cmd == "onpolicy":
        import torch

        torch.set_num_threads(args.threads)
        onpolicy(args.run_dir, args.out, args.prompts)
    else:
        nearmiss(args.run_dir, args.onpolicy_dir, args.out)


if __name__ == "__main__":
    main()
