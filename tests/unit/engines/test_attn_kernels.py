"""engine.attn_impl's kernels behind the HF-module engines' attention function (engines/ulysses.py,
engines/attn_kernels.py): sdpa and eager agree on every layout the engines build, the flash-attn plumbing
(sequence boundaries, grouped kv heads, padding) matches sdpa with a reference kernel in flash-attn's place,
the per-forward layout is built once on the model's device, and what cannot run is refused by name."""

from __future__ import annotations

import pytest
import torch

from areal_cli.engines import attn_impl, attn_kernels, packing, ulysses
from areal_cli.errors import ConfigError

LENS = [5, 1, 9, 3]
AM = torch.tensor([[1] * 7 + [0] * 3, [1] * 10, [1] * 2 + [0] * 8]).bool()  # right-padded rows
MOD = torch.nn.Module()  # the attention module the function is handed; its model's context rides on it


@pytest.fixture(autouse=True)
def _clean_state():
    yield
    ulysses.set_varlen(MOD, None)
    ulysses.set_ulysses_group(MOD, None)


def _qkv(t: int, dtype=torch.float64, heads: int = 4, kv: int = 2, b: int = 1):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(b, n, t, 8, generator=g, dtype=dtype).requires_grad_() for n in (heads, kv, kv)]


def _attend(impl: str, q, k, v, mask=None) -> torch.Tensor:
    out, _ = ulysses.ATTN_FUNCTIONS[impl](MOD, q, k, v, mask, scaling=0.3)
    return out  # [B, L, H, D]


def _seg_ids(lens_groups: list[list[int]]) -> tuple[list[int], torch.Tensor]:
    """Shared-prefix segments: each group a prefix (segment 0) then suffixes 1..k."""
    seg, seg_lens = [], []
    for g in lens_groups:
        ids = [i for i, n in enumerate(g) for _ in range(n)]
        seg += ids
        seg_lens.append(len(ids))
    return seg_lens, torch.tensor(seg)


def _layouts():
    """(name, set up the forward's layout, mask argument) for each path the engines take."""
    sid = torch.cat([torch.full((n,), i) for i, n in enumerate(LENS)] + [len(LENS) + torch.arange(3)])
    seg_lens, seg = _seg_ids([[4, 3, 2], [2, 5]])
    return [
        ("varlen", lambda: ulysses.set_varlen(MOD, LENS), None, 1, sum(LENS) + 3),
        ("block_mask", lambda: ulysses.set_varlen(MOD, None), packing.packed_causal_mask(sid[None]), 1, sid.numel()),
        ("shared", lambda: ulysses.set_varlen(MOD, seg_lens, seg), None, 1, sum(seg_lens)),
        ("padded", lambda: ulysses.set_varlen(MOD, None), packing.padded_causal_mask(AM), 3, 10),
    ]


@pytest.mark.parametrize("layout", _layouts(), ids=lambda x: x[0])
def test_eager_equals_sdpa_on_every_engine_layout(layout):
    """Outputs and gradients of q, k and v, grouped kv heads repeated by the attention function."""
    _, setup, mask, b, t = layout
    outs, grads = {}, {}
    for impl in ("sdpa", "eager"):
        q, k, v = _qkv(t, b=b)
        setup()
        out = _attend(impl, q, k, v, mask)
        outs[impl] = out
        grads[impl] = torch.autograd.grad((out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum(), (q, k, v))
    torch.testing.assert_close(outs["eager"], outs["sdpa"])
    for a, b_ in zip(grads["eager"], grads["sdpa"]):
        torch.testing.assert_close(a, b_)


def test_eager_sees_the_mask():
    """The eager kernel is not causal-only: a mask that hides more changes its output the way it changes sdpa's."""
    q, k, v = _qkv(6)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    diag = torch.eye(6, dtype=torch.bool)
    for mask in (causal, diag):
        torch.testing.assert_close(attn_kernels.eager(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                      mask, False, 0.3),
                                   attn_kernels.sdpa(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                     mask, False, 0.3))
    assert not torch.allclose(attn_kernels.eager(q, q, q, causal, False, 0.3), attn_kernels.eager(q, q, q, diag, False, 0.3))


def _reference_flash(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=False):
    """flash_attn_varlen_func's contract, computed per segment with sdpa in fp32: ``[total, H, D]`` with grouped
    kv heads, causal within each ``cu_seqlens`` segment."""
    assert q.dtype in (torch.bfloat16, torch.float16) and cu_q.dtype == torch.int32 and causal
    assert torch.equal(cu_q, cu_k) and max_q == int((cu_q[1:] - cu_q[:-1]).max())
    out = torch.empty_like(q)
    rep = q.shape[1] // k.shape[1]
    for s, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        qs, ks, vs = (x[s:e].transpose(0, 1).float() for x in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0),
                                                             is_causal=True, scale=softmax_scale)
        out[s:e] = o.transpose(0, 1).to(q.dtype)
    return out


