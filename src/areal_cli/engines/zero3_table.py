"""A ZeRO-3 model's tied table kept row-sharded outside ZeRO (``engine.tied_head`` for engine=deepspeed).

Why: ZeRO-3 treats the tied ``[V, H]`` table as any parameter. It gathers it whole for the embedding's
forward, again for the head, and again in the backward, whose dense gradient then goes through the
reduce-scatter of the bucket that holds it (flattened into a second copy first). On a Qwen2.5-0.5B shape
(152k x 896, 0.51 GiB in fp32) at d4 that put the steady step at 4.82 GiB per rank against a state bound
of 3.34 (``benchmarks/engine_memory.py --peak``, docs/training.md). Here the table leaves ZeRO's
partitioning: each rank of the d x c group keeps rows ``[start, start + V/n)`` as fsdp's row-sharded table
does (:mod:`.sharded_vocab`: tokens move, the table never does), with its own AdamW state for those rows.

What keeps it one optimizer with DeepSpeed's:

- the gradient: the row-sharded head gives each rank its rows' gradient summed over ranks; the engine's
  backward multiplies the loss by the world size (DeepSpeed averages), so the rows' gradient is divided by
  it here before anything reads it;
- the norm: DeepSpeed's ZeRO-3 optimizer combines per-group norms (``_get_norm_groups``); the table's global
  norm joins them, so the clipping coefficient, the reported ``grad_norm`` and the overflow check count it;
- the clip and the step: after DeepSpeed's step the rows' gradient takes the same coefficient
  (``unscale_and_clip_grads``'s formula) and a ``torch.optim.AdamW`` of the main optimizer's implementation
  and hyper-parameters (the schedule's lr read each step) steps them; a skipped DeepSpeed step skips it.

The rows and their moments go into the engine's per-rank checkpoint file; HF export and weight sync gather
the table parameter by parameter as fsdp's. Used under ZeRO-3 only: ZeRO-0/1/2 keep every weight whole by
design, and with ``offload_optimizer``/``offload_param`` the rows' state would stay on the device.
"""

from __future__ import annotations

from typing import Any

import torch

from areal_cli.engines import lora as lora_mod
from areal_cli.engines import sharded_vocab
from areal_cli.errors import ConfigError
from areal_cli.utils import collectives
from areal_cli.utils.optim import adamw_like, follow


