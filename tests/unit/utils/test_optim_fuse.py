"""utils/optim.fuse_adam: an AdamW built with torch's per-parameter loop (megatron-core's on a host without
TransformerEngine or apex) switches to the fused kernel and steps to the same values."""

from __future__ import annotations

import types

import torch

from areal_cli.utils.optim import fuse_adam


def _params(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(5, 3, generator=g)), torch.nn.Parameter(torch.randn(7, generator=g))]


def _steps(opt, params, n: int = 3):
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return [p.detach().clone() for p in params]


def test_switches_wrapped_optimizers_and_matches_the_loop():
    ref_p, fused_p = _params(), _params()
    ref = torch.optim.AdamW(ref_p, lr=1e-2, weight_decay=0.1, foreach=False)
    inner = torch.optim.AdamW(fused_p, lr=1e-2, weight_decay=0.1, foreach=False)
    chained = types.SimpleNamespace(chained_optimizers=[types.SimpleNamespace(optimizer=inner)])
    assert fuse_adam(chained) == 1
    assert all(g["fused"] and not g["foreach"] for g in inner.param_groups)
    for a, b in zip(_steps(ref, ref_p), _steps(inner, fused_p)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_leaves_stepped_and_other_optimizers():
    params = _params()
    sgd = torch.optim.SGD(params, lr=0.1)
    stepped = torch.optim.AdamW(_params(), lr=1e-2, foreach=False)
    _steps(stepped, stepped.param_groups[0]["params"], n=1)
    assert fuse_adam(sgd) == 0 and fuse_adam(stepped) == 0
    assert not stepped.param_groups[0]["fused"]
