"""``CollectiveRecorder``: one record per collective this process issues while it is active.

::

    with fc.CollectiveRecorder() as recorder:
        loss = loss_fn(model(x), y)
        with recorder.labelled("backward"):
            loss.backward()
    recorder.counts()    # Counter({'all_gather': 9, 'reduce_scatter': 5})
    recorder.summary()   # {kind: {group: {"calls": n, "bytes": b}}}

For the duration of the ``with`` block the recorder replaces, in this process only, ``torch.distributed``'s
collectives (``all_gather_single`` and its older name ``all_gather_into_tensor``, ``all_gather``,
``reduce_scatter_single`` / ``reduce_scatter_tensor``, ``all_reduce``, ``broadcast``, ``all_to_all_single``: those
this torch release has) and, with ``functional=True`` (the default), the functional collectives DTensor's
redistributions issue (``torch.distributed._functional_collectives``), by wrappers that record and call through. On
exit it puts back exactly what it found; nothing else changes and nothing stays behind. fsdp_compose and torch's
``fully_shard`` both look these functions up at every call (``collectives.py``), so both are seen, as is any other
caller. Recorders nest (each records every call); a call made from inside a recorded call (torch's deprecated
names forward to the new ones) is recorded once.

Bytes per record (the same conventions for every caller, so figures compare one to one):

- all-gather: the output's bytes (``group size`` x shard: what every rank ends up holding);
- reduce-scatter: the input's bytes (``group size`` x shard);
- all-reduce, broadcast: the tensor's bytes; all-to-all: the input's bytes.

Why not torch's ``CommDebugMode``: it counts collectives per module and operator, but keeps neither the bytes nor
the process group of each call, and cannot scope a ``Work.wait()``: the tests, the benchmarks and the planner's
live-bytes counter need all three.

Not seen: collectives issued from C++ (DDP's reducer), barriers, and code that bound a function to a name of its own
before the recorder started (``from torch.distributed import all_reduce``).

``label`` is whatever the caller set last with :meth:`CollectiveRecorder.labelled` (a phase, a step...). ``group``
names the process group: by ``group_labels`` (a group's name or description -> a label, e.g. its mesh dimension),
else by the group's own name. ``observer(record, inputs, outputs)`` is called after each recorded call with the
tensors it read and filled (the planner labels those buffers); ``scope()`` is entered around each recorded call and
each ``Work.wait()`` (the live-bytes counter uses it to tell a collective's own temporaries apart).
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d

__all__ = ["CollectiveRecord", "CollectiveRecorder"]


class _Spec(NamedTuple):
    """How to read one collective function's arguments."""

    kind: str
    params: tuple[str, ...]  # its leading parameters, in order (enough to reach the group)
    counted: str  # the parameter whose bytes count ("" for a functional all-gather: input x group size)
    outputs: tuple[str, ...]  # parameters it fills in place
    inputs: tuple[str, ...]  # parameters it only reads


