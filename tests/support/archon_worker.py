"""Worker process for the Archon parallelism tests (one process per rank, gloo on CPU).

Run through :func:`fsdp_worker.launch` with a JSON spec whose ``variants`` each name a layout. Every
variant builds the same tiny model from config (fp32, seed 0), runs two training steps on the same
global batches as :func:`reference` (the one-process HF model), and rank 0 saves loss, full
gradients after the first backward, gradient norms and full weights after the second step to
``<out>/<name>.pt``. The ``vocab`` variant checks vocab-parallel logprobs/entropy and their
gradients against the full-vocabulary computation.
"""

from __future__ import annotations

import faulthandler
import json
import sys
from pathlib import Path

V = 256
ROWS = 8  # global batch rows
MB_ROWS = 2  # rows per micro-batch
STEP_LENS = (24, 16, 16)  # a new sequence length, then the same one again (schedule reuse)
TEMPERATURE = 0.7
MAX_NORM = 1.0  # below the gradient norm, so clipping scales the gradients
LR = 1e-3
# Adam's update g/(|g|+eps) turns fp32 rounding noise on gradients that are zero up to rounding
# (1e-9, from cancellation) into O(lr) weight differences when eps is tiny; eps=1e-5 keeps the
# comparison about the parallelism, not about dividing noise by noise.
ADAM_EPS = 1e-5


def build_model(family: str = "qwen2", tied: bool = False, layers: int = 4):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  tie_word_embeddings=tied, pad_token_id=0, attn_implementation="sdpa")
    cfg = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "llama": LlamaConfig}[family](**common)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def make_batch(step: int):
    """Right-padded rows; loss on every real token after the first 4 (as an RL completion)."""
    import torch

    L = STEP_LENS[step]
    g = torch.Generator().manual_seed(100 + step)
    lens = torch.randint(L // 2, L + 1, (ROWS,), generator=g)
    lens[0] = L
    am = torch.arange(L)[None] < lens[:, None]
    ids = torch.randint(1, V, (ROWS, L), generator=g) * am
    lm = am.float()
    lm[:, :4] = 0
    adv = torch.randn(ROWS, L, generator=g)
    return {"input_ids": ids, "attention_mask": am, "loss_mask": lm, "advantages": adv}


def mb_loss(lp, ent, mb):
    """Mean over the micro-batch's loss tokens (position ``t`` predicts token ``t+1``)."""
    m = mb["loss_mask"][:, 1:]
    n = m.sum().clamp(min=1)
    pg = -(lp * mb["advantages"][:, 1:] * m).sum() / n
    return pg - 0.01 * (ent * m).sum() / n


def mb_weight(mb) -> float:
    return float(mb["loss_mask"][:, 1:].sum())


def masks_and_positions(batch):
    import torch

    from areal_cli.engines.packing import padded_causal_mask

    B, L = batch["input_ids"].shape
    return padded_causal_mask(batch["attention_mask"]), torch.arange(L)[None].expand(B, L).contiguous()


def split_rows(batch, lo: int, hi: int):
    return {k: v[lo:hi] for k, v in batch.items()}


def reference(family: str, tied: bool) -> dict:
    """One process, plain HF model and torch's clip_grad_norm_: the numbers every layout must match."""
    import torch

    from areal_cli.engines.archon.vocab_parallel import full_logprobs_entropy

    torch.manual_seed(0)
    model = build_model(family, tied)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS, foreach=False)
    res: dict = {"losses": [], "grad_norms": [], "probe_before": _ref_probe(model)}
    for step in range(len(STEP_LENS)):
        batch = make_batch(step)
        mask, pos = masks_and_positions(batch)
        total_w = mb_weight(batch)
        loss_sum = 0.0
        for lo in range(0, ROWS, MB_ROWS):
            mb = split_rows(batch, lo, lo + MB_ROWS)
            logits = model(input_ids=mb["input_ids"], position_ids=pos[lo:lo + MB_ROWS],
                           attention_mask=mask[lo:lo + MB_ROWS], use_cache=False).logits
            lp, ent = full_logprobs_entropy(logits[:, :-1], mb["input_ids"][:, 1:], TEMPERATURE)
            loss = mb_loss(lp, ent, mb) * (mb_weight(mb) / total_w)
            loss.backward()
            loss_sum += float(loss.detach())
        res["losses"].append(loss_sum)
        if step == 0:
            res["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, foreach=False)
        res["grad_norms"].append(float(norm))
        opt.step()
        opt.zero_grad(set_to_none=True)
    res["weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    res["probe_after"] = _ref_probe(model)
    return res


def _ref_probe(model):
    import torch

    from areal_cli.engines.archon.vocab_parallel import full_logprobs_entropy

    batch = make_batch(0)
    mask, pos = masks_and_positions(batch)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], position_ids=pos, attention_mask=mask,
                       use_cache=False).logits
        return torch.stack(full_logprobs_entropy(logits[:, :-1], batch["input_ids"][:, 1:], TEMPERATURE), -1)