def refusal(engine) -> str | None:
    """Why this deepspeed engine cannot keep the table row-sharded (``None``: it can)."""
    z = engine.cfg.deepspeed
    if int(z.zero_stage) != 3:
        return f"ZeRO-{z.zero_stage} keeps every weight whole on every rank"
    if z.offload_optimizer or z.offload_param:
        return "the table's rows and moments would stay on the device under engine.deepspeed.offload_*"
    if engine.critic:
        return "a critic's head is its value head"
    if lora_mod.enabled(engine.lora_cfg):
        return "under LoRA the table is frozen base weight"
    return None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class Zero3Table:
    """The tied table of ``model`` (built inside ``zero.Init``) taken out of ZeRO-3 and row-sharded over
    ``mesh``: ZeRO's parameter is dropped from the embedding and the head before anything is loaded into it,
    and both modules hold the rows as an attribute that ``named_parameters`` (hence ZeRO) does not see."""

    def __init__(self, model, mesh, dtype: torch.dtype, compute_dtype: torch.dtype | None,
                 device: torch.device, trainable: bool):
        from torch.distributed.tensor import DTensor, Shard

        emb, head = model.get_input_embeddings(), model.get_output_embeddings()
        self.name = next(n for n, p in model.named_parameters() if p is emb.weight)
        old = emb.weight
        self.shape = tuple(int(s) for s in getattr(old, "ds_shape", old.shape))
        for m in (emb, head):
            del m._parameters["weight"]
        del old  # its ZeRO partition goes with the last reference
        n, rank = mesh.size(), mesh.get_local_rank()
        self.start = sharded_vocab._row_start(self.shape[0], rank, n)
        self.stop = sharded_vocab._row_start(self.shape[0], rank + 1, n)
        local = torch.empty((self.stop - self.start, self.shape[1]), dtype=dtype, device=device)
        weight = torch.nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                                       shape=torch.Size(self.shape), stride=(self.shape[1], 1)),
                                    requires_grad=trainable)
        for m in (emb, head):
            object.__setattr__(m, "weight", weight)  # not registered: ZeRO-3 neither partitions nor gathers it
        self.table = sharded_vocab.route(model, sharded_vocab.ShardedTable(weight, compute_dtype))
        self.weight, self.group, self.world = weight, self.table.group, n
        self.norm: torch.Tensor | None = None
        self.opt: torch.optim.AdamW | None = None

    @property
    def rows(self) -> torch.Tensor:
        return _local(self.weight).detach()

    @torch.no_grad()
    def load(self, src, path: str) -> None:
        """This rank's rows from the model dir's reader ``src`` (only their bytes are read). Not collective."""
        if self.name not in src:
            raise ConfigError("model.path", f"{path} lacks {self.name}", "load an HF dir of this architecture")
        if tuple(src.shape(self.name)) != self.shape:
            raise ConfigError("model.path", f"{path}: {self.name} has shape {src.shape(self.name)}, the model's "
                              f"is {self.shape}", "load an HF dir of this architecture (an export of it)")
        self.rows.copy_(src.get_rows(self.name, self.start, self.stop).to(self.rows.dtype))

    def count_in(self, ds_optimizer) -> None:
        """Make DeepSpeed's norm groups include the table's norm (:meth:`prepare` computes it each step)."""
        groups = ds_optimizer._get_norm_groups

        def with_table():
            out = list(groups())
            if self.norm is not None:
                out.append(self.norm.to(out[0].device if out and torch.is_tensor(out[0]) else self.norm.device)
                           * ds_optimizer.loss_scale)
            return out

        ds_optimizer._get_norm_groups = with_table

    @torch.no_grad()
    def prepare(self) -> None:
        """Before DeepSpeed's step: the rows' gradient to the engine's sum (see the module doc) and its norm
        over every rank. Collective."""
        g = self.weight.grad
        sq = torch.zeros((), dtype=torch.float32, device=self.rows.device)
        if g is not None:
            local = _local(g)
            local.div_(self.world)
            sq = torch.linalg.vector_norm(local, dtype=torch.float32).square()
        self.norm = collectives.all_reduce(sq, group=self.group).sqrt()

    @torch.no_grad()
    def step(self, ds_optimizer, group: dict) -> None:
        """After DeepSpeed's step: the rows' clip and AdamW step with ``group``'s hyper-parameters (the main
        optimizer's), unless DeepSpeed skipped its step."""
        grad, self.weight.grad, self.norm = self.weight.grad, None, None
        if grad is None or getattr(ds_optimizer, "overflow", False):
            return
        g = _local(grad)
        clip = float(getattr(ds_optimizer, "clip_grad", 0.0))
        if clip > 0.0:  # DeepSpeed's unscale_and_clip_grads, on the norm it stashed (the table's included)
            norm = torch.as_tensor(ds_optimizer._global_grad_norm, dtype=torch.float32, device=g.device)
            g.mul_(1.0 / torch.clamp((norm + 1e-6) / clip, min=1.0))
        if self.opt is None:
            self.opt = adamw_like([self.rows], group)
        follow(self.opt, group)
        view = self.opt.param_groups[0]["params"][0]
        view.grad = g
        self.opt.step()
        view.grad = None

    # ---- checkpoints (the engine's per-rank file)
    def state_dict(self) -> dict[str, Any]:
        opt = None if self.opt is None else dict(self.opt.state[self.opt.param_groups[0]["params"][0]])
        return {"name": self.name, "rows": self.rows, "optim": opt}  # torch.save writes them at once

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any] | None, group: dict | None) -> None:
        if state is None or state.get("name") != self.name or tuple(state["rows"].shape) != tuple(self.rows.shape):
            raise ConfigError("recover.path", "the checkpoint holds no row-sharded table of this shape",
                              "resume with the engine.tied_head and d x c that wrote it, or start from its HF export")
        self.rows.copy_(state["rows"])
        self.opt = None
        if state["optim"] is not None and group is not None:
            self.opt = adamw_like([self.rows], group)
            self.opt.state[self.opt.param_groups[0]["params"][0]] = dict(state["optim"])
