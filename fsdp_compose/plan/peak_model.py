"""An analytic model of one rank's live bytes through a training step of the GPT preset (docs/planner.md).

The model replays, allocation by allocation, what a step of the preset GPT keeps alive on one rank under
fsdp_compose (1-D mesh, fp32, AdamW / SGD per-parameter loop, no activation checkpointing), with sizes in closed form.
*When* each unit gathers, reshards and reduces is not restated here: it is read from the engine's declared schedule
of the measured model (``StepRecord.schedule``: ``fsdp_compose.program.StepSchedule``, the object the step walks),
and :class:`_Walk` replays its rules:

- forward: a unit is gathered when its first module is entered (all-gather, copy-out), then the next unit in
  registration order is prefetched; a unit that reshards after forward (``all_gather(backward)`` among its
  collectives when it has peers) frees its full parameters at the end of its forward;
- backward: the gather cursor walks ``gather_order`` (each unit passed is gathered, the one needed now copied out);
  each full parameter is freed as its gradient is made; the unit needed now prefetches the next one in the order
  at its midway point (``fc.set_backward_prefetch_point``, the default): once half its parameter bytes are freed,
  after the reductions in flight completed (in a model run in registration order, waiting for them is always
  safe); the root, needed at both ends of backward, prefetches at once. A unit's backward done: reshard, copy out
  what it prefetched midway (every earlier reduction is issued by then, so the engine may wait for that all-gather
  there), stage its gradients into a reduce-scatter input (then the reduction in flight completes: the window of
  one, as on a CPU device, where the engine waits only before the issue; before the filling it frees only what has
  completed, and the simulated process group's collectives report completion only when waited for, as gloo's do),
  and the reduce cursor issues reductions in ``reduce_order`` as far as their units are done; the final callback
  completes the rest.

What the units compute between those events is the GPT's, in closed form. Notation (elements; fp32 = 4 bytes each):
``N = batch x seq`` tokens, ``D`` width, ``F = mlp_ratio x D``, ``H`` heads, ``V`` vocabulary, ``P`` the learned
positions, ``S`` shard-group size. Per unit ``u``: ``seg_u`` the padded segment (analytic.py), ``full_u`` its unsharded
elements (its full gradients), ``Z_u`` its 0-dim trainable parameters; full parameters and all-gather buffer
``S seg_u`` each (the full parameters live in padded buffers, one per parameter, see full_params.py), reduce-scatter
input ``S (seg_u + Z_u)`` and output ``seg_u + Z_u`` (a 0-dim gradient is a column of its own; "had a gradient" flag
columns come only where a backward cannot promise every gradient, see grads.py: never in this model).

Activations one block keeps for backward: ``A = 16 N D + H N + 4 N`` (LayerNorm inputs and outputs, the qkv
projection ``3 N D``, attention output ``N D`` and log-sum-exp ``H N``, MLP hidden before and after GELU ``2 N F``,
the two residual sums; two mean/rstd pairs ``4 N``). A block that is not a unit of its own belongs to the root: its
parameters are gathered, and its gradients reduced, with the root's. The peak of a phase is the largest running sum.
Configurations outside this scope get no model (``None``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .analytic import owned_rows, padded_rows, segment_numel, sharded_state
from .step import ParamInfo, PlanConfig, StepRecord

__all__ = ["PeakModel", "peak_model"]


@dataclass(frozen=True)
class PeakModel:
    """Modelled peak bytes per phase, the live bytes at each peak by term, and the collectives the model replayed in
    order (``(phase, kind, unit)``: ``kind`` ``"all_gather"`` or ``"reduce_scatter"``)."""

    peaks: dict[str, int]
    at_peak: dict[str, dict[str, int]] = field(default_factory=dict)
    events: list[tuple[str, str, str]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Schedule:
    """A running sum of live elements by term; records each phase's maximum and what made it up."""

    def __init__(self, start: dict[str, int]) -> None:
        self.live = dict(start)
        self.total = sum(start.values())
        self.phase = ""
        self.peaks: dict[str, int] = {}
        self.at_peak: dict[str, dict[str, int]] = {}

    def begin(self, phase: str) -> None:
        self.phase = phase
        self._note()

    def add(self, term: str, n: int) -> None:
        self.live[term] = self.live.get(term, 0) + n
        self.total += n
        self._note()

    def free(self, term: str, n: int) -> None:
        self.live[term] = self.live.get(term, 0) - n
        self.total -= n
        if self.live[term] < 0:
            raise RuntimeError(f"internal error in the peak model: {term} went negative in {self.phase}")

    def _note(self) -> None:
        if self.total > self.peaks.get(self.phase, -1):
            self.peaks[self.phase] = self.total
            self.at_peak[self.phase] = {k: v for k, v in self.live.items() if v}