_DIST: dict[str, _Spec] = {
    "all_gather_single": _Spec("all_gather", ("output_tensor", "input_tensor", "group"), "output_tensor",
                               ("output_tensor",), ("input_tensor",)),
    "all_gather_into_tensor": _Spec("all_gather", ("output_tensor", "input_tensor", "group"), "output_tensor",
                                    ("output_tensor",), ("input_tensor",)),
    "all_gather": _Spec("all_gather", ("tensor_list", "tensor", "group"), "tensor_list", ("tensor_list",), ("tensor",)),
    "reduce_scatter_single": _Spec("reduce_scatter", ("output", "input", "op", "group"), "input", ("output",),
                                   ("input",)),
    "reduce_scatter_tensor": _Spec("reduce_scatter", ("output", "input", "op", "group"), "input", ("output",),
                                   ("input",)),
    "all_reduce": _Spec("all_reduce", ("tensor", "op", "group"), "tensor", ("tensor",), ()),
    "broadcast": _Spec("broadcast", ("tensor", "src", "group"), "tensor", ("tensor",), ()),
    "all_to_all_single": _Spec("all_to_all", ("output", "input", "output_split_sizes", "input_split_sizes", "group"),
                               "input", ("output",), ("input",)),
}  # fmt: skip
_FUNCTIONAL: dict[str, _Spec] = {
    "all_gather_single": _Spec("all_gather", ("self", "gather_dim", "group"), "", (), ("self",)),
    "all_gather_tensor": _Spec("all_gather", ("self", "gather_dim", "group"), "", (), ("self",)),
    "reduce_scatter_single": _Spec("reduce_scatter", ("self", "reduceOp", "scatter_dim", "group"), "self", (),
                                   ("self",)),
    "reduce_scatter_tensor": _Spec("reduce_scatter", ("self", "reduceOp", "scatter_dim", "group"), "self", (),
                                   ("self",)),
    "all_reduce": _Spec("all_reduce", ("self", "reduceOp", "group"), "self", (), ("self",)),
    "all_to_all_single": _Spec("all_to_all", ("self", "output_split_sizes", "input_split_sizes", "group"), "self",
                               (), ("self",)),
    "broadcast": _Spec("broadcast", ("self", "src", "group"), "self", (), ("self",)),
}  # fmt: skip


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective call: what it was, on which group, how many bytes of which dtype, under which label."""

    kind: str  # "all_gather", "reduce_scatter", "all_reduce", "broadcast" or "all_to_all"
    group: str  # the group's label (``group_labels``), else its name
    group_size: int
    nbytes: int
    dtype: torch.dtype
    label: str  # the recorder's label when the call was made ("" outside any)
    functional: bool  # issued through torch.distributed._functional_collectives (DTensor), not torch.distributed

    @property
    def numel(self) -> int:
        """Elements counted (``nbytes`` over the dtype's size)."""
        return self.nbytes // self.dtype.itemsize


def _argument(spec: _Spec, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    index = spec.params.index(name)
    return args[index] if len(args) > index else kwargs.get(name)


def _tensors(value: Any) -> tuple[torch.Tensor, ...]:
    if isinstance(value, torch.Tensor):
        return (value,)
    if isinstance(value, (list, tuple)):
        return tuple(t for t in value if isinstance(t, torch.Tensor))
    return ()


def _process_group(group: Any, functional: bool) -> dist.ProcessGroup | None:
    """The ProcessGroup a call's ``group`` argument names; None where it cannot be resolved."""
    if isinstance(group, dist.ProcessGroup):
        return group
    try:
        if not functional:
            return c10d._get_default_group() if group is None else None
        return c10d._resolve_process_group(funcol._resolve_group_name(group))  # type: ignore[attr-defined]
    except (RuntimeError, ValueError, TypeError, AttributeError):
        return None


class CollectiveRecorder:
    """Records every collective of this process while active (see the module docstring)."""

    def __init__(
        self,
        *,
        group_labels: Mapping[str, str] | None = None,
        functional: bool = True,
        observer: Callable[[CollectiveRecord, tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]], None] | None = None,
        scope: Callable[[], AbstractContextManager[Any]] | None = None,
    ) -> None:
        self.records: list[CollectiveRecord] = []
        self.label = ""
        self.group_labels = dict(group_labels or {})
        self.functional = functional
        self.observer = observer
        self.scope = scope
        self._depth = 0
        self._restore: list[tuple[Any, str, Any]] = []

    # ------------------------------------------------------------------ results
    def counts(self, *, functional: bool | None = None) -> Counter[str]:
        """Calls per kind (``functional``: only those through functional collectives, or only the others)."""
        return Counter(r.kind for r in self.records if functional is None or r.functional is functional)

    def bytes_per_kind(self, *, functional: bool | None = None) -> Counter[str]:
        """Bytes per kind (``functional`` as in :meth:`counts`)."""
        totals: Counter[str] = Counter()
        for r in self.records:
            if functional is None or r.functional is functional:
                totals[r.kind] += r.nbytes
        return totals

    def summary(self) -> dict[str, dict[str, dict[str, int]]]:
        """``{kind: {group: {"calls": n, "bytes": b}}}``, kinds sorted."""
        result: dict[str, dict[str, dict[str, int]]] = {}
        for r in sorted(self.records, key=lambda r: r.kind):
            entry = result.setdefault(r.kind, {}).setdefault(r.group, {"calls": 0, "bytes": 0})
            entry["calls"] += 1
            entry["bytes"] += r.nbytes
        return result

    def by_group(self) -> dict[str, list[CollectiveRecord]]:
        """The records of each group, in the order they were issued."""
        result: dict[str, list[CollectiveRecord]] = {}
        for r in self.records:
            result.setdefault(r.group, []).append(r)
        return result

    @property
    def total_bytes(self) -> int:
        return sum(r.nbytes for r in self.records)

    def clear(self) -> None:
        self.records.clear()

    @contextlib.contextmanager
    def labelled(self, label: str) -> Iterator[None]:
        """Record the calls made inside with ``label``."""
        outer, self.label = self.label, label
        try:
            yield
        finally:
            self.label = outer

    # ------------------------------------------------------------------ recording
    def _group_name(self, pg: dist.ProcessGroup | None) -> tuple[str, int]:
        if pg is None:
            return "?", 0
        name = str(pg.group_name)
        label = self.group_labels.get(name) or self.group_labels.get(str(getattr(pg, "group_desc", "")))
        return label or name, pg.size()

    def _record(self, spec: _Spec, functional: bool, args: tuple[Any, ...], kwargs: dict[str, Any]) -> CollectiveRecord:
        group, size = self._group_name(_process_group(_argument(spec, "group", args, kwargs), functional))
        counted = _tensors(_argument(spec, spec.counted or spec.params[0], args, kwargs))
        nbytes = sum(t.numel() * t.element_size() for t in counted) * (1 if spec.counted else size)
        dtype = counted[0].dtype if counted else torch.uint8
        return CollectiveRecord(spec.kind, group, size, nbytes, dtype, self.label, functional)

    def _scoped(self) -> AbstractContextManager[Any]:
        return self.scope() if self.scope is not None else contextlib.nullcontext()

    def _wrap(self, original: Callable[..., Any], spec: _Spec, functional: bool) -> Callable[..., Any]:
        @functools.wraps(original)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return original(*args, **kwargs)  # called from a recorded call: counted there
            record = self._record(spec, functional, args, kwargs)
            self.records.append(record)
            self._depth += 1
            try:
                with self._scoped():
                    result = original(*args, **kwargs)
            finally:
                self._depth -= 1
            if self.observer is not None:
                outputs = [t for name in spec.outputs for t in _tensors(_argument(spec, name, args, kwargs))]
                inputs = tuple(t for name in spec.inputs for t in _tensors(_argument(spec, name, args, kwargs)))
                self.observer(record, inputs, tuple(outputs) + _tensors(result))
            return result

        return recorded

    def _wrap_wait(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            with self._scoped():
                return original(work, *args, **kwargs)

        return wait

    def __enter__(self) -> CollectiveRecorder:
        if self._restore:
            raise RuntimeError("this CollectiveRecorder is already active; use one per with block")
        sites: list[tuple[Any, dict[str, _Spec], bool]] = [(dist, _DIST, False)]
        if self.functional:
            sites.append((funcol, _FUNCTIONAL, True))
        for module, table, functional in sites:
            for name, spec in table.items():
                original = getattr(module, name, None)
                if original is not None:
                    self._restore.append((module, name, original))
                    setattr(module, name, self._wrap(original, spec, functional))
        if self.scope is not None:
            self._restore.append((dist.Work, "wait", dist.Work.wait))
            dist.Work.wait = self._wrap_wait(dist.Work.wait)  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in reversed(self._restore):
            setattr(owner, name, original)
        self._restore.clear()
