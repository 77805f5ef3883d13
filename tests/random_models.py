"""Random configurations for tests/test_randomized.py: what to build, how to shard it and how to train it.

A configuration is a frozen dataclass (picklable: it is sent to the pool workers; its ``repr`` is valid Python, so a
failing case can be pasted back). It is drawn by ``draw_config`` through a ``Chooser``: Hypothesis draws it (and
shrinks it) in the tests, ``random.Random(seed)`` draws it for ``config_from_seed`` (re-runnable by a seed).
Every decision lives in the configuration, so all ranks build, shard and train identically; the per-rank
differences are deliberate: the ``side`` unit's output reaches the loss on even ranks only (``side="even"``), and a
fault of kind ``loss_one`` / ``backward_one`` raises on one rank only.

Graph shapes (issue 20): a block unit called twice in one forward (``BlockSpec.calls``), blocks returning a tuple,
dict, dataclass or namedtuple (``BlockSpec.output``), the head in a unit of its own or grouped with a final norm
(``head_unit``, ``fully_shard([norm, head])``), a chunked loss that calls the head once per chunk outside the root's
forward, each chunk with its own backward into a detached leaf, then the body's backward (``loss="chunked"``, as
torchtitan does: a grouped unit whose members run in different forwards), evaluation forwards between a training
forward and its backward (``mid_evals``, with ``full_precision_eval``), and collective checks (``collective_checks``).

Only the public API (``fsdp_compose`` as ``fc``) and torch are used here.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import fsdp_compose as fc

T = TypeVar("T")
SEQ = 3  # sequence length of every sample: (batch, SEQ, dim)
Raf = bool | int | None  # a reshard_after_forward value; None = fully_shard's default


# ----------------------------------------------------------------------------------------------- configuration
@dataclass(frozen=True)
class LayerSpec:
    kind: str  # "mlp" | "norm" | "conv" | "scalar" (0-dim parameter) | "tied" (two Linears sharing one weight)
    rows: int  # odd dim-0 size of the hidden layer (1, 3, 5, 7): uneven over 2 and 4 ranks, some ranks own none


@dataclass(frozen=True)
class BlockSpec:
    layers: tuple[LayerSpec, ...]
    shard: bool  # the block is a unit of its own (else its parameters belong to the root's unit)
    inner: tuple[LayerSpec, ...] | None = None  # a nested sub-block (its ``lin`` first, then these layers)
    inner_shard: bool = False  # the nested sub-block is a unit (inside the block's unit when ``shard``)
    tie_inner: bool = False  # block.proj.weight IS inner.lin.weight (a tie across units when inner_shard)
    ckpt: str = "none"  # "none" | "around" (the root checkpoints the whole block) | "inside" (the block checkpoints
    #                     its nested sub-block, or its first layer)
    raf: Raf = None  # reshard_after_forward of the block's unit
    inner_raf: Raf = None
    calls: int = 1  # the block (and its nested sub-block) runs this many times in one forward: a reused unit
    output: str = "tensor"  # "tensor" | "tuple" | "dict" | "dataclass" | "namedtuple": what the block returns


@dataclass(frozen=True)
class CaseConfig:
    ws: int
    seed: int = 0  # initialization and data
    steps: int = 2
    dim: int = 5
    vocab: int = 3  # rows of the embedding-like weight
    batch: int = 1  # samples per rank per micro-batch
    micro_batches: int = 1  # > 1: all but the last run under fc.no_sync
    accumulation: str = "unsharded"  # fc.set_gradient_accumulation mode
    blocks: tuple[BlockSpec, ...] = (BlockSpec((LayerSpec("mlp", 3),), True),)
    embed_unit: bool = False  # the embedding is a unit
    tie_embed: str = "none"  # "none" | "lift" (head.weight IS embed.weight; the root lifts it out of embed's unit)
    #                           | "list" (one unit for [embed, head]: fully_shard of a list)
    embed_raf: Raf = None
    side: str = "none"  # "none" | "all" | "even": a branch run on every rank whose output reaches the loss on all /
    #                      even ranks only
    side_unit: bool = True  # the branch is a unit (else it is in the root's unit, as docs/frozen.md advises)
    side_raf: Raf = None  # with side="even" always False: a unit that re-gathers for backward on some ranks only
    #                       issues an all-gather the other ranks never join (documented: not supported, as in FSDP2)
    unused_unit: bool = False  # a unit that is never called
    root_scalar: bool = False  # a 0-dim parameter in the root's unit
    root_raf: Raf = None
    input_grad: bool = False  # the inputs require grad (the root's post-backward fires from autograd)
    raf_via_setter: bool = False  # apply the raf values with fc.set_reshard_after_forward instead of fully_shard
    reshard_after_backward: bool = True  # False: fc.set_reshard_after_backward(model, False)
    mp: str = "none"  # "none" | "blocks" (bf16 blocks and their nested units, fp32 root) | "all" (bf16 everywhere)
    frozen_params: str = "shard"
    manual_refresh: bool = False  # auto_refresh_trainable=False + fc.refresh_trainable after every change
    prefetch: str = "default"  # "default" | "off" (empty lists) | "random" (the pairs below)
    prefetch_pairs: tuple[tuple[str, int, int], ...] = ()  # ("f" | "b", source unit index, target unit index)
    optimizer: str = "sgd"  # "sgd" | "adamw"
    clip: float = 0.0  # > 0: fc.clip_grad_norm_ (reference: torch.nn.utils.clip_grad_norm_) before every step
    trainability: tuple[tuple[int, str, int, bool], ...] = ()  # (step, "param" | "module", index, requires_grad)
    evals: tuple[tuple[int, str], ...] = ()  # (step, "grad" | "no_grad"): a forward without backward before it
    faults: tuple[tuple[int, str, int], ...] = ()  # (step, kind, index): a micro-batch thrown away before the real
    #   ones. "forward" | "backward": an exception in block ``index`` on every rank (caught); "discard": a no-sync
    #   backward followed by zero_grad; "loss_one": the loss raises on rank ``index % ws`` only, which calls
    #   fc.reset_step (which returns), and every other rank must get fc's StepAbandoned; "backward_one": block
    #   ``index`` raises in backward on rank ``index % ws`` only, which calls fc.reset_step (the others' backward
    #   completes)
    head_unit: str = "none"  # "none" (the head is in the root's unit) | "head" (a unit of its own) | "norm_head"
    #                           (a final LayerNorm ``norm`` and the head as one unit: fully_shard([norm, head]))
    head_raf: Raf = None
    loss: str = "plain"  # "plain" | "chunked": the head runs per chunk of rows outside the root's forward, each chunk
    #                       with its own backward into a detached leaf, then the body's backward (torchtitan's loss)
    chunks: int = 2
    mid_evals: tuple[tuple[int, str], ...] = ()  # (step, "no_grad" | "grad"): after the step's last training forward,
    #   before its backward, the model in eval mode runs a forward (no_grad, or with grad and never backwarded); its
    #   output is compared with an unsharded copy of the current parameters
    full_precision_eval: bool = False  # fc.set_full_precision_in_eval(model): eval forwards in the parameters' dtype
    collective_checks: bool = False  # fc.set_collective_checks(model)
    reentrant: bool = False  # activation checkpoints use use_reentrant=True (where the checkpointed call returns a
    #                           tensor; the unsharded copy checkpoints the same way)
    backward_twice: bool = False  # the plain loss's backward in two halves, the first with retain_graph=True
    # A mesh per parameter: the "mlp" layers' parameters on another data-parallel mesh (FSDP2's ShardPlacementResult),
    # HSDP (2, ws / 2): at 2 ranks a shard group of one rank; at 1 rank the (1, 1) mesh. Not for units whose
    # reshard_after_forward is a group size (refused with a mesh per parameter).
    mlp_mesh: bool = False
    sabotage: str = ""  # harness self-test only, never drawn: "skip_step" = the sharded side skips step 1's update


class Chooser:
    """How ``draw_config`` makes a decision; the first option / smallest value / False is the simplest."""

    def int(self, lo: int, hi: int) -> int:
        raise NotImplementedError

    def pick(self, options: Sequence[T]) -> T:
        return options[self.int(0, len(options) - 1)]

    def weighted(self, options: Sequence[tuple[T, int]]) -> T:
        value = self.int(0, sum(w for _, w in options) - 1)
        for option, weight in options:
            if value < weight:
                return option
            value -= weight
        raise AssertionError("unreachable")

    def flag(self, percent: int) -> bool:
        return self.int(0, 99) >= 100 - percent  # shrinks to 0: False


class RandomChooser(Chooser):
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def int(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)


class DrawChooser(Chooser):
    """Decisions through Hypothesis' ``draw`` (inside ``st.composite``), so failures shrink."""

    def __init__(self, draw: Callable[[Any], Any]) -> None:
        from hypothesis import strategies as st

        self.draw, self.st = draw, st

    def int(self, lo: int, hi: int) -> int:
        return int(self.draw(self.st.integers(lo, hi)))


