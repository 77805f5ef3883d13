"""Per-unit policies: numerics (mixed precision) and where shards live (offload).

Policies are plain frozen values handed to one ``fully_shard`` call; nothing here is process-global.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CPUOffloadPolicy", "MixedPrecisionPolicy", "OffloadPolicy"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes of one unit's communication and compute.

    Sharded parameters, their gradients and the optimizer state always stay in the parameters' original dtype.

    - ``param_dtype``: dtype of the all-gather and of the full parameters used in forward/backward (None: original).
    - ``reduce_dtype``: dtype of the gradient reduction (None: ``param_dtype``, or original when that is None too).
    - ``output_dtype``: cast floating-point forward outputs to this dtype (None: leave them).
    - ``cast_forward_inputs``: cast floating-point forward inputs to ``param_dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype", "output_dtype"):
            dtype = getattr(self, field)
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise TypeError(
                    f"MixedPrecisionPolicy.{field} must be a floating-point torch.dtype or None, got {dtype!r}; "
                    "use e.g. torch.bfloat16"
                )


@dataclass(frozen=True)
class OffloadPolicy:
    """Keep shards and gradients on the mesh's device (no offload)."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep shards and gradients in CPU memory; the optimizer steps on CPU. ``pin_memory`` speeds host transfers."""

    pin_memory: bool = True
