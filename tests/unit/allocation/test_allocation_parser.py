"""Table-driven tests of the allocation_mode language: accepted specs and golden errors."""

from __future__ import annotations

import pytest

from areal_cli.allocation import parse_allocation
from areal_cli.errors import ConfigError

# spec -> [(kind, backend, name, {dim: size}, world_size)] ; dims not listed are 1.
ACCEPTED = [
    ("sglang.d4+megatron.d2t2p2", [("inference", "sglang", None, {"d": 4}, 4),
                                   ("train", "megatron", None, {"d": 2, "t": 2, "p": 2}, 8)]),
    ("sglang:d4+megatron:d2t2p2", [("inference", "sglang", None, {"d": 4}, 4),
                                   ("train", "megatron", None, {"d": 2, "t": 2, "p": 2}, 8)]),
    ("hf:d1+fsdp:d1", [("inference", "hf", None, {}, 1), ("train", "fsdp", None, {}, 1)]),
    ("hf.d2+fsdp.d2", [("inference", "hf", None, {"d": 2}, 2), ("train", "fsdp", None, {"d": 2}, 2)]),
    ("vllm:d2t2|fsdp:d4", [("inference", "vllm", None, {"d": 2, "t": 2}, 4),
                           ("train", "fsdp", None, {"d": 4}, 4)]),
    ("sglang.d4+d2t2p2", [("inference", "sglang", None, {"d": 4}, 4),
                          ("train", None, None, {"d": 2, "t": 2, "p": 2}, 8)]),
    ("d4", [("train", None, None, {"d": 4}, 4)]),
    ("fsdp:d8", [("train", "fsdp", None, {"d": 8}, 8)]),
    ("megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)",
     [("train", "megatron", None, {"d": 4, "p": 2, "t": 2, "c": 2}, 32)]),
    ("sglang:d4t4+megatron:(attn:d2t4p2|ffn:d1t1p2e8)",
     [("inference", "sglang", None, {"d": 4, "t": 4}, 16), ("train", "megatron", None,
                                                             {"d": 2, "t": 4, "p": 2}, 16)]),
    ("sglang[gen]:d2+fsdp[actor]:d2+fsdp[critic]:d2",
     [("inference", "sglang", "gen", {"d": 2}, 2), ("train", "fsdp", "actor", {"d": 2}, 2),
      ("train", "fsdp", "critic", {"d": 2}, 2)]),
    ("vllm:d4t2|fsdp:d8", [("inference", "vllm", None, {"d": 4, "t": 2}, 8),
                           ("train", "fsdp", None, {"d": 8}, 8)]),
    ("sglang:d1t8+archon:d2t2p2c2", [("inference", "sglang", None, {"t": 8}, 8),
                                      ("train", "archon", None, {"d": 2, "t": 2, "p": 2, "c": 2}, 16)]),
    ("vllm:p2t2+deepspeed:d4c2", [("inference", "vllm", None, {"p": 2, "t": 2}, 4),
                                  ("train", "deepspeed", None, {"d": 4, "c": 2}, 8)]),
    ("sglang:d2e4t4+megatron:d8e4", [("inference", "sglang", None, {"d": 2, "e": 4, "t": 4}, 8),
                                      ("train", "megatron", None, {"d": 8, "e": 4}, 8)]),
    ("archon:d2t2c2", [("train", "archon", None, {"d": 2, "t": 2, "c": 2}, 8)]),
    ("  sglang:d2+fsdp:d2  ", [("inference", "sglang", None, {"d": 2}, 2),
                               ("train", "fsdp", None, {"d": 2}, 2)]),
    ("hf:d1|fsdp:d1", [("inference", "hf", None, {}, 1), ("train", "fsdp", None, {}, 1)]),
    ("sglang[rollout_1]:d2+megatron[actor-a]:t2", [("inference", "sglang", "rollout_1", {"d": 2}, 2),
                                                   ("train", "megatron", "actor-a", {"t": 2}, 2)]),
    ("vllm.d16+megatron.d4t4p2", [("inference", "vllm", None, {"d": 16}, 16),
                                  ("train", "megatron", None, {"d": 4, "t": 4, "p": 2}, 32)]),
    ("sglang:d4+(attn:d2t2|ffn:d1t2e2)", [("inference", "sglang", None, {"d": 4}, 4),
                                          ("train", None, None, {"d": 2, "t": 2}, 4)]),
    ("t2p2d2", [("train", None, None, {"t": 2, "p": 2, "d": 2}, 8)]),
    ("sglang:d1+fsdp[actor]:d1|fsdp[ref]:d1", [("inference", "sglang", None, {}, 1),
                                               ("train", "fsdp", "actor", {}, 1),
                                               ("train", "fsdp", "ref", {}, 1)]),
    ("megatron:d1t8p4c2", [("train", "megatron", None, {"t": 8, "p": 4, "c": 2}, 64)]),
    ("sglang:d64+megatron:d16t8", [("inference", "sglang", None, {"d": 64}, 64),
                                   ("train", "megatron", None, {"d": 16, "t": 8}, 128)]),
    ("hf:d3+fsdp:d3", [("inference", "hf", None, {"d": 3}, 3), ("train", "fsdp", None, {"d": 3}, 3)]),
    ("vllm[a]:d1+vllm[b]:d1t2+fsdp:d2", [("inference", "vllm", "a", {}, 1),
                                          ("inference", "vllm", "b", {"t": 2}, 2),
                                          ("train", "fsdp", None, {"d": 2}, 2)]),
]


