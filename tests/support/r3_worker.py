"""Worker for test_routing_replay.py: real FSDP engines (world 1, gloo) run a batch the hf server
generated (with its routed experts) and count, per fed token and MoE layer, where the experts the
trainer's MoE blocks actually ran differ from the server's.

argv[1]: JSON ``{"model_dir", "batch", "out", "lr", "stale_dir"}``. The batch (``torch.save``) carries
``routed_experts`` and ``row`` (its row index). Writes a dict of results to ``out``:

- ``fp32_same/off``: the server's weights, the engine's own routing (no replay);
- ``bf16_same/off`` and ``/on``: the same weights in bf16 on the trainer side;
- ``stale/off`` and ``stale/on``: after one optimizer step (the server is one policy version behind),
  through ``forward``; ``stale/train_on``: the training path (``_accumulate_grads``) with replay;
- ``logprobs``: the stale policy's logprobs under replay in the padded, packed and shared-prefix layouts,
  and packed without replay; ``router_grad``: the routers' gradient norm of the replayed training step.
  The stale policy is exported to ``stale_dir``.

With ``"cp": 2`` (run on 2 ranks): the stale policy from ``stale_dir`` under Ulysses (``c2``, the packed
row split over the ranks), logprobs with replay (``cp_on``) and without (``cp_off``), from rank 0.
With ``"archon": {dims}``: the same on the archon engine (``archon_on``, ``archon_off``), plus the stats of
one replayed training step (``archon_train``), see :func:`archon`. With ``"megatron": {dims}``: the same on
the megatron engine (mcore's routers), plus what those routers actually chose, see :func:`megatron`.
"""

from __future__ import annotations

import json
import sys

KEY = "routed_experts"


class ExpertsSeen:
    """Forward pre-hooks on every MoE block's ``experts``: the indices the experts are really called with."""

    def __init__(self, model):
        blocks = [m for m in model.modules() if hasattr(m, "experts") and hasattr(m, "gate")]
        self.seen: list = []
        self.handles = [b.experts.register_forward_pre_hook(self._hook) for b in blocks]
        self.n_layers = len(blocks)

    def _hook(self, _mod, args) -> None:
        self.seen.append(args[1].detach().cpu())

    def take(self, rows: int):
        import torch

        out = torch.stack(self.seen[-self.n_layers:], dim=1)  # [rows * L, layers, k]
        self.seen = []
        return out.view(rows, -1, *out.shape[1:])

    def close(self):
        for h in self.handles:
            h.remove()


def count(used, server, loss_mask):
    """Mismatching (token, layer) pairs between ``used`` [b, l, layers, k] and the server's routing
    [b, l, layers * k] where recorded; over every fed token and over the generated ones."""

    srv = server[:, : used.shape[1]].view(*used.shape).long()
    have = (srv >= 0).all(-1)  # [b, l, layers]
    diff = (used.long().sort(-1).values != srv.sort(-1).values).any(-1) & have
    gen = have & (loss_mask[:, : used.shape[1]] > 0)[..., None]
    return {"diff": int(diff.sum()), "n": int(have.sum()), "gen_diff": int((diff & gen).sum()),
            "gen_n": int(gen.sum())}


def engine(model_dir: str, lr: float, **cfg):
    from areal_cli.api.io_struct import ParallelStrategy
    from areal_cli.config.algo import OptimConfig
    from areal_cli.config.engine import EngineConfig
    from areal_cli.engines import get_engine_cls

    e = get_engine_cls("fsdp")(EngineConfig(max_tokens_per_mb=100_000, **cfg), OptimConfig(lr=lr),
                               total_steps=2, seed=0)
    e.initialize(ParallelStrategy(), model_dir)
    return e


def measure(e, batch, server, replay: bool):
    """Counts for one padded ``forward`` (one micro-batch in row order), with or without the recording."""
    seen = ExpertsSeen(e.model)
    b = dict(batch) if replay else {k: v for k, v in batch.items() if k != KEY}
    try:
        e.forward(b)
        return count(seen.take(b["input_ids"].shape[0]), server, batch["loss_mask"])
    finally:
        seen.close()


