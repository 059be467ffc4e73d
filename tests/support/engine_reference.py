"""How the engine layout tests compare a parallel run with the one-process reference.

Each worker run saves ``stats`` (per step: loss, grad_norm, ...), ``weights`` (the full tensors after the
steps) and ``logprobs`` (a forward before training). A layout matches when every step's loss is within
``TOL`` and grad norm within 1e-4, and the weights and the forward agree elementwise within ``TOL``.
"""

from __future__ import annotations

from typing import Callable

import torch

TOL = 1e-5


def untie(d: dict) -> dict:
    """A plain module lists a tied head under both names, a streamed export once: keep one, after checking
    the two are the same tensor."""
    if "lm_head.weight" in d and "model.embed_tokens.weight" in d:
        assert torch.equal(d.pop("lm_head.weight"), d["model.embed_tokens.weight"])
    return d


def diffs(a: dict, b: dict, names: Callable[[dict], dict] = untie) -> dict[str, float]:
    """Each tensor's largest elementwise difference between two name -> tensor dicts, after ``names`` maps
    both to one naming (e.g. the checkpoint's per-expert names); the names must be the same."""
    a, b = names(dict(a)), names(dict(b))
    assert a.keys() == b.keys(), set(a) ^ set(b)
    return {k: (a[k].float() - b[k].float()).abs().max().item() for k in a}


def max_diff(a: dict, b: dict, names: Callable[[dict], dict] = untie) -> float:
    return max(diffs(a, b, names).values())


def close(a: dict, b: dict, tol: float = TOL, names: Callable[[dict], dict] = untie) -> None:
    worst = max(diffs(a, b, names).items(), key=lambda kv: kv[1])
    assert worst[1] <= tol, f"{worst[0]}: max diff {worst[1]:.3g} > {tol}"


def assert_matches_reference(ref: dict, got: dict, names: Callable[[dict], dict] = untie) -> None:
    for s_ref, s_got in zip(ref["stats"], got["stats"], strict=True):
        assert abs(s_ref["loss"] - s_got["loss"]) <= TOL, (s_ref["loss"], s_got["loss"])
        assert abs(s_ref["grad_norm"] - s_got["grad_norm"]) <= 1e-4, (s_ref["grad_norm"], s_got["grad_norm"])
    close(ref["logprobs"], got["logprobs"], names=names)  # the forward (logprobs, entropy) before training
    close(ref["weights"], got["weights"], names=names)  # after the steps
