"""An analytic model of one rank's live bytes through a training step of the GPT preset (docs/planner.md).

The model replays, allocation by allocation, what a step of the preset GPT keeps alive on one rank under
fsdp_compose (1-D mesh, fp32, blocks resharded after forward, the root kept, AdamW / SGD per-parameter loop,
no activation checkpointing), with sizes in closed form. Notation (elements; fp32 = 4 bytes each): ``N = batch x
seq`` tokens, ``D`` width, ``F = mlp_ratio x D``, ``H`` heads, ``V`` vocabulary, ``P`` the learned positions,
``S`` shard-group size. Per unit ``u``: ``seg_u`` the padded segment (analytic.py),
``full_u`` its unsharded elements (its full gradients); full parameters and all-gather buffer
``S seg_u`` each (the full parameters live in one padded buffer, see unit.py), reduce-scatter input
``S (seg_u + Z_u)`` and output ``seg_u + Z_u`` (``Z_u``: its trainable 0-dim parameters; none in the preset).

Activations one block keeps for backward: ``A = 16 N D + H N + 4 N`` (LayerNorm inputs and outputs, the qkv
projection ``3 N D``, attention output ``N D`` and log-sum-exp ``H N``, MLP hidden before and after GELU ``2 N F``,
the two residual sums; two mean/rstd pairs ``4 N``). The steps of the schedule (each ``+`` an allocation, each
``-`` a release) are in :func:`_forward` and :func:`_backward`; the peak of a phase is the largest running sum.
Configurations outside this scope get no model (``None``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .analytic import owned_rows, segment_numel, sharded_state
from .step import ParamInfo, PlanConfig, StepRecord

__all__ = ["PeakModel", "peak_model"]


@dataclass(frozen=True)
class PeakModel:
    """Modelled peak bytes per phase, and the live bytes at each peak by term."""

    peaks: dict[str, int]
    at_peak: dict[str, dict[str, int]] = field(default_factory=dict)

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
        assert self.live[term] >= 0, term

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
    gather: int  # S * seg
    rs_in: int  # S * (seg + T)
    rs_out: int  # seg + T


ACT = "activations"
GATHERED = "gathered parameters"
AG = "all-gather buffers"
GRAD = "unsharded gradients"
RS_IN = "reduce-scatter input"
RS_OUT = "reduce-scatter output"
TEMP = "backward temporaries"


def _forward(s: _Schedule, m: _Gpt, blocks: Sequence[_Unit], root: _Unit) -> None:
    n, d, f, h, v = m.n, m.d, m.f, m.h, m.v
    s.begin("forward")
    s.add(AG, root.gather)  # root pre-forward: all-gather, copy out, free the buffer
    s.add(GATHERED, root.gathered)
    s.free(AG, root.gather)
    if blocks:
        s.add(AG, blocks[0].gather)  # prefetch of the first block
    s.add(ACT, n * d)  # token embedding
    s.add(ACT, n * d)  # x0 = embedding + positions
    s.free(ACT, n * d)
    for i, block in enumerate(blocks):
        s.add(GATHERED, block.gathered)  # copy out of the (prefetched) all-gather
        s.free(AG, block.gather)
        if i + 1 < len(blocks):
            s.add(AG, blocks[i + 1].gather)  # prefetch of the next block
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
        s.free(GATHERED, block.gathered)  # reshard after forward
    s.add(ACT, n * d + 2 * n)  # ln_f
    s.add(ACT, n * v)  # logits
    s.add(ACT, 2 * n)  # targets made contiguous (int64)
    s.add(ACT, n * v)  # log-softmax
    s.add(ACT, 2)  # loss, total weight
    s.free(ACT, n * v)  # logits: the model's output, gone once the loss exists


def _block_backward(s: _Schedule, m: _Gpt) -> None:
    """One block's backward; starts with the gradient of its output (N D) alive, ends with its input's."""
    n, d, f, h = m.n, m.d, m.f, m.h
    s.add(TEMP, n * f)  # grad of the gelu output
    s.add(GRAD, d * f + d)  # mlp proj weight, bias
    s.free(ACT, n * f)  # saved gelu output
    s.add(TEMP, n * f)  # grad of the fc output
    s.free(TEMP, n * f)
    s.free(ACT, n * f)  # grad of the gelu output, saved fc output
    s.add(TEMP, n * d)  # grad of the ln2 output
    s.add(GRAD, d * f + f)  # fc weight, bias
    s.free(TEMP, n * f)
    s.free(ACT, n * d)  # grad of the fc output, saved ln2 output
    s.add(TEMP, n * d)  # ln2 backward: grad of its input
    s.add(GRAD, 2 * d)
    s.free(TEMP, n * d)
    s.free(ACT, n * d + 2 * n)  # grad of the ln2 output, saved x1, ln2 mean/rstd
    s.add(TEMP, n * d)  # residual: grad of x1
    s.free(TEMP, 2 * n * d)
    s.add(TEMP, n * d)  # attention projection: grad of its input
    s.add(GRAD, d * d + d)
    s.add(TEMP, 3 * n * d)  # attention backward: grads of q, k, v
    s.free(TEMP, n * d)
    s.free(ACT, 4 * n * d + h * n)  # grad of the projection input, attention output, lse, qkv
    s.add(TEMP, 3 * n * d)  # stacked q, k, v grads
    s.free(TEMP, 3 * n * d)
    s.add(TEMP, 3 * n * d)  # made contiguous
    s.free(TEMP, 3 * n * d)
    s.add(TEMP, n * d)  # qkv backward: grad of the ln1 output
    s.add(GRAD, 3 * d * d + 3 * d)
    s.free(TEMP, 3 * n * d)
    s.free(ACT, n * d)  # grad of qkv, saved ln1 output
    s.add(TEMP, n * d)  # ln1 backward
    s.add(GRAD, 2 * d)
    s.free(TEMP, n * d)
    s.free(ACT, n * d + 2 * n)  # grad of the ln1 output, saved block input, ln1 mean/rstd
    s.add(TEMP, n * d)  # residual: grad of the block input
    s.free(TEMP, 2 * n * d)


def _backward(s: _Schedule, m: _Gpt, blocks: Sequence[_Unit], root: _Unit) -> None:
    n, d, v = m.n, m.d, m.v
    s.begin("backward")
    s.add(TEMP, 1)  # d loss
    s.add(TEMP, n * v)  # grad of the log-probabilities
    s.free(TEMP, 1)
    s.free(ACT, 2 * n)  # nll backward done: d loss, saved targets
    s.add(TEMP, n * v)  # grad of the logits
    s.free(TEMP, n * v)
    s.free(ACT, n * v)  # and the saved log-probabilities
    if blocks:
        s.add(AG, blocks[-1].gather)  # root pre-backward: prefetch of the last block
    s.add(GRAD, v * d)  # head weight
    s.add(TEMP, n * d)  # grad of the ln_f output
    s.free(TEMP, n * v)
    s.free(ACT, n * d)  # grad of the logits, saved ln_f output
    s.add(TEMP, n * d)  # ln_f backward
    s.add(GRAD, 2 * d)
    s.free(TEMP, n * d)
    s.free(ACT, n * d + 2 * n)  # grad of the ln_f output, saved x_L, mean/rstd
    in_flight: _Unit | None = None
    for i in reversed(range(len(blocks))):
        block = blocks[i]
        s.add(GATHERED, block.gathered)  # copy out of the prefetched all-gather
        s.free(AG, block.gather)
        if i > 0:
            s.add(AG, blocks[i - 1].gather)
        _block_backward(s, m)
        s.free(GATHERED, block.gathered)  # reshard after backward
        if in_flight is not None:
            s.free(RS_IN, in_flight.rs_in)  # the previous reduce-scatter is waited for
        s.add(RS_IN, block.rs_in)  # gradients copied into the reduce-scatter input ...
        s.free(GRAD, block.full)  # ... and the full gradients released
        s.add(RS_OUT, block.rs_out)
        in_flight = block
    s.add(TEMP, m.t * d)  # positions: sum over the batch
    s.add(GRAD, m.p * d)  # padded to all positions
    s.free(TEMP, m.t * d)
    s.add(GRAD, v * d)  # token embedding
    s.free(TEMP, n * d)  # grad of x0
    if in_flight is not None:
        s.free(RS_IN, in_flight.rs_in)
    s.free(GATHERED, root.gathered)  # the root reshards after backward
    s.add(RS_IN, root.rs_in)
    s.free(GRAD, root.full)
    s.add(RS_OUT, root.rs_out)
    s.free(RS_IN, root.rs_in)
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
    if record.model.get("model") not in ("gpt", "gpt-124m"):
        return "the analytic peak model covers the GPT presets"
    if config.replicate > 1 or config.tp > 1:
        return "the analytic peak model covers 1-D meshes"
    if config.param_dtype not in (None, "fp32") or config.reduce_dtype not in (None, "fp32"):
        return "the analytic peak model covers fp32 training"
    if config.activation_checkpointing or config.reshard_after_forward is not True or config.foreach:
        return "the analytic peak model covers reshard_after_forward=True, no checkpointing, foreach=False"
    if record.model.get("mlp_ratio") is None:
        return "unknown model shape"
    return None


def peak_model(config: PlanConfig, record: StepRecord) -> PeakModel | None:
    """The modelled peak bytes per phase of ``record``'s configuration, or ``None`` outside the model's scope."""
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

    def unit(infos: Sequence[ParamInfo]) -> _Unit:
        seg = segment_numel(infos, shards)
        tail = sum(1 for p in infos if p.trainable and not p.shape)  # 0-dim gradients (no flags: grads.py)
        full = sum(_prod(p.shape) for p in infos)
        gather = shards * seg if shards > 1 else 0
        rs_in = shards * (seg + tail) if shards > 1 else 0
        return _Unit(full=full, gathered=shards * seg, gather=gather, rs_in=rs_in, rs_out=seg + tail)

    units = record.unit_params
    blocks = [unit(units[f"blocks.{i}"]) for i in range(m.layers)]
    root = unit(units["root"])
    state = sharded_state(units, config)
    batch = config.batch_size * (record.seq_len + 1) * 8
    start = {
        "sharded parameters": state.params // 4,
        "optimizer state": state.optimizer // 4,
        "batch": batch // 4,
    }
    schedule = _Schedule(start)
    _forward(schedule, m, blocks, root)
    _backward(schedule, m, blocks, root)
    shard_rank = config.rank % shards
    _optimizer(schedule, config, record.optimizer_shapes, shard_rank)
    return PeakModel(
        peaks={phase: 4 * total for phase, total in schedule.peaks.items()},
        at_peak={phase: {k: 4 * v for k, v in live.items()} for phase, live in schedule.at_peak.items()},
    )