@pytest.mark.parametrize("layout", [x for x in _layouts() if x[0] != "shared"], ids=lambda x: x[0])
def test_flash_plumbing_matches_sdpa(layout, monkeypatch):
    """The flash path with flash-attn's varlen contract in its place (CPU has no flash-attn): sequence
    boundaries from the lengths or read off the engine's masks, grouped kv heads, fp32 cast to bf16 and back."""
    monkeypatch.setattr(attn_kernels, "_flash_fn", lambda: _reference_flash)
    name, setup, mask, b, t = layout
    q, k, v = (x.detach().float() for x in _qkv(t, b=b))
    setup()
    ref = _attend("sdpa", q, k, v, mask)
    setup()
    out = _attend(attn_impl.FLASH, q, k, v, mask)
    assert out.dtype == torch.float32
    # padding queries of padded rows see other keys than under the mask; their outputs are dropped
    keep = AM if name == "padded" else torch.ones(b, t, dtype=torch.bool)
    torch.testing.assert_close(out[keep], ref[keep], atol=2e-2, rtol=2e-2)


def test_mask_segments_reads_sequence_boundaries():
    sid = torch.tensor([0, 0, 0, 1, 2, 2, 3, 4])  # two padding tokens (3, 4) stand alone
    cu, longest = attn_kernels.mask_segments(packing.packed_causal_mask(sid[None]))
    assert cu.tolist() == [0, 3, 4, 6, 7, 8] and cu.dtype == torch.int32 and longest == 3
    am = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]).bool()
    cu, longest = attn_kernels.mask_segments(packing.padded_causal_mask(am))
    assert cu.tolist() == [0, 4, 8] and longest == 4  # the first padding token joins its row


def test_flash_refuses_the_shared_prefix_mask(monkeypatch):
    monkeypatch.setattr(attn_kernels, "_flash_fn", lambda: _reference_flash)
    seg_lens, seg = _seg_ids([[4, 3, 2]])
    ulysses.set_varlen(MOD, seg_lens, seg)
    q, k, v = _qkv(sum(seg_lens), dtype=torch.float32)
    with pytest.raises(ValueError, match="shared-prefix"):
        _attend(attn_impl.FLASH, q, k, v)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_layout_is_built_once_on_the_model_device(impl, monkeypatch):
    """The shared-prefix mask (and eager's causal mask) is made on the device the forward runs on when the
    engine sets the layout, and every layer's kernel receives that same tensor: no per-layer copy. The
    "device" is ``meta``, so a copy from the host would show up as a new tensor."""
    seen = []
    real = attn_kernels.KERNELS[impl]

    def spy(q, k, v, mask, *a, **kw):
        seen.append(mask)
        return real(q, k, v, mask, *a, **kw)

    monkeypatch.setitem(attn_kernels.KERNELS, impl, spy)
    seg_lens, seg = _seg_ids([[4, 3, 2], [2, 5]])
    for lens, seg_ids in ((seg_lens, seg), (LENS, None)):
        seen.clear()
        ulysses.set_varlen(MOD, lens, seg_ids, device="meta")
        idx = ulysses.context(MOD).varlen
        assert {idx[k].device.type for k in ("gather", "valid", "cu")} == {"meta"}
        q, k, v = _qkv(sum(lens), dtype=torch.float32)
        for _ in range(3):  # three layers
            out = _attend(impl, q.detach().to("meta"), k.detach().to("meta"), v.detach().to("meta"))
            assert out.device.type == "meta"
        if seg_ids is None and impl == "sdpa":
            assert seen == [None] * 3  # sdpa's is_causal: no mask at all
            continue
        assert len(seen) == 3 and seen[0].device.type == "meta"
        assert all(m is seen[0] for m in seen)
        if seg_ids is not None:
            assert seen[0] is idx["mask"]


