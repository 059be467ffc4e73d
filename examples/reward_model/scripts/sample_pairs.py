"""On-policy preference pairs for examples/reward_model: the policy's own samples on the train prompts, a
right completion (the task's rule: the number after `####`, areal's `numeric` reward) against a wrong one of
the same prompt. A reward model trained on these learns to tell apart exactly the mistakes the policy makes;
pairs of a reference solution against a perturbed copy do not teach that (docs/rewards.md, "On this CPU: RL
against the reward model alone").

    python -m areal_cli.data.prepare gsm8k --out data/gsm8k      # once: data/gsm8k/{train,test}.jsonl
    python examples/reward_model/scripts/sample_pairs.py --model Qwen/Qwen2.5-1.5B-Instruct \\
        --data data/gsm8k/train.jsonl --out data/gsm8k_prefs

writes data/gsm8k_prefs/{train,test}.jsonl ({"id", "prompt", "chosen", "rejected"} per row; test is a share of
the *train* prompts, so the RL run's held-out problems stay unseen). The prompt is rendered as the RL run
renders it (the chat template's user turn); completions are sampled at temperature 1 with `transformers` on the
first GPU (CPU without one). Empty completions are left out (a pair's sides must be text).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path


def final_number(answer: str) -> str:
    return answer.rsplit("####", 1)[-1].strip().replace(",", "")


def sample_pairs(model: str, rows: list[dict], *, samples: int, max_new_tokens: int, batch: int, seed: int,
                 per_prompt: int, question: str = "question", answer: str = "answer") -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from areal_cli.rewards.builtin import numeric_reward

    torch.manual_seed(seed)
    rng = random.Random(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tok = AutoTokenizer.from_pretrained(model)
    tok.padding_side = "left"
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    policy = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.bfloat16 if device == "cuda"
                                                  else torch.float32).to(device).eval()
    out, t0 = [], time.time()
    for k in range(0, len(rows), batch):
        chunk = rows[k:k + batch]
        texts = [tok.apply_chat_template([{"role": "user", "content": r[question]}], tokenize=False,
                                         add_generation_prompt=True) if tok.chat_template else r[question]
                 for r in chunk]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        with torch.no_grad():
            gen = policy.generate(**enc, do_sample=True, temperature=1.0, max_new_tokens=max_new_tokens,
                                  num_return_sequences=samples, pad_token_id=pad)
        gen = gen[:, enc["input_ids"].shape[1]:]
        for i, r in enumerate(chunk):
            comps = [tok.decode(g, skip_special_tokens=True).strip() for g in gen[i * samples:(i + 1) * samples]]
            gold = final_number(str(r[answer]))
            verdict = {c: float(numeric_reward(r[question], c, gold)) > 0 for c in set(comps) if c}
            right = sorted(c for c, ok in verdict.items() if ok)
            wrong = sorted(c for c, ok in verdict.items() if not ok)
            if right and wrong:
                for w in rng.sample(wrong, min(per_prompt, len(wrong))):
                    out.append({"id": f"{r.get('id', k + i)}-{len(out)}", "prompt": r[question],
                                "chosen": rng.choice(right), "rejected": w})
        print(f"{k + len(chunk)}/{len(rows)} prompts, {len(out)} pairs, {time.time() - t0:.0f} s", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the policy RL will start from (an HF dir or hub id)")
    ap.add_argument("--data", required=True, help="a jsonl of {question, answer ending in '#### n'}")
    ap.add_argument("--out", required=True)
    ap.add_argument("--samples", type=int, default=8, help="completions per prompt (the RL group size)")
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16, help="prompts per generate call")
    ap.add_argument("--per-prompt", type=int, default=2, help="pairs per prompt at most (one per wrong answer)")
    ap.add_argument("--limit", type=int, default=0, help="the first N prompts only (0: all)")
    ap.add_argument("--test-fraction", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rows = [json.loads(x) for x in Path(a.data).read_text().splitlines() if x.strip()]
    rows = rows[: a.limit] if a.limit else rows
    pairs = sample_pairs(a.model, rows, samples=a.samples, max_new_tokens=a.max_new_tokens, batch=a.batch,
                         seed=a.seed, per_prompt=a.per_prompt)
    random.Random(a.seed).shuffle(pairs)
    n_test = int(len(pairs) * a.test_fraction)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", pairs[n_test:]), ("test", pairs[:n_test])):
        with open(out / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(p, ensure_ascii=False) + "\n" for p in part)
        print(f"{out / name}.jsonl: {len(part)} pairs")


if __name__ == "__main__":
    main()
