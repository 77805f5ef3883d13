"""Recording streams: the accelerator's stream and event layer simulated on CPU, checking the lifetime rule.

On a CPU device ``fsdp_compose.collectives`` hands out no side stream and no event, and gloo completes a collective only
when it is waited for, so the accelerator's orderings are never exercised by the CPU tests. Inside
``recording_streams()`` the engine gets simulated streams and events instead, its collectives run on one simulated
stream per process group (as NCCL's do), the backward walk takes the accelerator side of its waits, and a dispatch
mode notes which stream issued every op and which storages it read and wrote. Each stream keeps a vector clock of the
work it is ordered after (``wait_stream``, ``wait_event``, ``Work.wait``, a host ``Event.synchronize``), and every
access is checked against the rule of docs/design.md "Streams":

- no buffer is read or written before the stream that last wrote it (or, for a write, last read it) is waited for
  (a host read with ``tolist()`` counts as a read on the current stream);
- no buffer is reused before every other stream that touched it is waited for: the caching allocator hands a freed
  block to the next allocation of the stream it was allocated on, so that stream must be ordered after every other
  use (this rule is what lets the engine go without ``record_stream``).

Completions are reported adversarially: ``Work.is_completed()`` answers False, seeded at random, also for a collective
that has completed (never True for one that has not: that would be a lie no device tells), so every "is it done yet?"
branch of the walk runs both ways.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import random
import traceback
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import fsdp_compose.collectives as streams_module
import fsdp_compose.delivery as delivery_module
import fsdp_compose.step as step_module
import fsdp_compose.unit as unit_module

__all__ = ["StreamSim", "on_recording_streams", "recording_streams"]


class SimStream:
    def __init__(self, sim: StreamSim, name: str) -> None:
        self.sim, self.name = sim, name
        self.seq = 0  # ops issued on this stream
        self.clock: dict[str, int] = {}  # stream name -> how much of its work this stream is ordered after

    def knows(self, other: str, seq: int) -> bool:
        return other == self.name or self.clock.get(other, 0) >= seq

    def merge(self, snapshot: dict[str, int]) -> None:
        for name, seq in snapshot.items():
            if self.clock.get(name, 0) < seq:
                self.clock[name] = seq

    def snapshot(self) -> dict[str, int]:
        return {**self.clock, self.name: self.seq}

    # the torch.Stream surface the engine uses
    def wait_stream(self, other: SimStream) -> None:
        self.merge(other.snapshot())

    def wait_event(self, event: SimEvent) -> None:
        self.merge(event.snapshot)

    def __enter__(self) -> SimStream:
        self.sim.stack.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.sim.stack.pop()


class SimEvent:
    def __init__(self, sim: StreamSim, stream: SimStream) -> None:
        self.sim, self.snapshot = sim, stream.snapshot()

    def synchronize(self) -> None:
        """The host waited: everything it issues from now on, on any stream, runs after the event."""
        for stream in self.sim.streams.values():
            stream.merge(self.snapshot)


class SimWork:
    """An asynchronous collective on its group's stream: ``wait`` orders the current stream after it."""

    def __init__(self, sim: StreamSim, work: Any, snapshot: dict[str, int]) -> None:
        self.sim, self.work, self.snapshot = sim, work, snapshot

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self.sim.current.merge(self.snapshot)
        return self.work.wait(*args, **kwargs) if self.work is not None else True

    def is_completed(self) -> bool:
        done = self.work is None or self.work.is_completed()
        if done and self.sim.rng.random() < 0.5:
            self.sim.late_reports += 1
            return False  # completed, but reported late
        if done:
            self.wait()
            for stream in self.sim.streams.values():  # the host saw it complete: later work is ordered after it
                stream.merge(self.snapshot)
        return done

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


@dataclasses.dataclass
class _Access:
    allocated_on: str
    last_write: tuple[str, int] | None = None
    reads: dict[str, int] = dataclasses.field(default_factory=dict)  # stream -> last read since the last write
    # stream -> its last access of any kind: (its position on that stream, the op)
    users: dict[str, tuple[int, str]] = dataclasses.field(default_factory=dict)
    storage: int = 0  # the storage object at this address (``_cdata``); 0: unknown


def _plain(t: Any) -> torch.Tensor | None:
    if isinstance(t, DTensor):
        t = t._local_tensor
    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
        return None
    return t


def _keys(value: Any, storages: dict[int, int] | None = None) -> list[int]:
    """The storages of the tensors in ``value`` (a tensor, a list of them, anything else), by address; ``storages``
    collects which storage object is at each address."""
    tensors = value if isinstance(value, (list, tuple)) else [value]
    keys = []
    for t in tensors:
        p = _plain(t)
        key = None if p is None else _key(p)
        if key is not None:
            keys.append(key)
            if storages is not None and p is not None:
                storages[key] = p.untyped_storage()._cdata
    return keys


