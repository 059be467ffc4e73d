"""engines/tied_embedding.py: a tied embedding's rows added into the head's gradient equal autograd's sum."""

from __future__ import annotations

import copy

import pytest
import torch

from areal_cli.engines.tied_embedding import add_rows_into_tied_head


def _model(tied: bool = True, pad: int | None = None):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied, pad_token_id=pad)
    return Qwen2ForCausalLM(cfg)


def _grads(model, batches):
    model.zero_grad(set_to_none=True)
    for ids in batches:  # several micro-batches accumulate, as the engines' do
        logp = model(input_ids=ids).logits.float().log_softmax(-1)
        logp.gather(-1, ids.roll(-1, dims=1).unsqueeze(-1)).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("pad", [None, 7])
def test_gradients_equal_autograds(pad):
    plain = _model(pad=pad)
    routed = copy.deepcopy(plain)
    assert add_rows_into_tied_head(routed)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 300, (2, 17), generator=g) for _ in range(2)]
    batches[0][0, :3] = 7  # the padding row, when there is one, gets no gradient from the lookup
    want, got = _grads(plain, batches), _grads(routed, batches)
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5, msg=name)
    # a second step reuses the hook without carrying rows over
    torch.testing.assert_close(_grads(routed, batches)["model.embed_tokens.weight"], want["model.embed_tokens.weight"],
                               rtol=1e-5, atol=1e-5)


def test_the_lookup_gives_autograd_no_dense_weight_gradient():
    model = _model()
    add_rows_into_tied_head(model)
    w = model.model.embed_tokens.weight
    out = model.model.embed_tokens(torch.tensor([[1, 2, 3]]))
    # the weight's gradient through the lookup alone is None: its rows wait for the head's gradient
    (gw,) = torch.autograd.grad(out.sum(), [w], allow_unused=True)
    assert gw is None
    assert len(w._areal_rows) == 1 and w._areal_rows[0][0].tolist() == [1, 2, 3]


def test_untied_and_frozen_models():
    untied = _model(tied=False)
    assert not add_rows_into_tied_head(untied)
    frozen = _model()
    assert add_rows_into_tied_head(frozen)
    frozen.model.embed_tokens.weight.requires_grad_(False)
    frozen(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
    assert frozen.model.embed_tokens.weight.grad is None
    assert frozen.model.layers[0].mlp.up_proj.weight.grad is not None