@pytest.mark.parametrize("spec,expected", ACCEPTED, ids=[a[0].strip() for a in ACCEPTED])
def test_accepted(spec, expected):
    parsed = parse_allocation(spec)
    got = [(c.kind, c.backend, c.name, {k: c.dims.get(k) for k in "dtpce" if c.dims.get(k) != 1},
            c.world_size) for c in parsed.components]
    assert got == expected
    # canonical form re-parses to the same components
    again = parse_allocation(parsed.canonical())
    assert [(c.kind, c.backend, c.name, c.dims_text(), c.world_size) for c in again.components] == \
        [(c.kind, c.backend, c.name, c.dims_text(), c.world_size) for c in parsed.components]


def test_accepted_count():
    assert len(ACCEPTED) >= 25


def test_hybrid_details():
    c = parse_allocation("megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)").components[0]
    assert c.hybrid and c.ffn is not None
    assert (c.ffn.d, c.ffn.p, c.ffn.t, c.ffn.e) == (2, 2, 4, 2)
    par = c.parallel()
    assert (par.dp, par.tp, par.pp, par.cp, par.ep, par.world_size) == (4, 2, 2, 2, 2, 32)


def test_colocation_groups_and_train_backend():
    s = parse_allocation("vllm[gen]:d2t2|fsdp:d4+hf[eval]:d1")
    assert s.groups == [[0, 1], [2]]
    assert s.colocated and s.train_backend == "fsdp"
    assert parse_allocation("sglang.d4+d2t2p2").train_backend is None


