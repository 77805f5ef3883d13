"""The tiny Llama the transformers / accelerate integration scripts train (2 layers, width 32): one definition."""

from __future__ import annotations

from typing import Any

from transformers import LlamaConfig


def tiny_llama_config(**overrides: Any) -> LlamaConfig:
    """The scripts' Llama config; ``overrides`` change single fields (e.g. ``vocab_size=64``)."""
    fields: dict[str, Any] = dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return LlamaConfig(**{**fields, **overrides})