# ---------------------------------------------------------------------------- parallel side
def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _gather_named(named, mesh, what: str) -> dict | None:
    """Full tensors (``what`` = "grad" or "data") of this rank's parameters, merged on rank 0."""
    import torch.distributed as dist

    mine = {}
    for name, p in named:
        t = p.grad if what == "grad" else p.data
        if t is None:
            continue
        full = _full(t).detach().clone()  # collective over the parameter's own mesh
        if mesh.dp_rank == 0 and mesh.tp_rank == 0:
            mine[name] = full
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    if dist.get_rank() != 0:
        return None
    out: dict = {}
    for d in parts:
        for k, v in d.items():
            if k in out:
                assert (out[k] - v).abs().max() == 0, k  # a stage's copies agree
            out[k] = v
    return out


def _named(model, pipe, tied: bool):
    """HF names; the last stage's tied copy of the embedding is reported as ``tied_copy``."""
    items = list(pipe.named_parameters()) if pipe is not None else list(model.named_parameters())
    out = []
    for m_name, p in items:
        if pipe is not None and tied and m_name == "lm_head.weight":
            out.append(("tied_copy", p))
        else:
            out.append((m_name, p))
    return out


class Setup:
    """One layout: the mesh, the parallelised model (or this rank's pipeline) and its optimizer."""

    def __init__(self, v: dict):
        import torch

        from areal_cli.engines.archon import pipeline
        from areal_cli.engines.archon.mesh import ArchonDims
        from areal_cli.engines.archon.parallelize import parallelize

        self.dims = ArchonDims(pp=v.get("pp", 1), dp=v.get("dp", 1), tp=v.get("tp", 1))
        self.mesh = self.dims.build("cpu")
        self.tied = v.get("tied", False)
        self.model = build_model(v.get("family", "qwen2"), self.tied)
        ac = v.get("ac", False)
        # Mixed precision: bf16 compute, fp32 master weights and gradient reduction (FSDP's policy).
        mp = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32} if v.get("mp") else {}
        self.pipe = None
        if self.dims.pp > 1:
            mods = pipeline.build_stage_modules(self.model, pp_rank=self.mesh.pp_rank, pp_size=self.dims.pp,
                                                schedule=v["schedule"], virtual_stages=v.get("virtual", 1),
                                                layers_per_stage=v.get("layers_per_stage"))
            for m in mods:
                parallelize(m, self.mesh, activation_checkpointing=ac, pipelined=True, **mp)
                m.train()
            self.pipe = pipeline.Pipeline(mods, self.mesh, v["schedule"], torch.device("cpu"))
            self.params, self.norm_params = self.pipe.parameters(), self.pipe.norm_parameters()
        else:
            parallelize(self.model, self.mesh, activation_checkpointing=ac, **mp)
            self.model.train()
            self.params = self.norm_params = list(self.model.parameters())
        self.opt = torch.optim.AdamW(self.params, lr=LR, eps=ADAM_EPS, foreach=False)
        self.tp_group = self.mesh.tp_group if self.dims.tp > 1 else None
        self.rows = ROWS // self.dims.dp

    def local(self, step: int):
        """This data-parallel replica's rows of the global batch, its masks and the global weight."""
        gbatch = make_batch(step)
        mask, pos = masks_and_positions(gbatch)
        lo = self.mesh.dp_rank * self.rows
        sl = slice(lo, lo + self.rows)
        return split_rows(gbatch, lo, lo + self.rows), mask[sl], pos[sl], mb_weight(gbatch)

    def logp_ent(self, logits, ids):
        from areal_cli.engines.archon import vocab_parallel

        return vocab_parallel.logprobs_entropy(logits[:, :-1], ids[:, 1:], TEMPERATURE, group=self.tp_group,
                                               vocab_size=V)

    def train_step(self, step: int) -> float:
        """Forward+backward of one global batch in micro-batches; returns the global loss."""
        import torch
        import torch.distributed as dist

        batch, mask, pos, total_w = self.local(step)
        mbs = [split_rows(batch, lo, lo + MB_ROWS) for lo in range(0, self.rows, MB_ROWS)]
        mine = 0.0
        if self.pipe is not None:
            from areal_cli.engines.archon import pipeline

            def fn(out, i):
                return mb_loss(*self.logp_ent(out, mbs[i]["input_ids"]), mbs[i]), {}

            loss = pipeline.MicroBatchLoss(fn, [mb_weight(mb) for mb in mbs], total_w)
            ids, pos_s, mask_s = self._trimmed_then_padded(mbs, mask, pos)
            self.pipe.train_step(ids, n_microbatches=len(mbs), loss=loss, position_ids=pos_s,
                                 attention_mask=mask_s)
            if self.pipe.has_last and self.mesh.tp_rank == 0:
                assert sorted(loss.scaled_losses) == list(range(len(mbs)))
                mine = sum(loss.scaled_losses.values())
        else:
            for k, mb in enumerate(mbs):
                sl = slice(k * MB_ROWS, (k + 1) * MB_ROWS)
                logits = self.model(input_ids=mb["input_ids"], position_ids=pos[sl], attention_mask=mask[sl],
                                    use_cache=False).logits
                scaled = mb_loss(*self.logp_ent(logits, mb["input_ids"]), mb) * (mb_weight(mb) / total_w)
                scaled.backward()
                mine += float(scaled.detach()) if self.mesh.tp_rank == 0 else 0.0
        t = torch.tensor([mine], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t)

    @staticmethod
    def _trimmed_then_padded(mbs, mask, pos):
        """Cut every micro-batch to its own longest row, then pad back with the pipeline helpers:
        the step's micro-batches have different lengths, as an engine's packed ones do."""
        from areal_cli.engines.archon.pipeline import pad_stack, pad_stack_masks
        from areal_cli.engines.packing import padded_causal_mask

        ids, poss, masks = [], [], []
        for k, mb in enumerate(mbs):
            n = int(mb["attention_mask"].sum(1).max())
            ids.append(mb["input_ids"][:, :n])
            poss.append(pos[k * MB_ROWS:(k + 1) * MB_ROWS, :n])
            masks.append(padded_causal_mask(mb["attention_mask"][:, :n]))
        L = mask.shape[-1]
        return pad_stack(ids, length=L), pad_stack(poss, length=L), pad_stack_masks(masks, length=L)

    def probe(self):
        """Per-token logprob and entropy ``[rows, L-1, 2]`` of step 0's global batch (rank 0)."""
        import torch
        import torch.distributed as dist

        batch, mask, pos, _ = self.local(0)
        with torch.no_grad():
            if self.pipe is not None:
                out = self.pipe.forward(batch["input_ids"], n_microbatches=self.rows // MB_ROWS,
                                        output_fn=lambda lg, tg: torch.stack(self.logp_ent(lg, tg), -1),
                                        position_ids=pos, attention_mask=mask, targets=batch["input_ids"])
                mine = out if (self.pipe.has_last and self.mesh.tp_rank == 0) else None
            else:
                logits = self.model(input_ids=batch["input_ids"], position_ids=pos, attention_mask=mask,
                                    use_cache=False).logits
                out = torch.stack(self.logp_ent(logits, batch["input_ids"]), -1)  # collective over tp
                mine = out if self.mesh.tp_rank == 0 else None
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, (self.mesh.dp_rank, mine))
        got = sorted((d, t) for d, t in parts if t is not None)
        return torch.cat([t for _, t in got], dim=0) if dist.get_rank() == 0 else None


