"""Does bf16 learn? SFT of the 11.9M model in fp32, in bf16 (``engine.dtype=bfloat16``: bf16 compute over fp32
master weights), and with bf16 weights and no masters (what ``engine.dtype=bfloat16`` meant on fsdp and
archon before: the baseline a bf16 update rounds away in).

    python benchmarks/bf16_learning.py                       # 200 steps, lr 1e-4, 8 rows a step
    python benchmarks/bf16_learning.py --model 0.54M         # the embedded default's model (fast on CPU)
    python benchmarks/bf16_learning.py --steps 50 --json out.json

All three are FSDP engines in one process (gloo, world 1), built from the same checkpoint with the same seed,
stepped in turn on the same batches (interleaved: a slow moment of the machine hits all three alike). Each
step is one AdamW step of token-mean NLL on ``--batch`` built-in arithmetic rows (question -> worked answer).
Prints the loss curves (mean of the last ``--window`` steps), the bf16/fp32 ratio, and each variant's
median step time; ``--json`` writes them, ``--plot`` draws the curves.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MODELS = {
    "11.9M": ("model.path=builtin:tiny", "model.hidden_size=256", "model.num_hidden_layers=12",
              "model.num_attention_heads=8", "model.num_key_value_heads=4", "model.intermediate_size=1024"),
    "0.54M": ("model.path=builtin:tiny",),  # the embedded default's model
}
VARIANTS = ("fp32", "bf16", "bf16_no_master")


def _engine(cfg, variant: str, model: str, steps: int):
    import torch

    from areal_cli.api.io_struct import ParallelStrategy
    from areal_cli.engines.fsdp import FSDPEngine

    ecfg = type(cfg.engine)(**{**vars(cfg.engine), "dtype": "float32" if variant == "fp32" else "bfloat16"})
    eng = FSDPEngine(ecfg, cfg.algo.optim, total_steps=steps, seed=0)
    eng.initialize(ParallelStrategy(), model)
    if variant == "bf16_no_master":
        # The engines before engines/precision.py: the module's own parameters in bf16, AdamW on them.
        from areal_cli.utils.optim import build_optimizer

        model_fwd = eng.model.forward
        eng.model.forward = getattr(model_fwd, "__wrapped__", model_fwd)  # no autocast: weights are bf16
        eng.model.to(torch.bfloat16)
        eng.optimizer, eng.scheduler = build_optimizer(list(eng.model.parameters()), cfg.algo.optim, steps)
    return eng


def run(steps: int, lr: float, batch: int, size: str = "11.9M", model_dir: str | None = None,
        seed: int = 0, progress: int = 0) -> dict:
    import torch

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from areal_cli.utils.network import find_free_port

    os.environ["MASTER_PORT"] = str(find_free_port())
    from transformers import AutoTokenizer

    from areal_cli.algorithms.actor import sft_step
    from areal_cli.plan.compose import load_config
    from areal_cli.data.datasets import load_split
    from areal_cli.trainer.build import resolve_model_path
    from areal_cli.trainer.sft import make_sft_batch

    root = tempfile.mkdtemp(prefix="areal_bench_bf16_")
    cfg = load_config([f"cluster.fileroot={root}", *MODELS[size], f"algo.optim.lr={lr}",
                       "algo.optim.lr_scheduler=constant", "algo.optim.warmup_steps=0"])
    model = model_dir or resolve_model_path(cfg)
    tok = AutoTokenizer.from_pretrained(model)
    items, _ = load_split(cfg.dataset, tok, "train", seed=cfg.seed)
    engines = {v: _engine(cfg, v, model, steps) for v in VARIANTS}
    nparams = sum(p.numel() for p in engines["fp32"].model.parameters())
    losses = {v: [] for v in VARIANTS}
    times = {v: [] for v in VARIANTS}
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(len(items), (batch,), generator=g).tolist()
        b = make_sft_batch([items[i] for i in idx], tok)
        for v, eng in engines.items():
            t0 = time.perf_counter()
            losses[v].append(float(sft_step(eng, b)["loss"]))
            times[v].append(time.perf_counter() - t0)
        if progress and (len(losses["fp32"]) % progress == 0):
            print(f"step {len(losses['fp32'])}: " + "  ".join(f"{v} {losses[v][-1]:.4f}" for v in VARIANTS),
                  flush=True)
    for eng in engines.values():
        eng.destroy()
    return {"model": model_dir or size, "steps": steps, "lr": lr, "batch": batch, "params": nparams, "losses": losses,
            "step_time_median": {v: statistics.median(t) for v, t in times.items()}}


def summarise(res: dict, window: int) -> dict:
    last = {v: statistics.fmean(res["losses"][v][-window:]) for v in VARIANTS}
    return {"final_loss": last, "ratio_to_fp32": {v: last[v] / last["fp32"] for v in VARIANTS}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--model", choices=list(MODELS), default="11.9M")
    ap.add_argument("--model-dir", default=None, help="an HF dir instead (its tokenizer must cover the task)")
    ap.add_argument("--window", type=int, default=20, help="final loss: mean of the last N steps")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="write the loss curves to this PNG")
    args = ap.parse_args()
    res = run(args.steps, args.lr, args.batch, args.model, args.model_dir, progress=10)
    res.update(summarise(res, min(args.window, args.steps)))
    print(f"SFT of a {res['params'] / 1e6:.1f}M model, {args.steps} steps, lr {args.lr}, {args.batch} rows/step")
    for v in VARIANTS:
        print(f"  {v:15s} loss {res['losses'][v][0]:.3f} -> {res['final_loss'][v]:.4f} "
              f"(x{res['ratio_to_fp32'][v]:.3f} fp32)   median step {res['step_time_median'][v]:.3f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for v in VARIANTS:
            ax.plot(res["losses"][v], label=v)
        ax.set_xlabel("step")
        ax.set_ylabel("SFT loss")
        ax.set_yscale("log")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