def _raf(ch: Chooser, ws: int) -> Raf:
    ks = [k for k in (1, 2, 4) if ws % k == 0 and 1 < k < ws]  # ints that mean neither True nor False
    return ch.weighted([(None, 40), (True, 20), (False, 20), *[(k, 20) for k in ks]])


def _layers(ch: Chooser, n_max: int) -> tuple[LayerSpec, ...]:
    kinds = [("mlp", 30), ("norm", 15), ("conv", 20), ("scalar", 15), ("tied", 15)]
    return tuple(LayerSpec(ch.weighted(kinds), ch.pick((3, 1, 5, 7))) for _ in range(ch.int(1, n_max)))


def draw_config(ch: Chooser, ws: int, seed: int) -> CaseConfig:
    steps = ch.int(2, 4)
    mp = ch.weighted([("none", 60), ("blocks", 25), ("all", 15)])
    blocks = []
    for _ in range(ch.int(1, 3)):
        inner = _layers(ch, 2) if ch.flag(50) else None
        shard, inner_shard = not ch.flag(20), inner is not None and ch.flag(70)
        tie_inner = inner is not None and ch.flag(35)
        if tie_inner and inner_shard and not shard and mp == "blocks":
            tie_inner = False  # the root (fp32) would take the weight the bf16 inner unit computes with
        blocks.append(
            BlockSpec(
                layers=_layers(ch, 3),
                shard=shard,
                inner=inner,
                inner_shard=inner_shard,
                tie_inner=tie_inner,
                ckpt=ch.weighted([("none", 60), ("around", 20), ("inside", 20)]),
                raf=_raf(ch, ws),
                inner_raf=_raf(ch, ws),
            )
        )
    n_units = 1 + sum(b.shard + b.inner_shard for b in blocks) + 3  # upper bound: embed, side, unused
    micro_batches = ch.weighted([(1, 50), (2, 30), (3, 20)])
    events = []
    for _ in range(ch.weighted([(0, 40), (1, 25), (2, 20), (3, 15)])):
        events.append((ch.int(0, steps - 1), ch.pick(("module", "param")), ch.int(0, 63), ch.flag(40)))
    evals = tuple((s, ch.pick(("grad", "no_grad"))) for s in range(1, steps) if ch.flag(20))
    faults = ()
    if ch.flag(12):
        faults = ((ch.int(0, steps - 1), ch.pick(("forward", "backward", "discard")), ch.int(0, 2)),)
    side = ch.weighted([("none", 55), ("all", 20), ("even", 25)])
    side_unit = side != "none" and not ch.flag(25)
    prefetch = ch.weighted([("default", 60), ("off", 20), ("random", 20)])
    pairs = ()
    if prefetch == "random":
        pairs = tuple(
            (ch.pick(("f", "b")), ch.int(0, n_units - 1), ch.int(0, n_units - 1)) for _ in range(ch.int(1, 4))
        )
    cfg = CaseConfig(
        ws=ws,
        seed=seed,
        steps=steps,
        dim=ch.pick((5, 3)),
        vocab=ch.pick((3, 1, 5, 7)),
        batch=ch.int(1, 2),
        micro_batches=micro_batches,
        accumulation=ch.pick(("unsharded", "sharded")),
        blocks=tuple(blocks),
        embed_unit=ch.flag(60),
        tie_embed=ch.weighted([("none", 60), ("lift", 25), ("list", 15)]),
        embed_raf=_raf(ch, ws),
        side=side,
        side_unit=side_unit,
        side_raf=False if side == "even" else _raf(ch, ws),
        unused_unit=ch.flag(25),
        root_scalar=ch.flag(30),
        root_raf=_raf(ch, ws),
        input_grad=ch.flag(15),
        raf_via_setter=ch.flag(25),
        reshard_after_backward=not ch.flag(15),
        mp=mp,
        frozen_params=ch.pick(("shard", "replicate")),
        manual_refresh=ch.flag(15),
        prefetch=prefetch,
        prefetch_pairs=pairs,
        optimizer=ch.pick(("sgd", "adamw")),
        clip=1.0 if ch.flag(30) else 0.0,
        trainability=tuple(events),
        evals=evals,
        faults=faults,
    )
    return _draw_graph_shapes(ch, cfg)


