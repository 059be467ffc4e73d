"""GSM8K preference pairs for examples/reward_model, in the layout of the built-in pairs (docs/rewards.md,
"Built-in pairs"): per problem, the reference solution (chosen) against the same solution with its final
result moved by 1-20 (rejected; the last step's result and the `#### n` line both changed, never below 0).

    python -m areal_cli.data.prepare gsm8k --out data/gsm8k      # once: data/gsm8k/{train,test}.jsonl
    python examples/reward_model/scripts/make_pairs.py data/gsm8k data/gsm8k_prefs

writes data/gsm8k_prefs/{train,test}.jsonl with {"id", "prompt", "chosen", "rejected"} per row. The test
split's questions never occur in train, so the held-out pairwise accuracy measures what the model learned.
Pairs of sampled answers (a right and a wrong completion of your own policy) are the stronger signal once
you have them; this file needs no sampling.
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

SPREAD = 20  # as the built-in pairs (data/preferences.py WRONG_SPREAD)


def wrong_solution(answer: str, rng: random.Random) -> str | None:
    work, _, result = answer.rpartition("####")
    try:
        right = int(result.strip().replace(",", ""))
    except ValueError:
        return None  # a non-integer result: skipped
    wrong = right
    while wrong == right or wrong < 0:
        wrong = right + rng.randint(-SPREAD, SPREAD)
    work = work.rstrip("\n")
    # the last occurrence of the result in the worked text is the last step's: it changes with the answer
    hits = list(re.finditer(rf"(?<![\d.]){re.escape(str(right))}(?!\.?\d)", work))
    if hits:
        m = hits[-1]
        work = work[: m.start()] + str(wrong) + work[m.end():]
    return f"{work}\n#### {wrong}"


def main(src: str, out: str, seed: int = 1) -> None:
    dst = Path(out)
    dst.mkdir(parents=True, exist_ok=True)
    for k, split in enumerate(("train", "test")):
        rng = random.Random(seed * 7_919 + k + 1)
        rows = [json.loads(line) for line in (Path(src) / f"{split}.jsonl").read_text().splitlines() if line.strip()]
        n = 0
        with open(dst / f"{split}.jsonl", "w") as f:
            for i, r in enumerate(rows):
                rejected = wrong_solution(r["answer"], rng)
                if rejected is None:
                    continue
                f.write(json.dumps({"id": f"{split}-{i}", "prompt": r["question"], "chosen": r["answer"],
                                    "rejected": rejected}, ensure_ascii=False) + "\n")
                n += 1
        print(f"{dst / split}.jsonl: {n} pairs of {len(rows)} problems")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python examples/reward_model/scripts/make_pairs.py <gsm8k dir> <out dir>")
    main(sys.argv[1], sys.argv[2])
