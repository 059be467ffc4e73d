"""Worker process for the reward-model layout tests (one process per rank, gloo on CPU).

Run through :func:`fsdp_worker.launch` (``script=`` this file) with a JSON spec whose ``variants`` each name an
engine and a layout. Every variant builds a critic engine on the same model (fp32, seed 0) and runs
:data:`STEPS` reward-model steps (``algorithms.reward_model.rm_step``) on the same global batches of
preference pairs, each data-parallel replica on its slice of the pairs as ``trainer/rm.py`` does. Rank 0
saves the step stats (the Bradley–Terry loss, accuracy, margin and mean rewards over all pairs, from the
forward before each update), the rewards of every row of the first batch (replicas gathered) and the full
weights after the steps to ``<out>/<name>.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

STEPS = 3  # the zero-initialised head moves alone in step 1; the backbone trains from step 2 on
PAIRS = 8
VOCAB = 300


def make_pairs(step: int) -> list[dict]:
    """Pairs sharing a prompt, sides of different lengths (so a token budget can cut a pair apart)."""
    import torch

    g = torch.Generator().manual_seed(500 + step)
    pairs = []
    for _ in range(PAIRS):
        prompt = torch.randint(4, VOCAB, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g).tolist()
        sides = [prompt + torch.randint(4, VOCAB, (int(torch.randint(1, 10, (1,), generator=g)),),
                                        generator=g).tolist() for _ in range(2)]
        pairs.append({"chosen_ids": sides[0], "rejected_ids": sides[1]})
    return pairs


def run(v: dict, model_dir: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from fsdp_worker import engine_config, full_weights

    from areal_cli.algorithms.reward_model import make_pair_batch, rm_step, sequence_rewards
    from areal_cli.api.io_struct import ParallelStrategy
    from areal_cli.config.algo import OptimConfig
    from areal_cli.engines import get_engine_cls

    # eps=1e-2: Adam's update stays linear in the gradient, so 1e-5 on weights compares gradients, not
    # rounding noise divided by itself (tests/integration/engines/test_archon_engine.py)
    optim = OptimConfig(lr=1e-3, eps=1e-2, grad_clip=1e9)
    engine = get_engine_cls(v.get("cls", "fsdp"))(engine_config(v.get("engine", {})), optim, total_steps=STEPS,
                                                  seed=0, critic=True)
    engine.initialize(ParallelStrategy(**v.get("parallel", {})), model_dir)
    res: dict = {"stats": []}

    def mine(step: int):
        pairs = make_pairs(step)
        return make_pair_batch(pairs[engine.dp_rank::engine.dp_world_size], read_token_id=1, pad_token_id=0), pairs

    for step in range(STEPS):
        batch, pairs = mine(step)
        if step == 1:  # the forward at the first trained weights, every row: each replica's rows gathered
            r = sequence_rewards(engine.forward(batch, output="values")["values"], batch["attention_mask"])
            parts = [None] * dist.get_world_size()
            dist.all_gather_object(parts, (engine.dp_rank, r))
            full = torch.zeros(2 * len(pairs))
            for rank, rr in parts:
                idx = [2 * p + s for p in range(rank, len(pairs), engine.dp_world_size) for s in (0, 1)]
                full[idx] = rr
            res["rewards"] = full
        res["stats"].append(rm_step(engine, batch, len(pairs)))
    res["weights"] = full_weights(engine)
    if v.get("export"):
        export(engine, v, res, out_dir)
    if dist.get_rank() == 0:
        torch.save(res, Path(out_dir) / f"{v['name']}.pt")
    dist.barrier()
    engine.destroy()


def export(engine, v: dict, res: dict, out_dir: str) -> None:
    """The HF export as a sequence classifier: rank 0 loads it with ``transformers`` and scores the first
    batch's rows one at a time (no padding), beside the engine's rewards for the same rows."""
    import torch
    import torch.distributed as dist

    from areal_cli.algorithms.reward_model import make_pair_batch, sequence_rewards
    from areal_cli.api.io_struct import SaveLoadMeta
    from areal_cli.trainer.reward_export import write_sequence_classification

    pairs = make_pairs(0)
    batch = make_pair_batch(pairs[engine.dp_rank::engine.dp_world_size], read_token_id=1, pad_token_id=0)
    res["final_rewards"] = sequence_rewards(engine.forward(batch, output="values")["values"], batch["attention_mask"])
    path = str(Path(out_dir) / f"{v['name']}_hf")
    engine.save(SaveLoadMeta(path=path, weight_format="hf"))
    if dist.get_rank() == 0:
        from transformers import AutoModelForSequenceClassification

        res["seq_cls"] = write_sequence_classification(path, pad_token_id=0)
        model = AutoModelForSequenceClassification.from_pretrained(path).eval()
        with torch.no_grad():
            res["hf_rewards"] = torch.tensor([float(model(torch.tensor([p[s]])).logits[0, 0])
                                              for p in pairs for s in ("chosen_ids", "rejected_ids")])
        res["hf_class"] = type(model).__name__
    dist.barrier()


if __name__ == "__main__":
    from fsdp_worker import variants_main

    from areal_cli.utils.dist import exit_after

    exit_after(lambda: variants_main(run))
