"""Build tiny HF causal-LMs from a config and train tokenizers locally.

Everything here is created on this machine: there is no hub access. A model dir written by
:func:`make_tiny_model` is an ordinary HF dir (``config.json`` + ``model.safetensors`` + tokenizer
files) that the trainer, the built-in ``hf`` server and vLLM all load.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]

# Minimal ChatML template (the same shape Qwen uses), so prompts built with
# ``apply_chat_template`` look like the ones real models see. Plain messages render exactly as
# ``<|im_start|>role\ncontent<|im_end|>\n``; ``tools`` go into a system turn as one JSON line each,
# an assistant's ``tool_calls`` render as Hermes/Qwen ``<tool_call>`` blocks and ``tool`` results as
# their own turn (what ``inference/server/tool_parsers.py``'s ``hermes`` parser reads back).
CHAT_TEMPLATE = (
    "{% set ns = namespace(start=0) %}"
    "{% if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{{ messages[0]['content'] + '\n' }}{% set ns.start = 1 %}{% endif %}"
    "{{ '<tools>\n' }}{% for tool in tools %}{{ tool | tojson }}{{ '\n' }}{% endfor %}"
    "{{ '</tools><|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages[ns.start:] %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% endif %}"
    "{% if message['tool_calls'] is defined and message['tool_calls'] %}"
    "{% for call in message['tool_calls'] %}"
    "{% set fn = call['function'] if call['function'] is defined else call %}"
    "{% if loop.index0 > 0 or (message['content'] is string and message['content']) %}{{ '\n' }}{% endif %}"
    "{{ '<tool_call>\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}"
    "{% if fn['arguments'] is string %}{{ fn['arguments'] }}{% else %}{{ fn['arguments'] | tojson }}{% endif %}"
    "{{ '}\n</tool_call>' }}"
    "{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_tokenizer(out_dir: str | os.PathLike, corpus: Iterable[str], vocab_size: int = 400,
                    model_max_length: int = 1024) -> str:
    """Train a byte-level BPE tokenizer (digits always split one per token) and save it HF-style.

    Returns ``out_dir``. Splitting digits individually keeps arithmetic learnable for tiny models.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        bos_token=None,
        unk_token=None,
        model_max_length=model_max_length,
    )
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|endoftext|>"]})
    fast.chat_template = CHAT_TEMPLATE
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return str(out_dir)


def tiny_qwen2_config(vocab_size: int, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                      num_kv_heads: int = 2, intermediate_size: int | None = None,
                      max_position_embeddings: int = 1024, tie_word_embeddings: bool = True,
                      eos_token_id: int | None = None, pad_token_id: int | None = None):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        rope_theta=10000.0,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
    )


def tiny_qwen3_moe_config(vocab_size: int, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                          num_kv_heads: int = 2, num_experts: int = 4, top_k: int = 2,
                          moe_intermediate_size: int | None = None, max_position_embeddings: int = 1024,
                          tie_word_embeddings: bool = False, eos_token_id: int | None = None,
                          pad_token_id: int | None = None):
    """A tiny Qwen3-MoE: every layer's MLP is ``num_experts`` SwiGLU experts, ``top_k`` routed with
    renormalised probabilities (``norm_topk_prob``), no shared expert."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=hidden_size // num_heads,
        intermediate_size=4 * hidden_size, moe_intermediate_size=moe_intermediate_size or hidden_size,
        num_experts=num_experts, num_experts_per_tok=top_k, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings, rope_theta=10000.0, eos_token_id=eos_token_id,
        pad_token_id=pad_token_id, bos_token_id=None)


TINY_FAMILIES = {"qwen2": tiny_qwen2_config, "qwen3_moe": tiny_qwen3_moe_config}


def make_tiny_model(out_dir: str | os.PathLike, tokenizer_dir: str | os.PathLike | None = None, *,
                    corpus: Iterable[str] | None = None, seed: int = 0, family: str = "qwen2",
                    **config_kwargs) -> str:
    """Write a randomly initialised tiny causal-LM (safetensors) plus tokenizer to ``out_dir``.

    The tokenizer comes from ``tokenizer_dir`` or is trained on ``corpus`` (a default arithmetic
    corpus when both are ``None``). ``family``: ``qwen2`` (dense, :func:`tiny_qwen2_config`) or
    ``qwen3_moe`` (:func:`tiny_qwen3_moe_config`); ``config_kwargs`` go to that function.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()  # no "Writing model shards" bar in a user's run
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_dir is None:
        if corpus is None:
            corpus = default_corpus()
        train_tokenizer(out, corpus)
        tokenizer_dir = out
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    if Path(tokenizer_dir) != out:
        tok.save_pretrained(str(out))
    cfg = TINY_FAMILIES[family](vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                                pad_token_id=tok.pad_token_id, **config_kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(str(out), safe_serialization=True)
    return str(out)


def default_corpus(n: int = 2000) -> list[str]:
    """A small deterministic text corpus (arithmetic Q/A in chat form) for tokenizer training."""
    import random

    rng = random.Random(1234)
    lines = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        lines.append(f"<|im_start|>user\nWhat is {a} plus {b}?<|im_end|>\n<|im_start|>assistant\n"
                     f"{a} + {b} = {a + b}. The answer is {a + b}.<|im_end|>")
    lines.append("The quick brown fox jumps over the lazy dog. #### \\boxed{} , ; : ! ? ( ) [ ] { } - * / =")
    return lines


def model_param_count(model_dir: str | os.PathLike) -> int:
    """Parameter count from ``config.json`` alone (no torch), for tiny Qwen2/Llama configs."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    h, i, v, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hd = cfg.get("head_dim") or h // heads
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h + (heads * hd + 2 * kv * hd)
    mlp = 3 * h * i
    per_layer = attn + mlp + 2 * h
    emb = v * h * (1 if cfg.get("tie_word_embeddings", False) else 2)
    return emb + n * per_layer + h
