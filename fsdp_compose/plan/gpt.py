"""The project's example GPT: one definition for the example (``examples/gpt_model.py`` imports it), the tests, the
benchmarks and the planner's ``gpt`` preset, so that what the planner plans is what the example trains.

It lives in the package because the planner ships with it (``examples/`` is not installed). Dimensions are
deliberately uneven by default (vocab 97, sequence 13, width 18) so that sharding on dim 0 exercises uneven and
empty shards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

__all__ = ["GPT", "MLP", "Attention", "Block", "GPTConfig"]


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 97
    seq_len: int = 13
    dim: int = 18
    n_layers: int = 2
    n_heads: int = 3
    mlp_ratio: int = 4
    activation_checkpointing: bool = False


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))  # type: ignore[no-any-return]


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))  # type: ignore[no-any-return]


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.checkpointing = cfg.activation_checkpointing
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg)

    def _attn(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(self.ln1(x))  # type: ignore[no-any-return]

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln2(x))  # type: ignore[no-any-return]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointing:
            x = x + checkpoint(self._attn, x, use_reentrant=False)
            return x + checkpoint(self._mlp, x, use_reentrant=False)  # type: ignore[no-any-return]
        x = x + self._attn(x)
        return x + self._mlp(x)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_emb = nn.Parameter(torch.empty(cfg.seq_len, cfg.dim))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.pos_emb, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx) + self.pos_emb[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # type: ignore[no-any-return]

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int) -> torch.Tensor:
        """Greedy decoding: append ``new_tokens`` tokens to ``idx`` (batch, length).

        It calls ``self.forward`` directly, not ``self(...)``: a sharded model needs
        ``fc.register_forward_method(model, "generate")`` so that its root unit is gathered around this method.
        """
        for _ in range(new_tokens):
            logits = self.forward(idx[:, -self.cfg.seq_len :])
            idx = torch.cat([idx, logits[:, -1].argmax(dim=-1, keepdim=True)], dim=1)
        return idx