def _draw_graph_shapes(ch: Chooser, cfg: CaseConfig) -> CaseConfig:
    """The graph-shape dimensions (issue 20), drawn after the others so a seed keeps its earlier decisions."""
    ws, steps = cfg.ws, cfg.steps
    outputs = [("tensor", 60), ("tuple", 10), ("dict", 10), ("dataclass", 10), ("namedtuple", 10)]
    blocks = tuple(
        dataclasses.replace(b, calls=ch.weighted([(1, 70), (2, 30)]), output=ch.weighted(outputs)) for b in cfg.blocks
    )
    head_unit = ch.weighted([("none", 40), ("head", 25), ("norm_head", 35)]) if cfg.tie_embed == "none" else "none"
    chunked = (head_unit != "none" or cfg.tie_embed == "list") and ch.flag(50)
    faults = cfg.faults
    one_rank = ch.flag(15)
    if one_rank:
        faults = (*faults, (ch.int(0, steps - 1), ch.pick(("loss_one", "backward_one")), ch.int(0, 3)))
    mid_evals = tuple((s, ch.weighted([("no_grad", 75), ("grad", 25)])) for s in range(steps) if ch.flag(20))
    side_raf = cfg.side_raf
    if cfg.side == "even" and ch.flag(40):
        side_raf = _raf(ch, ws)  # a unit re-gathered for backward although this rank's loss may not reach it
    cfg = dataclasses.replace(
        cfg,
        blocks=blocks,
        head_unit=head_unit,
        head_raf=_raf(ch, ws),
        loss="chunked" if chunked else "plain",
        chunks=ch.pick((2, 3)),
        faults=faults,
        mid_evals=mid_evals,
        full_precision_eval=cfg.mp != "none" and ch.flag(50),
        collective_checks=ch.flag(60 if one_rank else 30),
        side_raf=side_raf,
        reentrant=ch.flag(30),
    )
    # Drawn after every earlier decision, so a seed keeps them.
    cfg = dataclasses.replace(cfg, backward_twice=cfg.loss == "plain" and ch.flag(35))
    return dataclasses.replace(cfg, mlp_mesh=ch.flag(25))