def pg_loss(out, mb):
    """A policy-gradient step (rewards as advantages): moves the policy one version."""
    adv = (mb["rewards"] - 0.5)[:, None]
    return -(out["logprobs"] * adv * mb["loss_mask"]).sum() / mb["loss_mask"].sum().clamp(min=1), {}


def train_on(e, batch, server):
    """The training path with replay: per micro-batch, the experts used against the server's rows."""
    import torch

    seen = ExpertsSeen(e.model)
    tot: dict[str, int] = {}

    def loss_fn(out, mb):
        c = count(seen.take(mb["input_ids"].shape[0]), server[mb["row"].cpu()], mb["loss_mask"].cpu())
        for k, v in c.items():
            tot[k] = tot.get(k, 0) + v
        return pg_loss(out, mb)

    try:
        weight = lambda mb: float(mb["loss_mask"].sum())  # noqa: E731
        _, stat_sums, denom, _ = e._accumulate_grads(dict(batch), loss_fn, weight, 1.0)
        tot["reported"] = stat_sums["routing_replay/mismatch_rate"] / denom  # the step's own stat
        grads = [r.weight.grad for r in e.model.modules() if type(r).__name__.endswith("TopKRouter")]
        ok = all(g is not None for g in grads)
        norm = float(torch.stack([g.norm() for g in grads]).norm()) if ok else 0.0
    finally:
        seen.close()
        e.optimizer.zero_grad(set_to_none=True)
    return tot, norm


def ulysses(spec, batch) -> None:
    import torch
    import torch.distributed as dist

    from areal_cli.api.io_struct import ParallelStrategy
    from areal_cli.config.algo import OptimConfig
    from areal_cli.config.engine import EngineConfig
    from areal_cli.engines import get_engine_cls

    e = get_engine_cls("fsdp")(EngineConfig(max_tokens_per_mb=100_000), OptimConfig(lr=spec["lr"]), seed=0)
    e.initialize(ParallelStrategy(cp=spec["cp"]), spec["stale_dir"])
    res = {"cp_on": e.forward(dict(batch))["logprobs"],
           "cp_off": e.forward({k: v for k, v in batch.items() if k != KEY})["logprobs"]}
    if dist.get_rank() == 0:
        torch.save(res, spec["out"])
    e.destroy()


def archon(spec, batch) -> None:
    """The stale policy on archon (``spec["archon"]``: its dims, e.g. d2e2 with the experts cut over two ranks):
    logprobs with and without replay on every rank's full batch, and one training step with replay on this
    rank's share of the rows (its stats carry the mismatch the replay removed)."""
    import torch
    import torch.distributed as dist

    from areal_cli.api.io_struct import ParallelStrategy
    from areal_cli.config.algo import OptimConfig
    from areal_cli.config.engine import EngineConfig
    from areal_cli.engines import get_engine_cls
    from areal_cli.engines.packing import split_batch_for_dp

    e = get_engine_cls("archon")(EngineConfig(max_tokens_per_mb=100_000), OptimConfig(lr=spec["lr"]), seed=0)
    e.initialize(ParallelStrategy(**spec["archon"]), spec["stale_dir"])
    plain = {k: v for k, v in batch.items() if k != KEY}
    res = {"archon_on": e.forward(dict(batch))["logprobs"], "archon_off": e.forward(plain)["logprobs"]}
    mine = split_batch_for_dp(dict(batch), e.dp_world_size)[e.dp_rank]
    res["archon_train"] = e.train_batch(mine, pg_loss, lambda mb: float(mb["loss_mask"].sum()))
    if dist.get_rank() == 0:
        torch.save(res, spec["out"])
    e.destroy()


class McoreChosen:
    """Forward hooks on mcore's ``TopKRouter``s: per (token, layer) the router replayed, whether the experts
    in its ``routing_map`` are the replayed ones (``ReplayTopK.target``, where recorded)."""

    def __init__(self, model):
        self.counts = {"diff": 0, "n": 0}
        self.routers = [m for m in model.modules() if type(m).__name__ == "TopKRouter"]
        self.handles = [r.register_forward_hook(self._hook) for r in self.routers]

    def _hook(self, mod, _args, out) -> None:
        import torch

        target = mod.router_replay.target
        if target is None:
            return
        routing_map = out[1]
        have = (target >= 0).all(-1)
        used = torch.topk(routing_map.int(), target.shape[1], dim=-1).indices.sort(-1).values
        diff = (used != target.sort(-1).values).any(-1) & have
        self.counts["diff"] += int(diff.sum())
        self.counts["n"] += int(have.sum())

    def close(self):
        for h in self.handles:
            h.remove()


