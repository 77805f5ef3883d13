"""What the units' hooks need to know about autograd: the record of one forward call (``ForwardCall``) and the
autograd nodes it is asked about, the tensors in a module's inputs and outputs, and the checks a backward hook makes
before it issues anything.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch._dynamo.compiled_autograd
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = [
    "ForwardCall",
    "autograd_tensors",
    "cast_floating",
    "check_backward_reads_none_of",
    "check_not_compiled_autograd",
    "gradient_node",
    "in_backward",
    "map_tensors",
    "tensors_in",
    "unique_tensors",
]


if TYPE_CHECKING:
    from .flat import ManagedParam


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


class ForwardCall:
    """One forward call of one of a unit's modules whose outputs need gradients: what its backward will run.

    It holds the autograd nodes the unit added around the call weakly (a forward nobody runs backward for frees
    its graph as usual): ``pre``, one per output that needs grad (its backward is the unit's pre-backward), and
    ``post``, one per input that needs grad (once the last of them this backward runs has run, the unit's backward
    for this call is done). Autograd tells, at the start of a backward, whether it will run each of them: that is
    how a rank knows which units a backward uses before it uses them.

    One node per tensor, not one over all of them: a node with several outputs runs when any of them gets a gradient
    and hands zeros for the others. An output the loss ignores (or an input the unit ignores) would then feed zero
    gradients into the unit (or into what made the input), and autograd would count the parameters there as getting
    gradients (the backward's agreement): they must keep ``.grad = None``, as in single-process training.
    """

    __slots__ = ("always", "anchor", "grad_enabled", "inputs", "post", "posts_left", "pre", "seq")

    def __init__(self, seq: int = 0) -> None:
        self.seq = seq  # the root's count of calls in this step when this one began: forward order
        self.pre: list[weakref.ref[Any]] = []
        self.post: list[weakref.ref[Any]] = []
        # Input nodes still to run in this backward (set when the backward begins; the last one ends the call)
        self.posts_left = 0
        self.always = False  # no node to ask (outputs under a torch.func transform): taken as run by a backward
        # A call under no_grad on inputs that need grad: a reentrant activation checkpoint's forward, whose backward
        # recomputes it inside the backward (see ``ShardState.recomputes_due``). Its inputs, weakly.
        self.inputs: list[weakref.ref[torch.Tensor]] | None = None
        # Such a call whose inputs were made under no_grad too (inside the checkpoint's region): the root's call it
        # ran in, whose backward is the one that recomputes it.
        self.anchor: ForwardCall | None = None
        self.grad_enabled = torch.is_grad_enabled()

    def alive(self) -> bool:
        if self.anchor is not None:
            return self.anchor.alive()
        if self.inputs is not None:
            return any(ref() is not None for ref in self.inputs)
        return self.always or any(ref() is not None for ref in self.pre)

    def runs_in_this_backward(self, running: object = None) -> bool:
        """``running``: the node whose backward is running now (autograd does not count a backward's own root
        node among those it will execute). A recomputed call runs if the gradient of one of its inputs is computed
        (autograd cannot see inside the checkpoint before it recomputes)."""
        if self.always:
            return True
        if self.anchor is not None:
            return self.anchor.runs_in_this_backward(running)
        if self.inputs is not None:
            nodes = [gradient_node(t) for t in (ref() for ref in self.inputs) if t is not None]
        else:
            nodes = self.pre_nodes()
        will_run = torch._C._will_engine_execute_node
        for node in nodes:
            if node is not None and (node is running or will_run(node)):
                return True
        return False

    def pre_nodes(self) -> list[Any]:
        """The output nodes still alive (their graphs may run)."""
        alive = []
        for ref in self.pre:
            node = ref()
            if node is not None:
                alive.append(node)
        return alive

    def outputs_pending(self) -> bool:
        """Does an output of this call still await its backward? A backward that used some outputs only (``o1``'s
        now, ``o2``'s in a later backward) leaves the call to the later one."""
        for node in self.pre_nodes():
            if not getattr(node, "ran", False):
                return True
        return False

    def post_backward_runs(self) -> bool:
        """Will this backward end the call (run an input node)? Counts the input nodes it runs (``posts_left``)."""
        if self.inputs is not None:
            return True  # its recompute wraps the inputs it runs on
        nodes = [node for node in (ref() for ref in self.post) if node is not None]
        self.posts_left = sum(1 for node in nodes if torch._C._will_engine_execute_node(node))
        return self.posts_left > 0


def unique_tensors(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen: set[int] = set()
    found = []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            found.append(t)
    return found


def autograd_tensors(output: torch.Tensor) -> list[torch.Tensor]:
    """The tensors of an output that backward reaches: the output itself, or inside a torch.func transform (``jvp``)
    the plain tensors under its wrapper, the primal and the tangent. The tangent's backward reads the unit's full
    parameters too, so it needs the pre-backward hook as much as the primal (a loss on a jvp's tangent)."""
    if not torch._C._functorch.is_functorch_wrapped_tensor(output):
        return [output]
    tensors = [output]
    tangent = torch.autograd.forward_ad.unpack_dual(output).tangent
    if tangent is not None:
        tensors.append(tangent)
    found = []
    for tensor in tensors:
        while torch._C._functorch.is_functorch_wrapped_tensor(tensor):
            tensor = torch._C._functorch.get_unwrapped(tensor)
        found.append(tensor)
    return found


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
        return value.to(dtype)
    return value


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every tensor in a module's inputs or outputs, whatever holds them: ``torch.utils._pytree`` knows tuples, lists,
    dicts and namedtuples; module outputs are also dataclasses (torch's own FSDP tests return them, as do many model
    libraries), and a unit must see every tensor of its outputs to hook its backward."""
    found: list[torch.Tensor] = []

    def note(tensor: torch.Tensor) -> torch.Tensor:
        found.append(tensor)
        return tensor

    map_tensors(note, value)
    return found


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], value: Any) -> Any:
    """``value`` with every tensor ``t`` in it replaced by ``fn(t)`` (containers rebuilt only where needed)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {}
        for f in dataclasses.fields(value):
            if not f.init:
                continue
            old = getattr(value, f.name)
            new = map_tensors(fn, old)
            if new is not old:
                changes[f.name] = new
        return dataclasses.replace(value, **changes) if changes else value
    leaves, spec = tree_flatten(value)
    if len(leaves) == 1 and leaves[0] is value:
        return value  # a leaf that is no tensor
    new_leaves = [map_tensors(fn, leaf) for leaf in leaves]
    if all(a is b for a, b in zip(new_leaves, leaves, strict=True)):
        return value
    return tree_unflatten(new_leaves, spec)