def test_register_names_and_refusals(monkeypatch):
    assert ulysses.register("sdpa", "cpu") == "areal_ulysses_sdpa"
    assert ulysses.register("eager", torch.device("cpu")) == "areal_ulysses_eager"
    with pytest.raises(ConfigError) as e:
        ulysses.register("flash_attention_2", "cpu")
    assert e.value.path == "engine.attn_impl" and "CUDA" in e.value.reason
    with pytest.raises(ConfigError) as e:
        ulysses.register("flash", "cpu")
    assert e.value.path == "engine.attn_impl" and "unknown value 'flash'" in e.value.reason
    monkeypatch.setattr(attn_impl, "flash_attn_installed", lambda: False)
    with pytest.raises(ConfigError, match="flash_attn package"):
        ulysses.register("flash_attention_2", "cuda")
    monkeypatch.setattr(attn_impl, "flash_attn_installed", lambda: True)
    # on the package's word it is installed, but it does not import: told as such, with the fix
    with pytest.raises(ConfigError, match="does not import"):
        ulysses.register("flash_attention_2", "cuda")


def test_megatron_flash_needs_transformer_engine(monkeypatch):
    monkeypatch.setattr(attn_impl, "flash_attn_installed", lambda: True)
    monkeypatch.setattr(attn_impl, "transformer_engine_installed", lambda: False)
    assert attn_impl.refusal("flash_attention_2", "fsdp", "cuda") is None
    err = attn_impl.refusal("flash_attention_2", "megatron", "cuda")
    assert err is not None and "TransformerEngine" in err.reason and "engine.attn_impl" in str(err)
    monkeypatch.setattr(attn_impl, "transformer_engine_installed", lambda: True)
    assert attn_impl.refusal("flash_attention_2", "megatron", "cuda") is None
    assert "bf16" in attn_impl.refusal("flash_attention_2", "megatron", "cuda", bf16_compute=False).reason
    assert attn_impl.refusal("flash_attention_2", "fsdp", "cuda", bf16_compute=False) is None  # cast around it
    for impl in ("sdpa", "eager"):
        assert attn_impl.refusal(impl, "megatron", "cpu") is None


def test_each_model_has_its_own_attention_context():
    """Two engines in one process (an actor and its reference, say) keep their own layout: a layout set on
    one model never reaches the other's attention, and a model nobody set a layout on attends densely."""
    a, b = torch.nn.Sequential(torch.nn.Module()), torch.nn.Sequential(torch.nn.Module())
    ulysses.set_varlen(a, LENS)
    t = sum(LENS)
    q, k, v = _qkv(t)
    causal = torch.ones(t, t, dtype=torch.bool).tril()[None, None]
    dense_a, _ = ulysses.ATTN_FUNCTIONS["sdpa"](a[0], q, k, v, None, scaling=0.3)
    dense_b, _ = ulysses.ATTN_FUNCTIONS["sdpa"](b[0], q, k, v, None, scaling=0.3)
    full, _ = ulysses.ATTN_FUNCTIONS["sdpa"](None, q, k, v, causal, scaling=0.3)
    torch.testing.assert_close(dense_b, full)  # b: one causal sequence
    assert not torch.allclose(dense_a, full)  # a: per-sequence attention over LENS
    assert ulysses.context(a) is a[0].__dict__[ulysses.CTX_ATTR] and ulysses.context(b).varlen is None
    assert ulysses.context(a) is not ulysses.context(b)
