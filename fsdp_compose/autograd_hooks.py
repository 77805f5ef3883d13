"""What the units' hooks need to know about autograd and about their step, without importing the step.

``state.py`` (the hooks) talks to the root's ``StepContext`` (``step.py``) through the ``StepOwner`` protocol, and
``fully_shard`` hands each state the function that makes one (``ShardState.make_step``): so the step depends on the
states and never the other way round.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch._dynamo.compiled_autograd

__all__ = ["StepOwner", "check_backward_reads_none_of", "check_not_compiled_autograd", "gradient_node", "in_backward"]


if TYPE_CHECKING:
    from .flat import ManagedParam


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


def check_backward_reads_none_of(owner: str, node: object, params: Sequence[ManagedParam]) -> None:
    """``set_unshard_in_backward(False)`` promised that the unit's backward reads none of its parameters: check the
    graph below ``node`` (the unit's pre-backward) down to the unit's inputs before it runs, and name the parameter
    a node saved for backward. The unit's full parameters are freed after forward: a read would fail in torch with
    "setStorage ... storage of size 0", naming nothing."""
    storages = {mp.full.untyped_storage()._cdata: mp.fqn for mp in params if mp.full is not None}
    stack = [n for n, _ in getattr(node, "next_functions", ()) if n is not None]
    seen: set[int] = set()
    while stack:
        current = stack.pop()
        if id(current) in seen or type(current).__name__ in ("AccumulateGrad", "_PostBackwardBackward"):
            continue
        seen.add(id(current))
        for attr in dir(current):
            if not attr.startswith("_saved_"):
                continue
            try:
                value = getattr(current, attr)
            except RuntimeError:  # already freed by an earlier backward: autograd raises its own error
                continue
            name = storages.get(value.untyped_storage()._cdata) if isinstance(value, torch.Tensor) else None
            if name is not None:
                raise RuntimeError(
                    f"fsdp_compose: set_unshard_in_backward(False) on {owner}, but its backward reads parameter "
                    f"{name!r} ({type(current).__name__} saved it in forward), which is not gathered for backward. "
                    "Leave set_unshard_in_backward(True) for this unit; False suits units whose backward needs no "
                    "parameter (an embedding's)"
                )
        stack.extend(n for n, _ in current.next_functions if n is not None)
