"""HFCheckpoint's partial reads against the tensors safetensors itself loads: row ranges, chunks along any
dim, flat ranges (a ZeRO-3 partition), a tied head, and a critic's value head replacing the LM head."""

import pytest
import torch
from safetensors.torch import save_file

from areal_cli.weight_sync.hf_io import HFCheckpoint


@pytest.fixture()
def ckpt_dir(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": torch.randn(7, 5, generator=g),
               "lm_head.weight": torch.randn(7, 5, generator=g),
               "model.norm.weight": torch.randn(5, generator=g),
               "model.layers.0.mlp.w": torch.randn(3, 4, 6, generator=g).to(torch.bfloat16)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path, tensors


def test_partial_reads_equal_the_stored_tensors(ckpt_dir):
    path, ref = ckpt_dir
    ck = HFCheckpoint(path)
    for name, t in ref.items():
        assert torch.equal(ck.get(name), t)
        assert ck.dtype(name) == t.dtype and ck.shape(name) == list(t.shape)
        flat = t.reshape(-1)
        for lo, hi in [(0, flat.numel()), (3, 11), (5, 6), (flat.numel() - 4, flat.numel()), (2, 2)]:
            assert torch.equal(ck.get_flat(name, lo, hi), flat[lo:hi]), (name, lo, hi)
        for dim in range(t.dim()):
            for parts in (1, 2, 3):
                for i in range(parts):
                    want = torch.chunk(t, parts, dim)
                    if i < len(want):
                        assert torch.equal(ck.get_chunk(name, dim, i, parts), want[i]), (name, dim, parts, i)


def test_tied_head_and_critic_head(ckpt_dir, tmp_path_factory):
    path, ref = ckpt_dir
    tied = tmp_path_factory.mktemp("tied")
    save_file({k: v for k, v in ref.items() if k != "lm_head.weight"}, str(tied / "model.safetensors"))
    assert "lm_head.weight" not in HFCheckpoint(tied)
    assert torch.equal(HFCheckpoint(tied, tied_head=True).get("lm_head.weight"), ref["model.embed_tokens.weight"])
    # an untied LM's own head goes, the value head file comes in under lm_head.*
    ck = HFCheckpoint(path)
    ck.drop("lm_head.")
    assert "lm_head.weight" not in ck and "model.embed_tokens.weight" in ck
    head = {"weight": torch.randn(1, 5), "bias": torch.randn(1)}
    save_file(head, str(path / "value_head.safetensors"))
    ck.add_file(path / "value_head.safetensors", prefix="lm_head.")
    ck.add_file(path / "absent.safetensors", prefix="x.")  # a missing file adds nothing
    assert torch.equal(ck.get("lm_head.weight"), head["weight"]) and torch.equal(ck.get("lm_head.bias"), head["bias"])
    assert not any(n.startswith("x.") for n in ck.names())
