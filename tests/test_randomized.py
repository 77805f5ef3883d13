"""Randomized configurations (issue 9): random module trees x random options, trained against a single-process
reference and compared parameter by parameter after every step.

A configuration (tests/random_models.py ``CaseConfig``) draws a module tree (nested units, odd dim-0 sizes, ties
inside and across units, a never-called unit, a branch whose output reaches the loss on even ranks only — in the
root's unit, or a unit of its own with reshard_after_forward=False, the two layouts docs/frozen.md allows —, 0-dim
parameters, Linear / Conv1d / LayerNorm) and the options (mixed precision, reshard after forward / backward, no-sync
windows in both accumulation modes, trainability changes, frozen_params, activation checkpointing, prefetch,
forwards without backward, exceptions and discarded micro-batches, SGD / AdamW, 1, 2 or 4 ranks) and the graph
shapes of issue 20 (units called twice, tuple / dict / dataclass / namedtuple block outputs, [norm, head] and
[embed, head] units split between the root's forward and torchtitan's chunked loss, eval forwards between a forward
and its backward, an exception on one rank in the loss — it resets, every other rank gets StepAbandoned — or in
backward, collective checks). Every rank's collectives are recorded per process group and must be equal. Every rank also
trains an unsharded copy made before sharding on every rank's data (the loss each rank sees, averaged), so the
sharded parameters (gathered with ``full_tensor``) must match it after each step, the ``.grad`` of the same
parameters must be set, and the ``requires_grad`` flags read back from the model must be the ones that were set.

Run:
    pytest tests/test_randomized.py                                  # CI slice (fixed examples, ~15 cases)
    FSDP_COMPOSE_RANDOM_CASES=300 pytest tests/test_randomized.py    # soak: random examples, every failure listed
    FSDP_COMPOSE_RANDOM_CASES=300 FSDP_COMPOSE_RANDOM_SHRINK=1 pytest tests/test_randomized.py  # stop, shrink
    FSDP_COMPOSE_RANDOM_SEED=17,40 pytest tests/test_randomized.py -k seeded   # configurations by seed
    python -m tests.random_sweep --seeds 0:80 [--ws 2]              # sweep seeds, one line each, never stops
    python -m tests.random_sweep --config "CaseConfig(ws=2, ...)"    # re-run a printed configuration
    python -m tests.random_sweep --seeds 9 --shrink                  # and shrink what fails
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import os
import re
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from torch.distributed.distributed_c10d import _resolve_process_group

import fsdp_compose as fc
from fsdp_compose.agreement import StepAbandoned
from tests import random_models as rm
from tests.random_models import (
    SEQ,
    BlockSpec,
    CaseConfig,
    DrawChooser,
    LayerSpec,
    Net,
    config_from_seed,
    draw_config,
    side_used,
)
from tests.test_collective_order import Record, _recording_collectives

FP32_TOL = 1e-5  # absolute + relative, per element
# bf16 compute (8 bits of mantissa) against an fp32 reference; both tolerances scale with (1 + |value|). Correct
# bf16 runs were seen up to 9e-3 away from the reference (3e-2 on values near 1).
BF16_TOL = 2e-2
BF16_EVAL_TOL = 5e-2  # a bf16 eval forward's output against the fp32 reference's (see _check_eval)
MAX_REPORTED = 6
CASES = int(os.environ.get("FSDP_COMPOSE_RANDOM_CASES", "0"))
LOG = os.environ.get("FSDP_COMPOSE_RANDOM_LOG", "")  # a file: one JSON line (configuration, outcome) per case
SHRINK = os.environ.get("FSDP_COMPOSE_RANDOM_SHRINK", "") not in ("", "0")
SHARE = {1: 0.2, 2: 0.45, 4: 0.35}  # of the soak's cases per world size
CI_EXAMPLES = {1: 4, 2: 7, 4: 4}
NEVER_FROZEN = ("head", "head.bias")  # so that every rank's loss requires grad (a backward on every rank)


# ----------------------------------------------------------------------------------------------- one case, per rank
def _make_optimizer(kind: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.02, momentum=0.9)
    # eps 1e-3: a gradient that is round-off (analytically zero, or bf16 noise around zero) must not become a step
    # of size ~lr, as it would with eps 1e-8 (tests/test_parity.py needs 2e-3 for AdamW for that reason)
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-3, weight_decay=0.1)


def _attr(root: torch.nn.Module, name: str) -> Any:
    obj: Any = root
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _set_trainable(root: torch.nn.Module, kind: str, name: str, flag: bool) -> None:
    if kind == "module":
        root.get_submodule(name).requires_grad_(flag)
    else:
        _attr(root, name).requires_grad_(flag)  # what the module holds now (sharded or gathered)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _loss(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(y.float(), t)


class _LossFailed(RuntimeError):
    """The injected failure of a ``loss_one`` fault: raised between the forward and the backward on one rank."""


def _micro_batch(
    model: Net,
    cfg: CaseConfig,
    x: torch.Tensor,
    target: torch.Tensor,
    use: bool,
    scale: float,
    *,
    fail_loss: bool = False,
    mid_eval: Any = None,
    twice: bool = True,
) -> None:
    """Forward, loss and backward of one micro-batch, as ``cfg.loss`` says. ``fail_loss``: raise ``_LossFailed``
    after the forward (chunked: after the first chunk's head forward); ``mid_eval``: called between the forward and
    the backward. A rank that fails earlier than every forward collective issued would leave its peers waiting in
    one (the same in torch's fully_shard): the failures a rank can recover from alone come after the forwards."""
    if cfg.loss == "plain":
        y = model(x, use)
        if fail_loss:
            raise _LossFailed("injected failure in the loss")
        if mid_eval is not None:
            mid_eval()
        if cfg.backward_twice and twice:  # two backwards through one graph: their gradients add up to the loss's
            half = _loss(y, target) * (scale / 2)
            half.backward(retain_graph=True)
            half.backward()
        else:
            (_loss(y, target) * scale).backward()
        return
    # torchtitan's chunked loss: the head runs once per chunk of rows outside the root's forward, each chunk with its
    # own backward into a detached leaf; then one backward of the body with the gathered leaf gradients
    h, s = model(x, use, heads=False)
    if mid_eval is not None:
        mid_eval()
    n, d, v = target.numel(), h.shape[-1], target.shape[-1]
    h_chunks = h.detach().reshape(-1, d).chunk(cfg.chunks)
    t_chunks = target.reshape(-1, v).chunk(cfg.chunks)
    s_chunks = s.detach().reshape(-1, v).chunk(cfg.chunks) if s is not None else [None] * len(h_chunks)
    h_grads, s_grads = [], []
    for hc, tc, sc in zip(h_chunks, t_chunks, s_chunks, strict=True):
        h_leaf = hc.requires_grad_(True)
        y = model.apply_head(h_leaf)
        if sc is not None:
            s_leaf = sc.requires_grad_(True)
            y = y + s_leaf
        if fail_loss:  # after the head's forward: a failure before it would leave the head's all-gather unmatched
            raise _LossFailed("injected failure in the loss")
        ((y.float() - tc).pow(2).sum() * (scale / n)).backward()
        h_grads.append(h_leaf.grad)
        if sc is not None:
            s_grads.append(s_leaf.grad)
    roots, grads = [], []
    if h.requires_grad:
        roots.append(h)
        grads.append(torch.cat(h_grads).view_as(h))
    if s is not None and s.requires_grad:
        roots.append(s)
        grads.append(torch.cat(s_grads).view_as(s))
    if roots:
        torch.autograd.backward(roots, grads)


def _check_eval(
    model: Net,
    cfg: CaseConfig,
    x: torch.Tensor,
    use: bool,
    mode: str,
    expected: torch.Tensor,
    step: int,
    failures: list[str],
) -> None:
    """An eval forward (``model.eval()``) between a training forward and its backward: its output must be the
    current parameters' (fp32 tolerance where it runs in fp32: no mixed precision, or set_full_precision_in_eval)."""
    model.eval()
    try:
        with torch.no_grad() if mode == "no_grad" else contextlib.nullcontext():
            got = model(x, use).detach().float()
    finally:
        model.train()
    # bf16: the eval runs the bf16 forward and is compared with the fp32 reference's output, so rounding compounds
    # over the tree's depth (seeds 454 and 475 at 4 ranks: 2.5e-2 and 3.5e-2, exact with mp="none"). A stale or
    # wrong parameter is caught by the fp32 configurations at FP32_TOL.
    tol = FP32_TOL if cfg.mp == "none" or cfg.full_precision_eval else BF16_EVAL_TOL
    err = (got - expected).abs()
    if not (err - tol * (1 + expected.abs())).max().item() <= 0 and len(failures) < MAX_REPORTED:
        failures.append(
            f"step {step}: {mode} eval forward between forward and backward: max|diff| {err.max().item():.3e} from "
            f"the current parameters' output (tol {tol})"
        )


def run_case(rank: int, ws: int, cfg: CaseConfig) -> dict[str, Any]:
    """Train the sharded model (this rank's slice) and the reference (every rank's slice) side by side, recording
    every collective the engine issues per process group."""
    with _recording_collectives() as record:
        result = _run_case(rank, ws, cfg)
    result["record"] = record
    result["members"] = {name: dist.get_process_group_ranks(_resolve_process_group(name)) for name in record}
    return result


def _run_case(rank: int, ws: int, cfg: CaseConfig) -> dict[str, Any]:
    from tests.dist_utils import mesh_1d

    assert ws == cfg.ws
    torch.manual_seed(cfg.seed)
    reference = Net(cfg)
    model = copy.deepcopy(reference)
    rm.shard_model(model, cfg, mesh_1d(ws))
    names = [n for n, _ in reference.named_parameters()]
    ref_params = dict(reference.named_parameters())
    sharded = {n: model.get_parameter(n) for n in names}  # the DTensor parameters the optimizer holds
    modules = [
        n
        for n, m in reference.named_modules()
        if n and n not in NEVER_FROZEN and next(m.parameters(), None) is not None
    ]
    targets = {"module": modules, "param": [n for n in names if n not in NEVER_FROZEN]}
    opt = _make_optimizer(cfg.optimizer, [sharded[n] for n in names])
    ref_opt = _make_optimizer(cfg.optimizer, [ref_params[n] for n in names])
    tol = FP32_TOL if cfg.mp == "none" else BF16_TOL
    m, use = cfg.micro_batches, side_used(cfg, rank)
    failures: list[str] = []
    errors: list[str] = []  # (step, outcome) of the step errors: every rank's as expected (loss_one)
    max_diff = 0.0

    def batch(gen: torch.Generator, *lead: int) -> torch.Tensor:
        return torch.randn(*lead, cfg.batch, SEQ, cfg.vocab, generator=gen).requires_grad_(cfg.input_grad)

    for step in range(cfg.steps):
        gen = torch.Generator().manual_seed(cfg.seed * 1009 + step)
        x, target = batch(gen, ws, m), torch.randn(ws, m, cfg.batch, SEQ, cfg.vocab, generator=gen)
        for _, mode in [e for e in cfg.evals if e[0] == step]:  # a forward without backward (evaluation)
            with torch.no_grad() if mode == "no_grad" else contextlib.nullcontext():
                model(batch(gen, ws)[rank], use)
        changes = [e for e in cfg.trainability if e[0] == step]
        for _, kind, index, flag in changes:
            name = targets[kind][index % len(targets[kind])]
            _set_trainable(model, kind, name, flag)
            _set_trainable(reference, kind, name, flag)
        if changes and cfg.manual_refresh:
            fc.refresh_trainable(model)
        for _, kind, index in [f for f in cfg.faults if f[0] == step]:  # a micro-batch the user throws away
            xf = batch(gen, ws)[rank]
            if kind == "discard":  # e.g. a nan loss: its no-sync gradients must go with zero_grad
                with fc.no_sync(model):
                    _micro_batch(model, cfg, xf, target[rank, 0], use, 1.0)
            elif kind == "loss_one":  # the loss raises on one rank: it resets, the others get StepAbandoned
                failing = rank == index % ws
                got = "no error"
                try:
                    _micro_batch(model, cfg, xf, target[rank, 0], use, 1.0, fail_loss=failing, twice=False)
                except (_LossFailed, StepAbandoned) as e:  # the documented loop: reset_step in the except clause
                    got = "its own error" if isinstance(e, _LossFailed) else "StepAbandoned"
                    fc.reset_step(model)  # returns on every rank: on the others the step already ended
                want = "its own error" if failing else "StepAbandoned"
                errors.append(f"step {step}: {'as expected' if got == want else got}")
                if got != want and len(failures) < MAX_REPORTED:
                    failures.append(f"step {step}: loss failed on rank {index % ws}: this rank got {got}, not {want}")
            elif kind == "backward_one":  # a block raises in backward on one rank: it resets, the others too
                block = model.blocks[index % len(model.blocks)]
                failing = rank == index % ws
                block.fault = "backward" if failing else ""
                got = "no error"
                try:
                    # One backward: the failing rank stops in it, so a second one would run on the others only.
                    _micro_batch(model, cfg, xf, target[rank, 0], use, 1.0, twice=False)
                except RuntimeError as e:
                    if "injected fault" not in str(e) and not isinstance(e, StepAbandoned):
                        raise
                    got = "StepAbandoned" if isinstance(e, StepAbandoned) else "its own error"
                    fc.reset_step(model)  # before any other collective: completes this rank's side of the step
                finally:
                    block.fault = ""
                want = "its own error" if failing else "StepAbandoned"  # the others learn it at their backward's end
                errors.append(f"step {step}: {'as expected' if got == want else got}")
                if got != want and len(failures) < MAX_REPORTED:
                    failures.append(
                        f"step {step}: backward failed on rank {index % ws}: this rank got {got}, not {want}"
                    )
            else:
                block = model.blocks[index % len(model.blocks)]
                block.fault = kind
                try:
                    _micro_batch(model, cfg, xf, target[rank, 0], use, 1.0)
                    raise AssertionError(f"the injected {kind} fault did not raise")
                except RuntimeError as e:
                    if "injected fault" not in str(e):
                        raise
                finally:
                    block.fault = ""
            opt.zero_grad()

        opt.zero_grad()
        ref_opt.zero_grad()
        total = sum(_loss(reference(x[r, j], side_used(cfg, r)), target[r, j]) for r in range(ws) for j in range(m))
        (total / (ws * m)).backward()
        mid = [mode for s_, mode in cfg.mid_evals if s_ == step]
        for j in range(m):
            check_eval = None
            if mid and j == 0:  # an eval forward between this micro-batch's forward and its backward
                xe = batch(gen, ws)[rank].detach()
                expected = _unsharded_output(reference, sharded, names, xe, use)
                check_eval = functools.partial(_check_eval, model, cfg, xe, use, mid[0], expected, step, failures)
            with fc.no_sync(model) if j < m - 1 else contextlib.nullcontext():
                _micro_batch(model, cfg, x[rank, j], target[rank, j], use, 1 / m, mid_eval=check_eval)
        for n in names:
            got, want = sharded[n].grad is not None, ref_params[n].grad is not None
            if got != want and len(failures) < MAX_REPORTED:
                failures.append(f"step {step}: {n}.grad is {'set' if got else 'None'}, reference's is not")
        if cfg.clip:
            fc.clip_grad_norm_([sharded[n] for n in names], cfg.clip)
            torch.nn.utils.clip_grad_norm_([ref_params[n] for n in names], cfg.clip)
        if not (cfg.sabotage == "skip_step" and step == 1):
            opt.step()
        ref_opt.step()

        worst = (0.0, "")
        for n in names:  # every rank gathers the same parameters in the same order
            full, want = _full(sharded[n].detach()).float(), ref_params[n].detach()
            err = (full - want).abs()
            excess = (err - tol * (1 + want.abs())).max().item() if err.numel() else 0.0
            bad = not bool(torch.isfinite(full).all())
            diff = float("inf") if bad else (err.max().item() if err.numel() else 0.0)
            max_diff = max(max_diff, diff)
            if (bad or excess > 0) and diff >= worst[0]:
                worst = (diff, n)
        for n in names:
            live, want_flag = _attr(model, n).requires_grad, ref_params[n].requires_grad
            if live != want_flag and len(failures) < MAX_REPORTED:
                failures.append(f"step {step}: model.{n}.requires_grad reads {live}, was set to {want_flag}")
        if worst[1]:
            scale = max(p.detach().abs().max().item() for p in ref_params.values())  # a diverging reference?
            failures.append(
                f"step {step}: wrong parameters, worst {worst[1]} max|diff| {worst[0]:.3e} (tol {tol}; "
                f"reference max|param| {scale:.3g})"
            )
            break  # the same decision on every rank: the gathered values are identical everywhere
    return {"rank": rank, "failures": failures, "max_diff": max_diff, "errors": errors}


def _unsharded_output(
    reference: Net, sharded: dict[str, torch.Tensor], names: list[str], x: torch.Tensor, use: bool
) -> torch.Tensor:
    """The fp32 output of an unsharded copy holding the sharded model's current parameters (gathered)."""
    scratch = copy.deepcopy(reference)
    with torch.no_grad():
        for n in names:
            _attr(scratch, n).copy_(_full(sharded[n].detach()).float())
        return scratch.eval()(x, use).float()


# ----------------------------------------------------------------------------------------------- host side
def replay_hint(cfg: CaseConfig) -> str:
    return f'python -m tests.random_sweep --config "{cfg!r}"'


def compare_records(records: list[Record], members: list[dict[str, list[int]]]) -> list[str]:
    """Every rank of a process group must issue the same collectives (kind, numel) in the same order on it.

    ``members[r]``: the global ranks of each group rank ``r`` recorded (a group an int reshard_after_forward makes
    holds some ranks only)."""
    found = []
    groups: dict[str, list[int]] = {}
    for seen in members:
        groups.update(seen)
    for group, ranks in sorted(groups.items()):
        first_rank = ranks[0]
        first = records[first_rank].get(group, [])
        for rank in ranks[1:]:
            mine = records[rank].get(group, [])
            if mine != first:
                at = next(
                    (i for i, (a, b) in enumerate(zip(mine, first, strict=False)) if a != b), min(len(mine), len(first))
                )
                found.append(
                    f"rank {rank}: collectives on group {group} differ from rank {first_rank}'s at call {at}: "
                    f"{mine[at : at + 2]} vs {first[at : at + 2]} ({len(mine)} vs {len(first)} calls)"
                )
    return found


def check_case(run: Any, cfg: CaseConfig, stats: dict[str, Any] | None = None) -> float:
    """Run one configuration on ``cfg.ws`` ranks; raise AssertionError naming it (and how to re-run it)."""
    try:
        results = run(cfg.ws, run_case, cfg)
    except AssertionError as e:  # an exception or a hang on some rank (the pool restarts)
        raise AssertionError(f"{e}\nconfiguration: {cfg!r}\nre-run: {replay_hint(cfg)}") from None
    failures = [f"rank {r['rank']}: {f}" for r in results for f in r["failures"]]
    failures += compare_records([r["record"] for r in results], [r["members"] for r in results])
    failures += [
        f"rank {r['rank']}: step errors {r['errors']}, rank 0's {results[0]['errors']}"
        for r in results
        if r["errors"] != results[0]["errors"]
    ]
    if stats is not None:
        stats["collectives"] = sum(len(calls) for calls in results[0]["record"].values())
    if failures:
        raise AssertionError(
            "sharded training differs from the reference:\n  "
            + "\n  ".join(failures)
            + f"\nconfiguration: {cfg!r}\nre-run: {replay_hint(cfg)}"
        )
    return max(r["max_diff"] for r in results)


COMM_WORDS = ("gloo", "Connection reset", "Connection closed", "timeout", "Timed out", "timed out")


def symptom(text: str) -> str:
    """One line: the category and what identifies the failure."""
    if "sharded training differs" in text:
        return "WRONG: " + text.splitlines()[1].strip()
    errors = _error_lines(text)
    own = [e for e in errors if not any(w in e for w in COMM_WORDS)]  # not a peer's failure seen by this rank
    if own:
        return "EXCEPTION: " + own[0]
    if "died (exit code" in text or "Connection reset" in text or "Connection closed" in text:
        return "CRASH: a worker process died (gloo aborts on a collective mismatch: different collectives per rank)"
    return "HANG: " + (errors[0] if errors else text.strip().splitlines()[-1])[:200]


def symptom_key(status: str) -> str:
    category, _, rest = status.partition(": ")
    if category in ("CRASH", "HANG"):  # both: the ranks ran different collectives (which one shows is timing)
        return "COLLECTIVES"
    if category == "EXCEPTION":
        return category + ": " + re.sub(r"\d+", "N", rest.split("rank ")[-1])[:60]
    return category


def _error_lines(text: str) -> list[str]:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    skip = ("configuration:", "re-run:", "File ", "raise ", "^", "AssertionError: distributed test")
    lines = [ln for ln in lines if not ln.startswith(skip)]
    return [ln[:300] for ln in lines if re.match(r"^[\w.]*(Error|Exception)\b", ln)]


@st.composite
def configs(draw: st.DrawFn, ws: int) -> CaseConfig:
    return draw_config(DrawChooser(draw), ws, draw(st.integers(0, 2**16)))


def _settings(ws: int) -> settings:
    common: dict[str, Any] = dict(
        deadline=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )
    if CASES:  # soak: fresh random examples every run
        phases = tuple(Phase) if SHRINK else (Phase.explicit, Phase.generate)
        return settings(max_examples=max(1, round(CASES * SHARE[ws])), phases=phases, **common)
    # CI: the same examples every run (hypothesis.seed below), no shrinking, every example run (failures collected)
    return settings(max_examples=CI_EXAMPLES[ws], database=None, phases=(Phase.explicit, Phase.generate), **common)


@pytest.mark.parametrize("ws", [1, 2, 4])
def test_random_configurations_match_the_reference(run_dist, ws: int) -> None:
    """CI: a fixed slice of configurations, all run, every failure listed. Soak (FSDP_COMPOSE_RANDOM_CASES=N):
    N random configurations over the world sizes, every failure listed; with FSDP_COMPOSE_RANDOM_SHRINK=1 the
    first failure stops the run and Hypothesis shrinks it and prints the minimal configuration."""
    failures: list[str] = []

    @_settings(ws)
    @given(cfg=configs(ws))
    def case(cfg: CaseConfig) -> None:
        start, outcome = time.monotonic(), "ERROR (harness)"
        try:
            check_case(run_dist, cfg)
            outcome = "PASS"
        except AssertionError as e:
            outcome = symptom(str(e))
            if not SHRINK:
                failures.append(f"{outcome}\n    {cfg!r}")
            else:
                raise
        finally:
            if LOG:
                with open(LOG, "a") as f:
                    f.write(json.dumps({"config": repr(cfg), "status": outcome, "seconds": time.monotonic() - start}))
                    f.write("\n")

    if not CASES:
        case = hypothesis_seed(9000 + ws)(case)  # a different fixed slice per world size
    case()
    assert not failures, f"{len(failures)} configurations failed on {ws} ranks:\n" + "\n".join(failures)


def _block(output: str, calls: int = 2, inner: bool = False, **kwargs: Any) -> BlockSpec:
    layers = (LayerSpec("mlp", 3),) if not inner else (LayerSpec("norm", 3),)
    nested = (LayerSpec("mlp", 1),) if inner else None
    return BlockSpec(layers, True, inner=nested, inner_shard=inner, calls=calls, output=output, **kwargs)


# One configuration per group of graph shapes (issue 20), at 2 and 4 ranks: fixed, so CI covers each of them whatever
# the random slice draws.
GRAPH_SHAPES = {
    # [norm, head] unit: norm in the root's forward, head once per chunk outside it (3 backwards into leaves, then
    # the body's); blocks used twice returning a dataclass / namedtuple; a branch reaching the loss on even ranks
    # only, re-gathered for backward; two micro-batches; collective checks
    "chunked_loss": CaseConfig(
        ws=2,
        steps=3,
        blocks=(_block("dataclass"), _block("namedtuple", inner=True, raf=False)),
        head_unit="norm_head",
        loss="chunked",
        chunks=3,
        side="even",
        side_raf=True,
        micro_batches=2,
        collective_checks=True,
    ),
    # [embed, head] unit split over the root's forward and the chunked loss; bf16 blocks with an fp32 eval forward
    # between a training forward and its backward; the loss raising on one rank (StepAbandoned on every rank)
    "grouped_bf16_eval_loss_fault": CaseConfig(
        ws=2,
        steps=3,
        blocks=(_block("dict"), _block("tensor", calls=1, ckpt="around")),
        tie_embed="list",
        loss="chunked",
        mp="blocks",
        full_precision_eval=True,
        mid_evals=((0, "no_grad"), (2, "no_grad")),
        faults=((1, "loss_one", 1),),
        collective_checks=True,
    ),
    # the head a unit of its own; an exception in backward on one rank (reset_step there), then the loss raising on
    # another; an eval forward with grad between a forward and its backward; a tuple output
    "one_rank_faults": CaseConfig(
        ws=2,
        steps=3,
        blocks=(_block("tuple", inner=True), _block("tensor", calls=1, ckpt="inside")),
        head_unit="head",
        side="even",
        side_unit=False,
        faults=((0, "backward_one", 1), (1, "loss_one", 0)),
        mid_evals=((2, "grad"),),
        collective_checks=True,
    ),
}


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("name", list(GRAPH_SHAPES))
def test_graph_shapes_match_the_reference(run_dist, name: str, ws: int) -> None:
    check_case(run_dist, dataclasses.replace(GRAPH_SHAPES[name], ws=ws))


# Failures the sweep found in the engine, now fixed (regressions): an eval forward under
# fc.set_full_precision_in_eval between a bf16 training forward and its backward broke that backward (a kept-whole
# parameter, or a unit kept after forward, was left in the eval's dtype).
FOUND_BY_THE_SWEEP = {
    # a bf16 unit whose only parameter is 0-dim: its gradient is lost (.grad None; without the checkpoint: SIGSEGV)
    "eval_between_0dim_bf16": CaseConfig(
        ws=2,
        steps=1,
        blocks=(BlockSpec((LayerSpec("scalar", 3),), True, ckpt="around"),),
        mp="blocks",
        full_precision_eval=True,
        mid_evals=((0, "no_grad"),),
    ),
    # a bf16 unit kept after forward, an eval forward with grad: "setStorage: ... out of bounds for storage of size 0"
    "eval_with_grad_between_kept_bf16": CaseConfig(
        ws=2,
        steps=1,
        blocks=(BlockSpec((LayerSpec("mlp", 3),), True, raf=False),),
        mp="blocks",
        full_precision_eval=True,
        mid_evals=((0, "grad"),),
    ),
    # bf16 everywhere, set_full_precision_in_eval, the side unit then the head unit called last in the root's forward,
    # an eval forward between forward and backward: the backward raised "setStorage: ... storage of size 0" (a unit
    # prefetched in fp32 by the eval was finished in fp32 for the backward; repros/eval_between_two_heads_bf16.py)
    "eval_between_two_last_units_bf16": CaseConfig(
        ws=1,
        steps=1,
        mp="all",
        full_precision_eval=True,
        mid_evals=((0, "no_grad"),),
        side="all",
        head_unit="head",
    ),
    # a micro-batch whose body backward raises (every rank) after the chunked loss ran the [norm, head] unit's chunk
    # backwards is thrown away: the next step's norm gradient was doubled (the failed step's reduced rows still
    # waiting for their copy were handed out by the reset; repros/chunked_backward_fault_leak.py)
    # a drawn configuration at 2 ranks (a side unit only even ranks run, a reentrant checkpoint inside a block,
    # sharded accumulation, explicit prefetch pairs): a rank landing its midway prefetch at a unit's end waited
    # (blocking, on gloo) for an all-gather its peer issues only after this rank's next reduce-scatter: a hang
    "landing_a_midway_prefetch_waited_for_a_peer": config_from_seed(105, 2),
    # a unit holding only kept-whole parameters (a 0-dim one) with reshard_after_forward=2 all-gathered nothing over
    # its post-forward group in every backward: an empty collective the backward's program does not list (an
    # internal error since the walk checks each collective against it)
    "empty_post_forward_all_gather": dataclasses.replace(config_from_seed(152, 4), mlp_mesh=False),  # as found
    # the MLPs on a mesh of their own (a mesh per parameter), HSDP as pure replication over both ranks: their
    # all-reduces over replicas went over torch's default group, which the 1-D units all-gather on, at points that
    # differ between ranks (a side unit only even ranks run): a hang. They have a group of their own now
    # (meshes.replica_reduce_group); a unit's siblings are gathered together, none waiting behind another's prefetch
    "replica_all_reduce_beside_all_gathers": config_from_seed(102, 2),
    # a chunked loss, a side unit only even ranks run, the micro-batch's backward raising on every rank at different
    # points, collective checks: the next micro-batch's forward (under no_sync by then) completed the failed backward
    # with the no_sync setting, so one rank skipped the reduce-scatter the other had issued before failing (a hang)
    "abandoned_backward_keeps_its_settings": CaseConfig(
        ws=2,
        seed=452,
        steps=1,
        batch=1,
        micro_batches=2,
        accumulation="unsharded",
        blocks=(
            BlockSpec(
                (LayerSpec("scalar", 3), LayerSpec("mlp", 5), LayerSpec("mlp", 1)),
                False,
                inner=(LayerSpec("tied", 5), LayerSpec("tied", 5)),
                calls=2,
                output="tensor",
            ),
        ),
        embed_unit=False,
        tie_embed="list",
        side="even",
        side_unit=True,
        frozen_params="shard",
        mp="blocks",
        head_raf=True,
        faults=((0, "backward", 1),),
        loss="chunked",
        chunks=3,
        collective_checks=True,
    ),
    # a side unit only even ranks run, bf16, 3 micro-batches: an eval forward with grad between the last forward and
    # its backward made that backward need "had a gradient" columns; the even rank's accumulation buffer (from the
    # first micro-batch) had none, the odd rank's new one had them: reduce-scatters of 12 and 14 elements, gloo aborted
    "window_layout_of_a_rank_holding_nothing": CaseConfig(
        ws=2,
        seed=13,
        steps=3,
        batch=1,
        micro_batches=3,
        accumulation="unsharded",
        blocks=(
            BlockSpec(
                (LayerSpec("conv", 7), LayerSpec("mlp", 5)),
                True,
                inner=(LayerSpec("tied", 3),),
                inner_raf=False,
                calls=2,
                output="tensor",
            ),
        ),
        embed_unit=False,
        side="even",
        side_unit=True,
        mp="all",
        frozen_params="shard",
        optimizer="adamw",
        clip=1.0,
        head_raf=True,
        mid_evals=((2, "grad"),),
        full_precision_eval=True,
    ),
    # an eval forward under set_full_precision_in_eval between a bf16 forward and its backward, a unit inside an
    # activation-checkpointed block returning a tuple: the recompute kept the eval's full precision for its outputs
    # (not cast back to the incoming fp32), and torch's checkpoint raised "Recomputed values ... different metadata"
    "recompute_after_full_precision_eval": CaseConfig(
        ws=2,
        steps=2,
        blocks=(
            BlockSpec(
                (LayerSpec("mlp", 3),),
                False,
                inner=(LayerSpec("mlp", 3),),
                inner_shard=True,
                ckpt="around",
                output="tuple",
            ),
        ),
        mp="blocks",
        full_precision_eval=True,
        mid_evals=((0, "no_grad"),),
    ),
    "chunked_loss_backward_fault_leak": CaseConfig(
        ws=1,
        steps=1,
        blocks=(BlockSpec((LayerSpec("mlp", 3),), True),),
        head_unit="norm_head",
        loss="chunked",
        faults=((0, "backward", 0),),
    ),
}


@pytest.mark.parametrize("name", list(FOUND_BY_THE_SWEEP))
def test_graph_shape_failures_the_sweep_found(run_dist, name: str) -> None:
    check_case(run_dist, FOUND_BY_THE_SWEEP[name])


def test_the_harness_compares_collectives_per_group() -> None:
    """A rank that issued one collective more, or another size, on a group it belongs to is reported; a group some
    ranks are not in is compared among its members only."""
    same = {"g": [("all_gather", 4), ("reduce_scatter", 8)]}
    members = {"g": [0, 1]}
    assert compare_records([same, same], [members, members]) == []
    extra = {"g": [*same["g"], ("all_gather", 4)]}
    assert "at call 2" in compare_records([same, extra], [members, members])[0]
    other = {"g": [("all_gather", 4), ("reduce_scatter", 6)]}
    assert "at call 1" in compare_records([same, other], [members, members])[0]
    sub = {"g": same["g"], "s": [("all_gather", 2)]}
    assert compare_records([sub, same], [{**members, "s": [0]}, members]) == []


@pytest.mark.skipif("FSDP_COMPOSE_RANDOM_SEED" not in os.environ, reason="set FSDP_COMPOSE_RANDOM_SEED=17[,40,...]")
def test_seeded_configurations(run_dist) -> None:
    for seed in os.environ["FSDP_COMPOSE_RANDOM_SEED"].split(","):
        check_case(run_dist, config_from_seed(int(seed)))


def test_the_harness_catches_a_skipped_optimizer_step(run_dist) -> None:
    """The comparison can fail: the sharded side skipping one update is reported at that step."""
    plain = CaseConfig(ws=2, steps=2)
    assert check_case(run_dist, plain) <= FP32_TOL
    with pytest.raises(AssertionError, match="step 1: wrong parameters"):
        check_case(run_dist, CaseConfig(ws=2, steps=2, sabotage="skip_step"))
