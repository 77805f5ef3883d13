"""A small GPT used by the example, the tests, the benchmarks and the planner, with its training helpers.

The model itself (``GPT``, ``GPTConfig`` and its blocks) is defined once, in ``fsdp_compose/plan/gpt.py``, so that the
planner's ``gpt`` preset plans exactly what the example trains; it is imported here. Dimensions are deliberately
uneven by default (vocab 97, sequence 13, width 18) so that sharding on dim 0 exercises uneven and empty shards.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_compose.plan.gpt import GPT, MLP, Attention, Block, GPTConfig

__all__ = ["GPT", "MLP", "Attention", "Block", "GPTConfig", "init_weights", "loss_fn", "synthetic_batch"]


def init_weights(model: nn.Module) -> None:
    """Re-run every submodule's own initializer (after ``to_empty`` when the model was built on the meta device)."""
    for module in model.modules():
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def synthetic_batch(cfg: GPTConfig, batch_size: int, step: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic global batch for ``step`` (the same on every rank): inputs and next-token targets.

    Tokens follow a fixed random successor table (shared by all steps) with 10% noise, so there is something to
    learn and the loss visibly falls.
    """
    successor = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed(seed * 100_003 + step + 1)
    tokens = torch.empty(batch_size, cfg.seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, cfg.vocab_size, (batch_size,), generator=gen)
    for t in range(cfg.seq_len):
        noise = torch.randint(0, cfg.vocab_size, (batch_size,), generator=gen)
        keep = torch.rand(batch_size, generator=gen) >= 0.1
        tokens[:, t + 1] = torch.where(keep, successor[tokens[:, t]], noise)
    return tokens[:, :-1], tokens[:, 1:]
