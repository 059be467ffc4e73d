"""Worker for the DeepSpeed engine tests: :mod:`fsdp_worker`'s variants, optionally on a skewed batch.

``"batch": "skewed"`` in the spec replaces the worker's batch with one long row and seven short ones:
the token-balanced dp split then gives one rank one or two rows and the other the rest, so at one row
per micro-batch the light rank pads its step with empty micro-batches (ZeRO-3 needs every rank to run
the same number of forwards). ``"trainer_exit": true`` ends the process as ``areal train``'s trainer
does (``destroy_distributed`` after the engine's ``destroy``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import fsdp_worker  # noqa: E402


def skewed_batch(seed: int, B: int = 8, L: int = 40, vocab: int = 300):
    import torch

    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(5, 9, (B,), generator=g)
    lens[0] = L
    am = torch.arange(L)[None] < lens[:, None]
    ids = torch.randint(1, vocab, (B, L), generator=g) * am
    lm = am.float()
    lm[:, :3] = 0
    return {"input_ids": ids, "attention_mask": am, "loss_mask": lm, "advantages": torch.randn(B, L, generator=g)}


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    if spec.get("batch") == "skewed":
        fsdp_worker.make_batch = skewed_batch
    from areal_cli.utils.dist import destroy_distributed, exit_after

    def run() -> None:
        fsdp_worker.main()
        if spec.get("trainer_exit"):  # as trainer/entry.py ends every run
            destroy_distributed()

    exit_after(run)