def config_from_seed(seed: int, ws: int | None = None) -> CaseConfig:
    """The configuration of a seed (the world size drawn from it too unless given): re-runnable anywhere."""
    ch = RandomChooser(seed)
    drawn_ws = ch.weighted([(1, 20), (2, 50), (4, 30)])
    return draw_config(ch, ws or drawn_ws, seed)


# ----------------------------------------------------------------------------------------------- the model
class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("injected fault in backward")


class MLP(nn.Module):
    def __init__(self, d: int, r: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, r), nn.Linear(r, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.tanh(self.up(h)))


class Conv(nn.Module):
    def __init__(self, d: int, r: int) -> None:
        super().__init__()
        self.conv, self.mix = nn.Conv1d(d, r, 3, padding=1), nn.Conv1d(r, d, 1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mix(torch.tanh(self.conv(h.transpose(1, 2)))).transpose(1, 2)


class Scalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(1.0 + 0.1 * torch.randn(()))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.scale


class TiedPair(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d, bias=False)
        self.b.weight = self.a.weight  # a tie inside one unit

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.b(torch.tanh(self.a(h))))


def make_layer(spec: LayerSpec, d: int) -> nn.Module:
    if spec.kind == "mlp":
        return MLP(d, spec.rows)
    if spec.kind == "conv":
        return Conv(d, spec.rows)
    if spec.kind == "norm":
        # eps 0.1, not 1e-5: normalising 3 to 5 nearly equal features divides by a tiny deviation and amplifies the
        # inputs' bf16 rounding. `python -m tests.random_sweep --seeds 116 --ws 4` had a gradient 3.8 off on 4.2, as
        # far off as a single-process model with the same bf16 blocks; with a bounded deviation it lands at 3e-3.
        return nn.LayerNorm(d, eps=0.1)
    if spec.kind == "scalar":
        return Scalar()
    return TiedPair(d)