@dataclass(frozen=True)
class _Gpt:
    n: int  # tokens per rank
    d: int
    f: int
    h: int
    v: int
    p: int  # learned positions (the config's seq_len)
    t: int  # sequence length of the batch
    layers: int


@dataclass(frozen=True)
class _Unit:
    full: int  # unsharded elements: the full gradients
    gathered: int  # S * seg: the full parameters live in one padded buffer (each slot S x its padded shard)
    gather: int  # S * seg when the unit all-gathers (its schedule says so), else 0
    rs_in: int  # S * (seg + Z) when the unit reduce-scatters, else 0
    rs_out: int  # seg + Z
    trainable: bool  # has trainable parameters: its gradients are reduced (copied out at one rank)
    reshards_after_forward: bool  # frees its full parameters after forward (all_gather(backward) when S > 1)
    shards: int = 1  # S


ACT = "activations"
GATHERED = "gathered parameters"
AG = "all-gather buffers"
GRAD = "unsharded gradients"
RS_IN = "reduce-scatter input"
RS_OUT = "reduce-scatter output"
TEMP = "backward temporaries"


class _Walk:
    """The engine's schedule replayed on the running sum: who is gathered, the two backward cursors, the window."""

    def __init__(self, s: _Schedule, units: Mapping[str, _Unit], schedule: Mapping[str, Any]) -> None:
        self.s = s
        self.units = units
        self.registration: list[str] = [u["name"] for u in schedule["units"]]
        self.gather_order: list[str] = list(schedule["gather_order"])
        self.reduce_order: list[str] = list(schedule["reduce_order"])
        self.where: dict[str, str] = dict.fromkeys(units, "sharded")  # "sharded", "in flight" or "gathered"
        self.events: list[tuple[str, str, str]] = []
        self.gather_cursor = 0
        self.reduce_cursor = 0
        self.done: set[str] = set()
        self.staged: set[str] = set()
        self.reducing: list[str] = []  # reductions whose input is alive, oldest first
        self.freed: dict[str, int] = {}  # unit -> full parameter elements freed early in this backward
        self.deferred: dict[str, tuple[str, int]] = {}  # unit -> (its prefetch target, elements to free first)
        self.landing: dict[str, str] = {}  # unit -> what it prefetched midway (copied out at its end)

    # ------------------------------------------------------------------ gathering
    def _start_gather(self, name: str) -> None:
        if self.where[name] != "sharded":
            return
        unit = self.units[name]
        self.s.add(AG, unit.gather)
        if unit.gather:
            self.events.append((self.s.phase, "all_gather", name))
        self.where[name] = "in flight"

    def _gather_now(self, name: str) -> None:
        """Copy-out of the unit's all-gather (issued now unless prefetched)."""
        if self.where[name] == "gathered":
            return
        self._start_gather(name)
        unit = self.units[name]
        self.s.add(GATHERED, unit.gathered)
        self.s.free(AG, unit.gather)
        self.where[name] = "gathered"

    def reshard(self, name: str) -> None:
        if self.where[name] == "gathered":
            self.s.free(GATHERED, self.units[name].gathered - self.freed.pop(name, 0))
            self.where[name] = "sharded"

    def gradients_made(self, name: str, shapes: Sequence[tuple[int, ...]]) -> None:
        """Gradients of parameters of ``name`` (these shapes) were accumulated: their full parameters are freed, and
        the unit's midway prefetch goes out once half its bytes are, after the reductions in flight completed."""
        unit = self.units[name]
        if self.s.phase != "backward" or self.where[name] != "gathered" or not unit.trainable:
            return
        freed = sum(unit.shards * padded_rows(shape[0], unit.shards) * _prod(shape[1:]) for shape in shapes if shape)
        self.s.free(GATHERED, freed)
        self.freed[name] = self.freed.get(name, 0) + freed
        deferred = self.deferred.get(name)
        if deferred is not None and self.freed[name] >= deferred[1]:
            self._wait_for_reductions()
            del self.deferred[name]
            self._start_gather(deferred[0])
            self.landing[name] = deferred[0]

    def _wait_for_reductions(self) -> None:
        while self.reducing:
            self.s.free(RS_IN, self.units[self.reducing.pop(0)].rs_in)

    def enter_forward(self, name: str) -> None:
        """A unit's pre-forward: gather it, prefetch the next unit in registration order."""
        self._gather_now(name)
        index = self.registration.index(name)
        if index + 1 < len(self.registration):
            self._start_gather(self.registration[index + 1])

    def end_forward(self, name: str) -> None:
        if self.units[name].reshards_after_forward:
            self.reshard(name)

    def enter_backward(self, name: str) -> None:
        """A unit's pre-backward: the gather cursor passes every unit up to it (each gathered, this one copied out),
        each followed by the prefetch of the next one in the order."""
        target = self.gather_order.index(name)
        while self.gather_cursor <= target:
            passed = self.gather_order[self.gather_cursor]
            self.gather_cursor += 1
            following = self.gather_order[self.gather_cursor] if self.gather_cursor < len(self.gather_order) else None
            if passed != name:
                self._start_gather(passed)
                if following is not None:
                    self._start_gather(following)
                continue
            self._gather_now(passed)
            unit = self.units[passed]
            if following is None:
                continue
            if unit.reshards_after_forward and unit.trainable:
                self.deferred[passed] = (following, unit.gathered // 2)
            else:
                self._wait_for_reductions()
                self._start_gather(following)

    # ------------------------------------------------------------------ reductions
    def end_backward(self, name: str) -> None:
        """A unit's post-backward: reshard, stage its gradients (then room is made), issue its prefetch if held back
        to here, issue reductions in order."""
        self.reshard(name)
        # What it prefetched midway lands now, before its gradients are staged (in a model run in registration order
        # every reduction before this unit's is issued by now, so the engine may wait for the all-gather here).
        landing = self.landing.pop(name, None)
        if landing is not None:
            self._gather_now(landing)
        unit = self.units[name]
        if unit.rs_in:
            self.s.add(RS_IN, unit.rs_in)
        self.s.free(GRAD, unit.full)
        if unit.rs_in:
            self._wait_for_reductions()  # a CPU device's window: after the filling, before the issue
        if name in self.deferred:
            self._wait_for_reductions()
            self._start_gather(self.deferred.pop(name)[0])
        self.done.add(name)
        while self.reduce_cursor < len(self.reduce_order) and self.reduce_order[self.reduce_cursor] in self.done:
            reduced = self.reduce_order[self.reduce_cursor]
            self.reduce_cursor += 1
            if self.units[reduced].trainable:
                self.s.add(RS_OUT, self.units[reduced].rs_out)  # at one rank: the staged buffer's copy
            if self.units[reduced].rs_in:
                self.events.append((self.s.phase, "reduce_scatter", reduced))
                self.reducing.append(reduced)

    def finish(self) -> None:
        """The final callback: wait for the reductions left."""
        self._wait_for_reductions()


def _forward(s: _Schedule, m: _Gpt, walk: _Walk, blocks: Mapping[int, str], root: str) -> None:
    n, d, f, h, v = m.n, m.d, m.f, m.h, m.v
    s.begin("forward")
    walk.enter_forward(root)
    s.add(ACT, n * d)  # token embedding
    s.add(ACT, n * d)  # x0 = embedding + positions
    s.free(ACT, n * d)
    for i in range(m.layers):
        unit = blocks.get(i)
        if unit is not None:
            walk.enter_forward(unit)
        s.add(ACT, n * d + 2 * n)  # ln1 output, mean/rstd
        s.add(ACT, 3 * n * d)  # qkv
        s.add(ACT, n * d + h * n)  # attention output, log-sum-exp
        s.add(ACT, n * d)  # output projection (transient)
        s.add(ACT, n * d)  # x1
        s.free(ACT, n * d)
        s.add(ACT, n * d + 2 * n)  # ln2
        s.add(ACT, n * f)  # fc
        s.add(ACT, n * f)  # gelu
        s.add(ACT, n * d)  # mlp projection (transient)
        s.add(ACT, n * d)  # x2
        s.free(ACT, n * d)
        if unit is not None:
            walk.end_forward(unit)
    s.add(ACT, n * d + 2 * n)  # ln_f
    s.add(ACT, n * v)  # logits
    walk.end_forward(root)
    s.add(ACT, 2 * n)  # targets made contiguous (int64)
    s.add(ACT, n * v)  # log-softmax
    s.add(ACT, 2)  # loss, total weight
    s.free(ACT, n * v)  # logits: the model's output, gone once the loss exists


def _block_backward(s: _Schedule, m: _Gpt, made: Callable[[Sequence[tuple[int, ...]]], None]) -> None:
    """One block's backward; starts with the gradient of its output (N D) alive, ends with its input's. ``made``:
    the shapes of the parameters whose gradients were just accumulated."""
    n, d, f, h = m.n, m.d, m.f, m.h
    s.add(TEMP, n * f)  # grad of the gelu output
    s.add(GRAD, d * f + d)  # mlp proj weight, bias
    made([(d, f), (d,)])
    s.free(ACT, n * f)  # saved gelu output
    s.add(TEMP, n * f)  # grad of the fc output
    s.free(TEMP, n * f)
    s.free(ACT, n * f)  # grad of the gelu output, saved fc output
    s.add(TEMP, n * d)  # grad of the ln2 output
    s.add(GRAD, d * f + f)  # fc weight, bias
    made([(f, d), (f,)])
    s.free(TEMP, n * f)
    s.free(ACT, n * d)  # grad of the fc output, saved ln2 output
    s.add(TEMP, n * d)  # ln2 backward: grad of its input
    s.add(GRAD, 2 * d)
    made([(d,), (d,)])
    s.free(TEMP, n * d)
    s.free(ACT, n * d + 2 * n)  # grad of the ln2 output, saved x1, ln2 mean/rstd
    s.add(TEMP, n * d)  # residual: grad of x1
    s.free(TEMP, 2 * n * d)
    s.add(TEMP, n * d)  # attention projection: grad of its input
    s.add(GRAD, d * d + d)
    made([(d, d), (d,)])
    s.add(TEMP, 3 * n * d)  # attention backward: grads of q, k, v
    s.free(TEMP, n * d)
    s.free(ACT, 4 * n * d + h * n)  # grad of the projection input, attention output, lse, qkv
    s.add(TEMP, 3 * n * d)  # stacked q, k, v grads
    s.free(TEMP, 3 * n * d)
    s.add(TEMP, 3 * n * d)  # made contiguous
    s.free(TEMP, 3 * n * d)
    s.add(TEMP, n * d)  # qkv backward: grad of the ln1 output
    s.add(GRAD, 3 * d * d + 3 * d)
    made([(3 * d, d), (3 * d,)])
    s.free(TEMP, 3 * n * d)
    s.free(ACT, n * d)  # grad of qkv, saved ln1 output
    s.add(TEMP, n * d)  # ln1 backward
    s.add(GRAD, 2 * d)
    made([(d,), (d,)])
    s.free(TEMP, n * d)
    s.free(ACT, n * d + 2 * n)  # grad of the ln1 output, saved block input, ln1 mean/rstd
    s.add(TEMP, n * d)  # residual: grad of the block input
    s.free(TEMP, 2 * n * d)


def _backward(s: _Schedule, m: _Gpt, walk: _Walk, blocks: Mapping[int, str], root: str, agreement: int) -> None:
    n, d, v = m.n, m.d, m.v
    s.begin("backward")
    s.add(TEMP, 1)  # d loss
    s.add(TEMP, n * v)  # grad of the log-probabilities
    s.free(TEMP, 1)
    s.free(ACT, 2 * n)  # nll backward done: d loss, saved targets
    s.add(TEMP, n * v)  # grad of the logits
    s.free(TEMP, n * v)
    s.free(ACT, n * v)  # and the saved log-probabilities
    # The backward's agreement (agreement.start_agreement): int64s, in flight until the end of backward.
    s.add(TEMP, agreement)
    walk.enter_backward(root)  # the root's outputs are the loss's inputs: its pre-backward comes first
    s.add(GRAD, v * d)  # head weight
    walk.gradients_made(root, [(v, d)])
    s.add(TEMP, n * d)  # grad of the ln_f output
    s.free(TEMP, n * v)
    s.free(ACT, n * d)  # grad of the logits, saved ln_f output
    s.add(TEMP, n * d)  # ln_f backward
    s.add(GRAD, 2 * d)
    walk.gradients_made(root, [(d,), (d,)])
    s.free(TEMP, n * d)
    s.free(ACT, n * d + 2 * n)  # grad of the ln_f output, saved x_L, mean/rstd
    for i in reversed(range(m.layers)):
        unit = blocks.get(i)
        if unit is not None:
            walk.enter_backward(unit)
        owner = unit if unit is not None else root
        _block_backward(s, m, lambda shapes, owner=owner: walk.gradients_made(owner, shapes))  # type: ignore[misc]
        if unit is not None:
            walk.end_backward(unit)
    s.add(TEMP, m.t * d)  # positions: sum over the batch
    s.add(GRAD, m.p * d)  # padded to all positions
    walk.gradients_made(root, [(m.p, d)])
    s.free(TEMP, m.t * d)
    s.add(GRAD, v * d)  # token embedding
    walk.gradients_made(root, [(v, d)])
    s.free(TEMP, n * d)  # grad of x0
    walk.end_backward(root)
    walk.finish()
    s.free(TEMP, agreement)
    s.free(ACT, 2)  # the loss is released after backward


def _optimizer(s: _Schedule, config: PlanConfig, shapes: Sequence[tuple[int, ...]], shard_rank: int) -> None:
    """AdamW's per-parameter loop computes ``denom = sqrt(exp_avg_sq) / c`` (two temporaries of the parameter's
    local size while the division runs) while the previous parameter's ``denom`` is still referenced; SGD updates
    in place."""
    s.begin("optimizer")
    if config.optimizer != "adamw":
        return
    local = [owned_rows(shape[0], config.shard, shard_rank) * _prod(shape[1:]) if shape else 1 for shape in shapes]
    previous = 0
    for numel in local:
        s.add(TEMP, 2 * numel)
        s.free(TEMP, 2 * numel + previous)
        s.add(TEMP, numel)
        previous = numel
    s.free(TEMP, previous)


def _prod(shape: Sequence[int]) -> int:
    result = 1
    for size in shape:
        result *= size
    return result


def _unsupported(config: PlanConfig, record: StepRecord) -> str | None:
    desc = record.model
    if any(desc.get(key) is None for key in ("dim", "mlp_ratio", "n_heads", "vocab_size", "n_layers", "seq_len")):
        return "the analytic peak model covers the GPT (gpt.py)"
    if config.replicate > 1 or config.tp > 1:
        return "the analytic peak model covers 1-D meshes"
    if config.param_dtype not in (None, "fp32") or config.reduce_dtype not in (None, "fp32"):
        return "the analytic peak model covers fp32 training"
    if config.activation_checkpointing or config.reshard_after_forward is not True or config.foreach:
        return "the analytic peak model covers reshard_after_forward=True, no checkpointing, foreach=False"
    units = record.schedule.get("units")
    if not units:
        return "no schedule recorded"
    for unit in units:
        expected = ["GPT"] if unit["root"] else ["Block"]
        if unit["classes"] != expected or (not unit["root"] and _block_index(unit["name"]) is None):
            return "the analytic peak model covers the GPT's root and single blocks (blocks.i) as units"
    return None


def _block_index(name: str) -> int | None:
    prefix, _, index = name.partition(".")
    return int(index) if prefix == "blocks" and index.isdigit() else None


def peak_model(config: PlanConfig, record: StepRecord) -> PeakModel | None:
    """The modelled peak bytes per phase of ``record``'s configuration, or ``None`` outside the model's scope.

    The order of the collectives and of what they free is the engine's declared schedule of the measured model
    (``record.schedule``); the sizes are closed forms of the GPT's shape (see the module docstring).
    """
    if _unsupported(config, record) is not None:
        return None
    desc = record.model
    d = int(desc["dim"])
    m = _Gpt(
        n=config.batch_size * record.seq_len,
        d=d,
        f=int(desc["mlp_ratio"]) * d,
        h=int(desc["n_heads"]),
        v=int(desc["vocab_size"]),
        p=int(desc["seq_len"]),
        t=record.seq_len,
        layers=int(desc["n_layers"]),
    )
    shards = config.shard

    def unit(infos: Sequence[ParamInfo], collectives: Sequence[str], reshards: bool) -> _Unit:
        seg = segment_numel(infos, shards)
        scalars = sum(1 for p in infos if p.trainable and not p.shape)
        full = sum(_prod(p.shape) for p in infos)
        gather = shards * seg if "all_gather(forward)" in collectives else 0
        reduces = "reduce_scatter" in collectives
        return _Unit(
            full=full,
            gathered=shards * seg,
            gather=gather,
            rs_in=shards * (seg + scalars) if reduces else 0,
            rs_out=seg + scalars,
            trainable=any(p.trainable for p in infos),
            reshards_after_forward=reshards,
            shards=shards,
        )

    schedule = record.schedule
    units = {
        u["name"]: unit(record.unit_params[u["name"]], u["collectives"], u["reshards_after_forward"])
        for u in schedule["units"]
    }
    root = next(u["name"] for u in schedule["units"] if u["root"])
    blocks: dict[int, str] = {}
    for name in units:
        index = _block_index(name)
        if name != root and index is not None:
            blocks[index] = name
    state = sharded_state(record.unit_params, config)
    batch = config.batch_size * (record.seq_len + 1) * 8
    start = {
        "sharded parameters": state.params // 4,
        "optimizer state": state.optimizer // 4,
        "batch": batch // 4,
    }
    running = _Schedule(start)
    walk = _Walk(running, units, schedule)
    _forward(running, m, walk, blocks, root)
    params = sum(len(record.unit_params[u["name"]]) for u in schedule["units"])
    # One int64 (two 4-byte elements) per unit, per parameter, per rank, and the two fingerprint halves.
    agreement = 2 * (len(units) + params + config.world_size + 2) if config.world_size > 1 else 0
    _backward(running, m, walk, blocks, root, agreement)
    shard_rank = config.rank % shards
    _optimizer(running, config, record.optimizer_shapes, shard_rank)
    return PeakModel(
        peaks={phase: 4 * total for phase, total in running.peaks.items()},
        at_peak={phase: {k: 4 * v for k, v in live.items()} for phase, live in running.at_peak.items()},
        events=walk.events,
    )