def run_variant(v: dict, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from areal_cli.engines.archon import clip

    s = Setup(v)
    res: dict = {"losses": [], "grad_norms": [], "probe_before": s.probe()}
    calls = [0]
    root = s.pipe.modules[0] if s.pipe else s.model
    first = next(m for m in root.model.layers if len(list(m.parameters())))
    # A pre-hook: checkpoint recompute stops early, once the last saved tensor is back, which is
    # before the mlp would return (a forward hook would not see the recompute).
    hook = first.mlp.register_forward_pre_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    for step in range(len(STEP_LENS)):
        res["losses"].append(s.train_step(step))
        if step == 0:
            hook.remove()
            res["mlp_calls"] = calls[0]  # activation checkpointing runs each layer twice
            res["grads"] = _gather_named(_named(s.model, s.pipe, s.tied), s.mesh, "grad")
        res["grad_norms"].append(clip.clip_grad_norm_(s.params, MAX_NORM, pp_group=s.mesh.pp_group,
                                                      norm_parameters=s.norm_params))
        s.opt.step()
        s.opt.zero_grad(set_to_none=True)
    res["weights"] = _gather_named(_named(s.model, s.pipe, s.tied), s.mesh, "data")
    res["probe_after"] = s.probe()
    if s.pipe is not None:
        built = s.pipe.schedules_built
        again = s.probe()  # same shapes and mode as the last call: the schedule is reused
        res["schedules"] = (built, s.pipe.schedules_built)
        res["probe_again"] = again
    res["coords"] = _coords(s.mesh)
    if dist.get_rank() == 0:
        torch.save(res, Path(out_dir) / f"{v['name']}.pt")
    dist.barrier()


def run_errors(v: dict, out_dir: str) -> None:
    """Typed errors: a family without a TP plan, a bad schedule name, bad layer counts."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, MistralConfig

    from areal_cli.engines.archon import pipeline
    from areal_cli.engines.archon.mesh import ArchonDims
    from areal_cli.engines.archon.parallelize import parallelize
    from areal_cli.errors import ConfigError

    mesh = ArchonDims(tp=dist.get_world_size()).build("cpu")
    cfg = MistralConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)
    res = {}
    checks = {
        "no_plan": lambda: parallelize(AutoModelForCausalLM.from_config(cfg), mesh),
        "schedule": lambda: pipeline.schedule_class("ZeroBubble"),
        "layers": lambda: pipeline.split_layers(4, 2, [3, 2]),
        "world": lambda: ArchonDims(dp=3).build("cpu"),
        "dims": lambda: ArchonDims(tp=0),
    }
    for name, fn in checks.items():
        try:
            fn()
            res[name] = None
        except ConfigError as e:
            res[name] = (type(e).__name__, str(e))
    if dist.get_rank() == 0:
        torch.save(res, Path(out_dir) / f"{v['name']}.pt")
    dist.barrier()


def _coords(mesh) -> list:
    import torch.distributed as dist

    me = {"rank": dist.get_rank(), "pp": mesh.pp_rank, "dp": mesh.dp_rank, "cp": mesh.cp_rank,
          "tp": mesh.tp_rank, "head": mesh.is_dp_head, "head_rank": mesh.dp_head_rank,
          "tp_ranks": mesh.ranks("tp"), "fsdp_ranks": mesh.ranks("dp_cp")}
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, me)
    return out


def run_vocab(v: dict, out_dir: str) -> None:
    """Vocab-parallel logprobs/entropy and their gradients vs the full vocabulary (even and uneven
    vocab slices)."""
    import torch
    import torch.distributed as dist

    from areal_cli.engines.archon.vocab_parallel import full_logprobs_entropy, logprobs_entropy, vocab_range

    res = {}
    for vocab in (256, 251):
        g = torch.Generator().manual_seed(vocab)
        full = torch.randn(3, 10, vocab, generator=g) * 3
        tgt = torch.randint(0, vocab, (3, 10), generator=g)
        w_lp, w_ent = torch.randn(3, 10, generator=g), torch.randn(3, 10, generator=g)
        ref = full.clone().requires_grad_(True)
        lp_r, ent_r = full_logprobs_entropy(ref, tgt, TEMPERATURE)
        ((lp_r * w_lp).sum() + (ent_r * w_ent).sum()).backward()
        start, end = vocab_range(vocab, dist.group.WORLD)
        local = full[..., start:end].clone().requires_grad_(True)
        lp, ent = logprobs_entropy(local, tgt, TEMPERATURE, group=dist.group.WORLD, vocab_size=vocab)
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, local.grad)
        res[vocab] = {"lp": (lp - lp_r).abs().max().item(), "ent": (ent - ent_r).abs().max().item(),
                      "grad": (torch.cat(parts, dim=-1) - ref.grad).abs().max().item(),
                      "grad_scale": ref.grad.abs().max().item()}
    if dist.get_rank() == 0:
        torch.save(res, Path(out_dir) / f"{v['name']}.pt")
    dist.barrier()


def main() -> None:
    import torch

    torch.set_num_threads(1)
    spec = json.loads(sys.argv[1])
    # A collective that never completes would hang the test until its global timeout: dump every
    # thread's stack and exit instead, so the failure shows where.
    faulthandler.dump_traceback_later(float(spec.get("hang_s", 240)), exit=True)
    sys.path.insert(0, str(Path(__file__).parent))
    from areal_cli.utils.dist import init_distributed

    init_distributed("gloo")
    for v in spec["variants"]:
        {"vocab": run_vocab, "errors": run_errors}.get(v.get("kind"), run_variant)(v, spec["out"])


if __name__ == "__main__":
    from areal_cli.utils.dist import exit_after

    exit_after(main)