class Inner(nn.Module):
    def __init__(self, layers: tuple[LayerSpec, ...], d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.layers = nn.ModuleList(make_layer(s, d) for s in layers)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + torch.tanh(self.lin(h))
        for layer in self.layers:
            h = layer(h)
        return h


class BlockTuple(NamedTuple):
    h: torch.Tensor
    gate: torch.Tensor
    tag: str


@dataclass
class BlockData:
    h: torch.Tensor
    gate: torch.Tensor
    tag: str = "block"


def pack(kind: str, h: torch.Tensor) -> Any:
    """The block's output as ``kind`` says: ``h`` and a gate computed from it (both need grad), and a non-tensor."""
    if kind == "tensor":
        return h
    gate = torch.tanh(h.mean(dim=-1, keepdim=True))
    if kind == "tuple":
        return (h, gate, "block")
    if kind == "dict":
        return {"h": h, "gate": gate, "tag": "block"}
    if kind == "dataclass":
        return BlockData(h, gate)
    return BlockTuple(h, gate, "block")


def unpack(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, BlockTuple | BlockData):
        return out.h + 0.1 * out.gate
    if isinstance(out, dict):
        return out["h"] + 0.1 * out["gate"]
    return out[0] + 0.1 * out[1]


class Block(nn.Module):
    def __init__(self, spec: BlockSpec, d: int) -> None:
        super().__init__()
        self.spec = spec
        self.fault = ""  # set by the harness for one micro-batch: "forward" | "backward"
        self.reentrant = False  # CaseConfig.reentrant (set by Net)
        self.layers = nn.ModuleList(make_layer(s, d) for s in spec.layers)
        self.inner = Inner(spec.inner, d) if spec.inner is not None else None
        self.proj: nn.Linear | None = None
        if self.inner is not None and spec.tie_inner:
            self.proj = nn.Linear(d, d, bias=False)
            self.proj.weight = self.inner.lin.weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        inside = self.spec.ckpt == "inside"
        for i, layer in enumerate(self.layers):
            first = inside and i == 0 and self.inner is None
            h = checkpoint(layer, h, use_reentrant=self.reentrant) if first else layer(h)
        if self.fault == "forward":
            raise RuntimeError("injected fault in forward")
        if self.inner is not None:
            h = checkpoint(self.inner, h, use_reentrant=self.reentrant) if inside else self.inner(h)
        if self.proj is not None:
            h = h + torch.tanh(self.proj(h))
        return pack(self.spec.output, _RaiseInBackward.apply(h) if self.fault == "backward" else h)


class Embed(nn.Module):
    def __init__(self, vocab: int, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(0.5 * torch.randn(vocab, d) / vocab**0.5)
        self.pos = nn.Parameter(0.1 * torch.randn(SEQ, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.pos


class Net(nn.Module):
    """embed -> blocks (-> norm) (* temp) -> head (+ side); the output has the input's shape (batch, SEQ, vocab)."""

    def __init__(self, cfg: CaseConfig) -> None:
        super().__init__()
        d, v = cfg.dim, cfg.vocab
        self.embed = Embed(v, d)
        self.blocks = nn.ModuleList(Block(b, d) for b in cfg.blocks)
        self.reentrant = cfg.reentrant
        for block in self.blocks:
            block.reentrant = cfg.reentrant
        self.norm = nn.LayerNorm(d, eps=0.1) if cfg.head_unit == "norm_head" else None
        self.head = nn.Linear(d, v)
        self.head_scale = 1.0
        if cfg.tie_embed != "none":
            self.head.weight = self.embed.weight  # embedding-like weight used by two submodules
            self.head_scale = d**-0.5  # the tie makes the output quadratic in it: keep SGD from diverging
        self.side = nn.Linear(d, v) if cfg.side != "none" else None
        self.unused = nn.Linear(d, 3) if cfg.unused_unit else None
        self.temp = nn.Parameter(1.0 + 0.1 * torch.randn(())) if cfg.root_scalar else None

    def body(self, x: torch.Tensor, use_side: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What comes before the head, and the side branch's output where it reaches the loss (else None)."""
        h = self.embed(x)
        for block in self.blocks:
            for _ in range(block.spec.calls):
                reentrant = self.reentrant and block.spec.output == "tensor"
                out = checkpoint(block, h, use_reentrant=reentrant) if block.spec.ckpt == "around" else block(h)
                h = unpack(out)
        if self.norm is not None:
            h = self.norm(h)
        if self.temp is not None:
            h = h * self.temp
        s = self.side(h) if self.side is not None else None  # runs on every rank ...
        return h, s if use_side else None  # ... reaches the loss where the configuration says so

    def apply_head(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(h * self.head_scale if self.head_scale != 1.0 else h)

    def forward(self, x: torch.Tensor, use_side: bool, heads: bool = True) -> Any:
        """``heads=False``: the body only, ``(h, side output or None)``, for a loss that runs the head itself."""
        h, s = self.body(x, use_side)
        if not heads:
            return h, s
        y = self.apply_head(h)
        return y + s if s is not None else y


def _mlp_placement(model: Net, ws: int) -> Callable[[nn.Parameter], Any]:
    """``shard_placement_fn`` putting the MLPs' parameters on an HSDP mesh of their own (``CaseConfig.mlp_mesh``)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo, ShardPlacementResult

    from tests.dist_utils import mesh_nd

    replicas = min(ws, 2)
    mesh = mesh_nd((replicas, ws // replicas), ("mlp_replicate", "mlp_shard"))
    info = HSDPMeshInfo(mesh=mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
    mlp_params = {id(p) for m in model.modules() if isinstance(m, MLP) for p in m.parameters()}

    def placement(param: nn.Parameter) -> Any:
        return ShardPlacementResult(placement=None, mesh_info=info) if id(param) in mlp_params else None

    return placement


def side_used(cfg: CaseConfig, rank: int) -> bool:
    return cfg.side == "all" or (cfg.side == "even" and rank % 2 == 0)


# ----------------------------------------------------------------------------------------------- sharding
def shard_model(model: Net, cfg: CaseConfig, mesh: Any) -> list[nn.Module]:
    """Shard bottom-up as the configuration says; return the units in sharding order (the root last)."""
    bf16 = torch.bfloat16

    def policy(low: bool, parent_low: bool) -> fc.MixedPrecisionPolicy:
        if not low:
            return fc.MixedPrecisionPolicy()
        # hand fp32 back to an fp32 parent; a bf16 parent takes bf16 (its Linear would reject fp32 inputs)
        out = None if parent_low else torch.float32
        return fc.MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=torch.float32, output_dtype=out)

    root_low = cfg.mp == "all"
    block_low = cfg.mp in ("blocks", "all")
    units: list[tuple[Any, Raf, fc.MixedPrecisionPolicy]] = []
    for block, spec in zip(model.blocks, cfg.blocks, strict=True):
        if spec.inner_shard:
            units.append((block.inner, spec.inner_raf, policy(block_low, block_low if spec.shard else root_low)))
        if spec.shard:
            units.append((block, spec.raf, policy(block_low, root_low)))
    if cfg.head_unit == "head":
        units.append((model.head, cfg.head_raf, policy(root_low, root_low)))
    elif cfg.head_unit == "norm_head":
        units.append(([model.norm, model.head], cfg.head_raf, policy(root_low, root_low)))
    if cfg.tie_embed == "list":
        units.append(([model.embed, model.head], cfg.embed_raf, policy(root_low, root_low)))
    elif cfg.embed_unit or cfg.tie_embed == "lift":
        units.append((model.embed, cfg.embed_raf, policy(root_low, root_low)))
    if model.side is not None and cfg.side_unit:
        units.append((model.side, cfg.side_raf, policy(root_low, root_low)))
    if model.unused is not None:
        units.append((model.unused, None, policy(root_low, root_low)))
    units.append((model, cfg.root_raf, policy(root_low, False)))

    common: dict[str, Any] = dict(frozen_params=cfg.frozen_params, auto_refresh_trainable=not cfg.manual_refresh)
    placement = _mlp_placement(model, cfg.ws) if cfg.mlp_mesh else None
    for target, raf, mp_policy in units:
        kwargs = dict(common, mp_policy=mp_policy)
        if not cfg.raf_via_setter:
            kwargs["reshard_after_forward"] = raf
        if placement is not None and (raf is None or isinstance(raf, bool)):
            kwargs["shard_placement_fn"] = placement
        fc.fully_shard(target, mesh=mesh, **kwargs)
    handles = [target[0] if isinstance(target, list) else target for target, _, _ in units]
    if cfg.raf_via_setter:  # recurse=False: each unit gets its own value
        for handle, (_, raf, _) in zip(handles, units, strict=True):
            if raf is not None:
                fc.set_reshard_after_forward(handle, raf, recurse=False)
    if not cfg.reshard_after_backward:
        fc.set_reshard_after_backward(model, False)
    if cfg.full_precision_eval:
        fc.set_full_precision_in_eval(model)
    if cfg.collective_checks:
        fc.set_collective_checks(model)
    fc.set_gradient_accumulation(model, cfg.accumulation)  # type: ignore[arg-type]
    if cfg.prefetch == "off":
        for handle in handles:
            fc.set_modules_to_forward_prefetch(handle, [])
            fc.set_modules_to_backward_prefetch(handle, [])
    elif cfg.prefetch == "random":
        forward: dict[int, list[nn.Module]] = {}
        backward: dict[int, list[nn.Module]] = {}
        for direction, src, dst in cfg.prefetch_pairs:
            table = forward if direction == "f" else backward
            table.setdefault(src % len(handles), []).append(handles[dst % len(handles)])
        for src, targets in forward.items():
            fc.set_modules_to_forward_prefetch(handles[src], targets)
        for src, targets in backward.items():
            fc.set_modules_to_backward_prefetch(handles[src], targets)
    return handles
