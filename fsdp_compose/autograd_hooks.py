"""What the units' hooks need to know about autograd and about their step, without importing the step.

``state.py`` (the hooks) talks to the root's ``StepContext`` (``step.py``) through the ``StepOwner`` protocol, and
``fully_shard`` hands each state the function that makes one (``ShardState.make_step``): so the step depends on the
states and never the other way round.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch._dynamo.compiled_autograd

__all__ = ["StepOwner", "check_not_compiled_autograd", "gradient_node", "in_backward"]


class StepOwner(Protocol):
    """The root's step as the hooks see it (``step.StepContext``)."""

    @property
    def in_backward(self) -> bool: ...

    gather_stream: torch.Stream | None

    def begin_forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]: ...

    def end_forward(self, *, raised: bool = False) -> None: ...

    def begin_backward(self, running: object = None) -> None: ...

    def gather_for_backward(self, state: Any) -> None: ...

    def call_backward_done(self, state: Any) -> None: ...

    def next_in_schedule(self, state: Any) -> Any: ...

    def next_call_number(self) -> int: ...

    def reset(self) -> None: ...


def in_backward() -> bool:
    """True while autograd runs a backward on this thread (e.g. an activation-checkpoint recompute)."""
    return bool(torch._C._current_graph_task_id() != -1)


def gradient_node(tensor: torch.Tensor) -> torch.autograd.graph.Node | None:
    """The autograd node that computes ``tensor``'s gradient: its ``grad_fn``, or for a leaf the node accumulating
    into it (reached through a view, which needs the storage). None where no graph is recorded (inference mode, a
    torch.func transform)."""
    if tensor.grad_fn is not None:
        return tensor.grad_fn
    with torch.enable_grad():
        view = tensor.view_as(tensor)
    return view.grad_fn.next_functions[0][0] if view.grad_fn is not None else None


def check_not_compiled_autograd(owner: str) -> None:
    """Raise when this backward runs under compiled autograd, before the unit issues any collective of it.

    Compiled autograd captures the backward graph, hooks included, and replays it: the units' backward hooks keep
    per-step state and issue collectives, and trained with wrong gradients when replayed that way (measured, for
    torch's own ``fully_shard`` too). Compiling the blocks' forward still compiles their backward (AOTAutograd).
    """
    compiled_autograd = torch._dynamo.compiled_autograd
    if compiled_autograd.compiled_autograd_enabled or compiled_autograd.in_compiled_autograd_region:
        raise RuntimeError(
            f"{owner}: backward runs under compiled autograd (torch._dynamo.config.compiled_autograd), which "
            "fsdp_compose does not support: its backward hooks must run in eager autograd. Turn compiled autograd "
            "off; torch.compile of the blocks still compiles their backward (see docs/compile.md)"
        )