# (spec, caret column, golden one-line message)
REJECTED = [
    ('', 0, 'allocation_mode.spec: the allocation spec is empty — fix: set allocation_mode=local_cpu or a spec such as sglang:d4+fsdp:d4'),
    ('   ', 0, 'allocation_mode.spec: the allocation spec is empty — fix: set allocation_mode=local_cpu or a spec such as sglang:d4+fsdp:d4'),
    ('sglng.d4+fsdp:d4', 0, "allocation_mode.spec: unknown backend 'sglng' — fix: did you mean 'sglang'? inference backends: sglang, vllm, hf; train backends: fsdp, megatron, archon, deepspeed"),
    ('sglang.d4+', 10, "allocation_mode.spec: spec ends after '+' — fix: add a component after it or remove the trailing '+'"),
    ('sglang.x4+fsdp:d2', 7, "allocation_mode.spec: unknown dimension 'x' — fix: dims are d (data), t (tensor), p (pipeline), c (context), e (expert)"),
    ('fsdp:d2p2', 7, 'allocation_mode.spec: fsdp does not support pipeline parallelism (p2) — fix: drop p2 or pick a backend that supports pipeline parallelism (megatron, archon)'),
    ('hf:d1+fsdp:d1t2', 13, 'allocation_mode.spec: fsdp does not support tensor parallelism (t2) — fix: drop t2 or pick a backend that supports tensor parallelism (megatron, archon)'),
    ('hf:t2+fsdp:d1', 3, 'allocation_mode.spec: hf does not support tensor parallelism (t2) — fix: the built-in hf server runs one process per instance: use only d, e.g. hf:d2'),
    ('sglang:d4|vllm:d4', 0, 'allocation_mode.spec: 2 inference components need names to tell them apart — fix: name each one, e.g. sglang[gen]:d4'),
    ('vllm:d2t2|fsdp:d2', 10, "allocation_mode.spec: colocated components need the same number of devices: 'vllm' uses 4, 'fsdp' uses 2 — fix: make the products of their dims equal, e.g. vllm:d2t2|fsdp:d4"),
    ('sglang:d4 + fsdp:d4', 9, "allocation_mode.spec: unexpected ' ' at column 9 — fix: spaces are not allowed inside a spec"),
    ('fsdp[a:d2', 6, "allocation_mode.spec: unexpected ':' at column 6 in a component name — fix: names use letters, digits, '_' and '-'"),
    ('sglang:d0+fsdp:d1', 8, "allocation_mode.spec: dimension 'd' must be at least 1, got 0 — fix: use d1 or drop it"),
    ('d', 0, "allocation_mode.spec: dimension 'd' has no size — fix: write e.g. d2"),
    ('fsdp:d2d2', 7, "allocation_mode.spec: dimension 'd' given twice — fix: write d once"),
    ('+', 0, "allocation_mode.spec: unexpected '+' at column 0, expected a component — fix: a component is backend:dims or bare dims, e.g. sglang:d4+fsdp:d4 or d4t2"),
    ('fsdp.(attn:d2|ffn:d2)', 5, "allocation_mode.spec: the hybrid MoE form (attn:…|ffn:…) is only supported by megatron, not 'fsdp' — fix: use megatron:(attn:d4p2t2c2|ffn:d2p2t4e2) or plain dims"),
    ('megatron:(attn:d2e2|ffn:d2)', 17, 'allocation_mode.spec: the attn part of the hybrid form cannot use e — fix: put expert parallelism in the ffn part'),
    ('megatron:(attn:d2|ffn:d2', 9, "allocation_mode.spec: unclosed '(' in the hybrid MoE form — fix: close it with ')'"),
    ('megatron:(foo:d2|ffn:d2)', 10, "allocation_mode.spec: expected 'attn:' in the hybrid MoE form, found 'foo' — fix: write (attn:d4p2t2c2|ffn:d2p2t4e2)"),
    ('fsdp[]:d2', 4, "allocation_mode.spec: empty component name '[]' — fix: write a name such as fsdp[actor]:d4 or drop the brackets"),
    ('fsdp[x]d2', 7, "allocation_mode.spec: unexpected 'd' at column 7, expected '.' or ':' after the backend — fix: write fsdp[x]:d2"),
    ('Sglang:d2', 0, "allocation_mode.spec: unknown backend 'Sglang' — fix: did you mean 'sglang'? inference backends: sglang, vllm, hf; train backends: fsdp, megatron, archon, deepspeed"),
    ('fsdp:', 5, 'allocation_mode.spec: unexpected end of spec, expected dims such as d4 or d2t2p2 — fix: dims are letters d t p c e each followed by a size'),
    ('sglang:d4++fsdp:d2', 10, "allocation_mode.spec: unexpected '+' at column 10, expected a component — fix: a component is backend:dims or bare dims, e.g. sglang:d4+fsdp:d4 or d4t2"),
    ('fsdp[a]:d2+fsdp[a]:d2', 11, "allocation_mode.spec: duplicate component name 'a' — fix: give every component its own name"),
    ('sglang:d2+fsdp:d2+fsdp:d2', 10, 'allocation_mode.spec: 2 train components need names to tell them apart — fix: name each one, e.g. fsdp[actor]:d2'),
    ('sglang:d2+fsdp[a]:d2+megatron[b]:d2', 21, 'allocation_mode.spec: train components use different backends (fsdp, megatron) — fix: use one train backend for all train components'),
    ('sglang:c2+fsdp:d1', 7, 'allocation_mode.spec: sglang does not support context parallelism (c2) — fix: sglang supports d, t, p, e; drop c2'),
    ('megatron:(attn:d2|ffn:d2c2)', 24, 'allocation_mode.spec: the ffn part of the hybrid form cannot use c — fix: put context parallelism in the attn part'),
    ('deepspeed:t2', 10, 'allocation_mode.spec: deepspeed does not support tensor parallelism (t2) — fix: drop t2 or pick a backend that supports tensor parallelism (megatron, archon)'),
    ('fsdp:d999999', 6, "allocation_mode.spec: dimension 'd999999' is larger than 65536 — fix: use a realistic size"),
    ('sglang:d2;fsdp:d2', 9, "allocation_mode.spec: unexpected ';' at column 9 — fix: separate components with '+' (or '|' to colocate them)"),
    ('fsdp:e2', 5, 'allocation_mode.spec: fsdp does not support expert parallelism (e2) — fix: drop e2 or pick a backend that supports expert parallelism (megatron, archon)'),
]


@pytest.mark.parametrize("spec,column,message", REJECTED, ids=[r[0] or "<empty>" for r in REJECTED])
def test_rejected(spec, column, message):
    with pytest.raises(ConfigError) as info:
        parse_allocation(spec)
    err = info.value
    assert err.path == "allocation_mode.spec"
    assert err.one_line() == message
    assert err.column == column
    assert err.text == spec
    caret = err.caret_lines()
    assert caret[0] == f"  {spec}" and caret[1].index("^") == column + 2


def test_rejected_count():
    assert len(REJECTED) >= 20


def test_caret_points_at_bad_character():
    with pytest.raises(ConfigError) as info:
        parse_allocation("sglang:d4+fsdp:d2x2")
    err = info.value
    assert err.text[err.column] == "x"