def megatron(spec, batch) -> None:
    """The stale policy on megatron (``spec["megatron"]``: its dims, e.g. d2e2, or t2p2 where sequence
    parallelism hands each router half the tokens and each stage holds one layer): logprobs with and without
    replay on the full batch, the experts mcore's routers chose under replay against the replayed ones (summed
    over the ranks), and one replayed training step on this rank's share of the rows."""
    import torch
    import torch.distributed as dist

    from areal_cli.api.io_struct import ParallelStrategy
    from areal_cli.config.algo import OptimConfig
    from areal_cli.config.engine import EngineConfig
    from areal_cli.engines import get_engine_cls
    from areal_cli.engines.packing import split_batch_for_dp

    e = get_engine_cls("megatron")(EngineConfig(max_tokens_per_mb=100_000), OptimConfig(lr=spec["lr"]), seed=0)
    e.initialize(ParallelStrategy(**spec["megatron"]), spec["stale_dir"])
    plain = {k: v for k, v in batch.items() if k != KEY}
    chosen = McoreChosen(e.model)
    res = {"megatron_on": e.forward(dict(batch))["logprobs"], "megatron_off": e.forward(plain)["logprobs"]}
    mine = split_batch_for_dp(dict(batch), e.dp_world_size)[e.dp_rank]
    res["megatron_train"] = e.train_batch(mine, pg_loss, lambda mb: float(mb["loss_mask"].sum()))
    chosen.close()
    counts = torch.tensor([chosen.counts["diff"], chosen.counts["n"]])
    dist.all_reduce(counts)
    res["megatron_chosen"] = {"diff": int(counts[0]), "n": int(counts[1]), "routers": len(chosen.routers)}
    if dist.get_rank() == 0:
        torch.save(res, spec["out"])
    e.destroy()


def main() -> None:
    import dataclasses

    import torch

    from areal_cli.api.io_struct import SaveLoadMeta

    spec = json.loads(sys.argv[1])
    batch = torch.load(spec["batch"], weights_only=False)
    if spec.get("cp"):
        return ulysses(spec, batch)
    if spec.get("archon"):
        return archon(spec, batch)
    if spec.get("megatron"):
        return megatron(spec, batch)
    server = batch[KEY]
    res: dict = {}
    padded = {"padding_free": False}
    e = engine(spec["model_dir"], spec["lr"], **padded)
    res["fp32_same/off"] = measure(e, batch, server, replay=False)
    e.destroy()
    e = engine(spec["model_dir"], spec["lr"], dtype="bfloat16", **padded)
    res["bf16_same/off"] = measure(e, batch, server, replay=False)
    res["bf16_same/on"] = measure(e, batch, server, replay=True)
    e.destroy()
    # one policy version ahead of the server: a real optimizer step on the batch (no replay, as a run
    # without the option would take it)
    e = engine(spec["model_dir"], spec["lr"], **padded)
    plain = {k: v for k, v in batch.items() if k != KEY}
    e.train_batch(plain, pg_loss, lambda mb: float(mb["loss_mask"].sum()))
    res["stale/off"] = measure(e, batch, server, replay=False)
    res["stale/on"] = measure(e, batch, server, replay=True)
    res["stale/train_on"], res["router_grad"] = train_on(e, batch, server)
    e.save(SaveLoadMeta(path=spec["stale_dir"], tokenizer_path=spec["model_dir"]))
    lps = {"padded": e.forward(dict(batch))["logprobs"]}
    for name, cfg in {"packed": {"shared_prefix": False}, "shared": {}}.items():
        e.cfg = dataclasses.replace(e.cfg, padding_free=True, **cfg)
        lps[name] = e.forward(dict(batch))["logprobs"]
        if name == "packed":
            lps["packed_off"] = e.forward(dict(plain))["logprobs"]
    e.destroy()
    res["logprobs"] = lps
    torch.save(res, spec["out"])


if __name__ == "__main__":
    from areal_cli.utils.dist import exit_after

    exit_after(main)
