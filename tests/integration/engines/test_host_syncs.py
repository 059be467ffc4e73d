"""No host read of a computed value per micro-batch in the training step (one CPU process, tiny Qwen2).

On a GPU, ``float(t)``/``t.item()``/``t.cpu()`` of a value the model computed waits for the stream; once
per micro-batch it serialises the step. On CPU nothing waits, so the test counts those reads instead:
a torch function mode marks every tensor computed from something that requires grad (the model's
outputs, the loss, stats derived from them; not the host batch, its lengths or the loss weights) and
counts the host reads of marked tensors during ``train_batch``. The count must not grow with the number
of micro-batches. Also: AdamW and grad clipping with ``foreach=True`` on FSDP2's DTensor parameters give
the same update as the per-parameter loop.
"""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

pytestmark = pytest.mark.slow

_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__float__, torch.Tensor.__int__,
          torch.Tensor.__bool__, torch.Tensor.numpy, torch.Tensor.cpu}


class HostReads(TorchFunctionMode):
    """Counts host reads (``item``/``tolist``/``float``/``int``/``bool``/``numpy``/``cpu``/``to(cpu)``) of
    tensors computed from a tensor that requires grad."""

    def __init__(self):
        super().__init__()
        self.marked = WeakIdKeyDictionary()  # by identity: Tensor.__eq__ is elementwise
        self.reads: list[str] = []

    def _is_marked(self, t) -> bool:
        return isinstance(t, torch.Tensor) and (t.requires_grad or t in self.marked)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = list(args) + list(kwargs.values())
        flat += [x for a in flat if isinstance(a, (list, tuple)) for x in a]
        src = any(self._is_marked(a) for a in flat)
        to_host = func is torch.Tensor.to and any(str(a) == "cpu" for a in flat[1:])
        if src and (func in _READS or to_host):
            self.reads.append(getattr(func, "__name__", str(func)))
        out = func(*args, **kwargs)
        if src:
            for o in out if isinstance(out, (list, tuple)) else (out,):
                if isinstance(o, torch.Tensor):
                    self.marked[o] = True
        return out


def _engine(model_dir, max_tokens):
    from areal_cli.api.io_struct import ParallelStrategy
    from areal_cli.config.algo import OptimConfig
    from areal_cli.config.engine import EngineConfig
    from areal_cli.engines.fsdp import FSDPEngine

    e = FSDPEngine(EngineConfig(max_tokens_per_mb=max_tokens), OptimConfig(lr=1e-3), total_steps=10)
    e.initialize(ParallelStrategy(), model_dir)
    return e


def _batch(B=8, L=12, P=4):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 200, (B, L), generator=g)
    am = torch.ones(B, L, dtype=torch.bool)
    for r in range(B):  # ragged rows: packing has work to do
        am[r, L - r % 3:] = False
    mask = torch.zeros(B, L)
    mask[:, P:] = 1
    return {"input_ids": ids, "attention_mask": am, "loss_mask": mask * am}


def _loss(out, mb):
    lp = out["logprobs"]
    m = mb["loss_mask"]
    loss = -(lp * m).sum() / m.sum().clamp(min=1)
    return loss, {"entropy": (out["entropy"] * m).sum() / m.sum().clamp(min=1), "n_tok": m.sum()}


def _reads(engine, batch) -> tuple[list[str], dict]:
    mode = HostReads()
    with mode:
        stats = engine.train_batch(batch, _loss, lambda mb: float(mb["loss_mask"].sum()))
    return mode.reads, stats


def test_host_reads_do_not_grow_with_micro_batches(tiny_model_dir):
    batch = _batch()
    one = _engine(tiny_model_dir, 10_000)
    many = _engine(tiny_model_dir, 1)  # every row its own micro-batch
    _reads(one, batch), _reads(many, batch)  # lazy init (FSDP, optimizer state) out of the count
    r1, s1 = _reads(one, batch)
    r8, s8 = _reads(many, batch)
    assert s1["n_micro_batches"] == 1 and s8["n_micro_batches"] == 8
    assert r1, "the counter sees the step's own reads (grad norm, stats), or it counts nothing"
    assert len(r8) == len(r1), (r1, r8)
    assert s8["loss"] == pytest.approx(s1["loss"], abs=1e-5)


def test_foreach_adamw_and_clip_on_dtensor_parameters(tmp_path):
    """FSDP2 parameters are DTensors (Shard(0)), TP ones may be Replicate: the foreach AdamW and clip paths
    run on them and update them exactly as the per-parameter loop does (CPU: the foreach ops loop over
    tensors, same arithmetic)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    from areal_cli.engines.archon import clip
    from areal_cli.utils.optim import foreach_ok

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    fully_shard(model[0], mesh=mesh)
    model[2].weight = torch.nn.Parameter(distribute_tensor(model[2].weight.detach(), mesh, [Replicate()]))
    model[2].bias = torch.nn.Parameter(distribute_tensor(model[2].bias.detach(), mesh, [Replicate()]))
    params = list(model.parameters())
    assert all(isinstance(p, DTensor) for p in params)
    assert foreach_ok(params) and foreach_ok([torch.zeros(2)])
    assert not foreach_ok(params + [torch.zeros(2)])  # mixed: DTensor's dispatch refuses the one list
    grads = [distribute_tensor(torch.randn(p.shape), mesh, p.placements) for p in params]
    start = [p.detach().clone() for p in params]
    out = {}
    for foreach in (False, True):
        with torch.no_grad():
            for p, g, s in zip(params, grads, start):
                p.copy_(s)
                p.grad = g.clone()
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=foreach)
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm=0.5, foreach=foreach)
        opt.step()
        out[foreach] = (float(norm.full_tensor()), [p.detach().full_tensor().clone() for p in params])
        with torch.no_grad():  # archon's per-mesh clip (foreach inside) on the same DTensor gradients
            for p, g in zip(params, grads):
                p.grad = g.clone()
        total = clip.clip_grad_norm_(params, 0.5)
        assert total == pytest.approx(out[foreach][0], rel=1e-6) and total > 0.5  # it does clip
        ref = [g.full_tensor() * (0.5 / (total + 1e-6)) for g in grads]
        assert all(torch.equal(p.grad.full_tensor(), r) for p, r in zip(params, ref))
    assert out[False][0] == out[True][0]
    assert all(torch.equal(a, b) for a, b in zip(out[False][1], out[True][1]))
    assert not torch.equal(out[True][1][0], start[0].full_tensor())  # the step moved the weights