def _key(t: torch.Tensor) -> int | None:
    try:
        storage = t.untyped_storage()
        return storage.data_ptr() if storage.nbytes() else None
    except (RuntimeError, NotImplementedError):
        return None  # a subclass (or a fake tensor) without a storage of its own


class StreamSim(TorchDispatchMode):
    """The simulated streams of one process, the dispatch mode that checks each op, and the violations found."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.rng = random.Random(seed)
        self.streams: dict[str, SimStream] = {}
        self.compute = self.stream("compute")
        self.stack: list[SimStream] = [self.compute]
        self.storages: dict[int, _Access] = {}
        # side stream -> the blocks it allocated, with a weak reference to the tensor each allocation returned
        self.pools: dict[str, list[tuple[weakref.ref[torch.Tensor], _Access]]] = {}
        self.violations: list[str] = []
        self.ops = 0  # ops checked
        self.late_reports = 0  # completed collectives reported as not completed yet

    @property
    def current(self) -> SimStream:
        return self.stack[-1]

    def stream(self, name: str) -> SimStream:
        if name not in self.streams:
            self.streams[name] = SimStream(self, name)
        return self.streams[name]

    def new_side_stream(self, device: torch.device) -> SimStream:
        return self.stream(f"side{len(self.streams)}")

    def record_event(self, device: torch.device, stream: SimStream | None = None) -> SimEvent:
        return SimEvent(self, stream or self.current)

    # ------------------------------------------------------------------ accesses
    def access(
        self, what: str, stream: SimStream, reads: list[int], writes: list[int], storages: dict[int, int] | None = None
    ) -> None:
        """One op on ``stream`` reading and writing the storages with these keys (``storages``: the storage object
        at each address, where known)."""
        stream.seq += 1
        seq = stream.seq
        for key, storage in (storages or {}).items():
            record = self.storages.get(key)
            if record is not None and record.storage not in (0, storage):
                # Another storage lives at this address now, grown by ``UntypedStorage.resize_`` (a full parameter
                # gathered again), which dispatches no op: allocated on the stream that first touches it, the one
                # the engine grows it on.
                self.storages[key] = _Access(stream.name, storage=storage)
        for key in set(reads) - set(writes):
            record = self.storages.get(key)
            if record is None:
                self.storages[key] = record = _Access(stream.name)
            if record.last_write is not None and not stream.knows(*record.last_write):
                self._violate(what, stream, f"reads a buffer {record.last_write[0]} wrote, without waiting for it")
            record.reads[stream.name] = seq
            record.users[stream.name] = (seq, what)
        for key in set(writes):
            record = self.storages.get(key)
            if record is None:
                self.storages[key] = record = _Access(stream.name)
            if record.last_write is not None and not stream.knows(*record.last_write):
                self._violate(what, stream, f"overwrites a buffer {record.last_write[0]} wrote, without waiting")
            for reader, at in record.reads.items():
                if not stream.knows(reader, at):
                    self._violate(what, stream, f"overwrites a buffer {reader} still reads, without waiting")
            record.last_write = (stream.name, seq)
            record.reads = {}
            record.users[stream.name] = (seq, what)

    def allocated(
        self, what: str, stream: SimStream, key: int, storage: int = 0, tensor: torch.Tensor | None = None
    ) -> None:
        """A new storage: where its address was another's, that one was freed and its block is reused here.

        Every block this stream allocated and that is freed by now counts as reused, whatever address the CPU
        allocator picked (the caching allocator may hand out any of them): the check then does not depend on the CPU
        allocator's choices, nor on what ran in the process before. A block counts as freed once the tensor its
        allocation returned is."""
        old = self.storages.pop(key, None)
        if old is not None and old.allocated_on == stream.name:  # the caching allocator's reuse (same stream)
            self._check_reuse(what, stream, old)
        pool = self.pools.get(stream.name, [])
        for ref, freed in pool:
            if ref() is None and freed is not old:
                self._check_reuse(what, stream, freed)
        self.pools[stream.name] = [(ref, record) for ref, record in pool if ref() is not None]
        written = (stream.name, stream.seq)
        record = _Access(stream.name, last_write=written, users={stream.name: (stream.seq, what)}, storage=storage)
        self.storages[key] = record
        if tensor is not None:
            self.pools[stream.name].append((weakref.ref(tensor, functools.partial(self._freed, key, record)), record))

    def _freed(self, key: int, record: _Access, ref: object) -> None:
        """A side stream's block is freed: forget its address, so a tensor made there later without a dispatched op
        (``torch.tensor``) starts a record of its own instead of adding its users to the freed block's."""
        if self.storages.get(key) is record:
            del self.storages[key]

    def _check_reuse(self, what: str, stream: SimStream, old: _Access) -> None:
        for user, (at, op) in old.users.items():
            if not stream.knows(user, at):
                self._violate(what, stream, f"reuses a freed block {user} used ({op}), without waiting")

    def _violate(self, what: str, stream: SimStream, message: str) -> None:
        if len(self.violations) < 20:
            where = [f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack()]
            engine = [w for w in where if not w.startswith(("stream_sim.py", "_python_dispatch", "random_models"))]
            at = " < ".join(engine[-4:][::-1])
            self.violations.append(f"op {self.ops} {what} on {stream.name}: {message} (at {at})")

    # ------------------------------------------------------------------ every op
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace == "c10d" or func.is_view:
            return func(*args, **kwargs)  # collectives are recorded where they are issued; views touch no data
        self.ops += 1
        reads: list[int] = []
        writes: list[int] = []
        storages: dict[int, int] = {}
        for i, arg in enumerate(func._schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            keys = _keys(value, storages)
            if arg.alias_info is not None and arg.alias_info.is_write:
                writes += keys
            else:
                reads += keys
        out = func(*args, **kwargs)  # keys were taken before: an op may free its input's storage (resize_)
        stream = self.current
        inputs = set(reads) | set(writes)
        made: dict[int, int] = {}
        outputs = out if isinstance(out, (list, tuple)) else [out]
        for tensor in outputs:
            for key in _keys(tensor, made):
                if key not in inputs:
                    self.allocated(func.__name__, stream, key, made[key], _plain(tensor))
        self.access(func.__name__, stream, reads, writes, storages)
        return out

    def host_read(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """``tensor.tolist()``, which dispatches no op: a copy to the host on the current stream (an accelerator
        synchronizes that stream only), so the stream that wrote the tensor must be waited for first (``item()``
        dispatches, and is checked like any op)."""

        def read(tensor: torch.Tensor) -> Any:
            self.access("tolist", self.current, _keys(tensor), [])
            return original(tensor)

        return read

    # ------------------------------------------------------------------ collectives
    def collective(self, original: Callable[..., Any], reads: int, writes: int) -> Callable[..., Any]:
        """``original`` issued on its group's stream after the current one, as NCCL issues it."""

        def issue(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            comm = self.stream(f"comm:{getattr(group, 'group_name', None) or 'world'}")
            comm.wait_stream(self.current)  # a collective starts after the work queued before it
            storages: dict[int, int] = {}
            read, written = _keys(args[reads], storages), _keys(args[writes], storages)
            self.access(original.__name__, comm, read, written, storages)
            work = original(*args, **kwargs)
            sim_work = SimWork(self, work, comm.snapshot())
            if not kwargs.get("async_op", False):
                sim_work.wait()
                return work
            return sim_work

        return issue


_COLLECTIVES = {
    # name: (index of the argument read, index of the argument written)
    "all_gather_single": (1, 0),
    "all_gather_into_tensor": (1, 0),
    "reduce_scatter_single": (1, 0),
    "reduce_scatter_tensor": (1, 0),
    "all_reduce": (0, 0),
}


@contextlib.contextmanager
def recording_streams(seed: int = 0) -> Iterator[StreamSim]:
    """Every root made in the block runs the accelerator's side over simulated streams (see the module docstring)."""
    from tests.test_accelerator_path import accelerator_side

    sim = StreamSim(seed)
    patches: list[tuple[Any, str, Any]] = [
        (step_module, "side_stream", sim.new_side_stream),
        (streams_module, "current_stream", lambda device: sim.current),
        (delivery_module, "current_stream", lambda device: sim.current),
        (unit_module, "record_event", sim.record_event),
        (delivery_module, "record_event", sim.record_event),
        # NCCL reads a reduce-scatter's input while it runs (gloo on a CPU device copies it at issue)
        (delivery_module.ReduceSpec, "input_copied_at_issue", property(lambda spec: False)),
    ]
    for name, (reads, writes) in _COLLECTIVES.items():
        original = getattr(dist, name, None)
        if original is not None:
            patches.append((dist, name, sim.collective(original, reads, writes)))
    patches.append((torch.Tensor, "tolist", sim.host_read(torch.Tensor.tolist)))
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        with accelerator_side(), sim:
            yield sim
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def on_recording_streams(rank: int, ws: int, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(rank, ws, *args)`` inside ``recording_streams``; raises AssertionError listing any rule broken."""
    with recording_streams(seed=rank) as sim:
        result = fn(rank, ws, *args)
    if sim.violations:
        raise AssertionError("the streams rule is broken:\n  " + "\n  ".join(sim.violations))
    return result
