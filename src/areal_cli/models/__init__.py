"""Tiny models and locally trained tokenizers (no hub access, ever)."""
