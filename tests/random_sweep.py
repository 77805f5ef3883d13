"""Sweep the randomized configurations by seed, never stopping at a failure, and shrink what fails.

    python -m tests.random_sweep --seeds 0:80                 # one line per seed: PASS / WRONG / EXCEPTION / HANG
    python -m tests.random_sweep --seeds 0:80 --ws 4          # force the world size
    python -m tests.random_sweep --seeds 9,23 --shrink        # shrink each failure (same symptom, simpler config)
    python -m tests.random_sweep --seeds 0:80 --set full_precision_eval=False   # leave a drawn dimension out
    python -m tests.random_sweep --config "CaseConfig(...)" -v   # re-run one printed configuration, full report
    python -m tests.random_sweep --seeds 0:40 --accelerator-side  # the walk's waits as on an accelerator
    python -m tests.random_sweep --seeds 0:40 --recording-streams # ... over simulated streams checking the buffer rule

A case passes when the sharded parameters match the single-process reference after every step (fp32 1e-5, bf16
2e-2, relative to 1 + |value|), every rank issued the same collectives (kind, numel) in the same order on every
process group, and every rank got the step errors it should (``loss_one`` faults: the failing rank's ``fc.reset_step``
returns, every other rank gets fc's StepAbandoned at the end of its backward).

Runs on its own gloo pools (tests/pool.py), with the same case body as tests/test_randomized.py.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from tests import random_models as rm
from tests.random_models import BlockSpec, CaseConfig, LayerSpec, config_from_seed
from tests.test_randomized import check_case, symptom, symptom_key

EVENT_FIELDS = ("faults", "evals", "mid_evals", "trainability", "prefetch_pairs")


# ----------------------------------------------------------------------------------------------- shrinking
def _valid(c: CaseConfig) -> bool:
    if c.prefetch != "random" and c.prefetch_pairs:
        return False
    if c.head_unit != "none" and c.tie_embed != "none":
        return False
    if c.loss == "chunked" and c.head_unit == "none" and c.tie_embed != "list":
        return False  # the head must be in a unit of its own to run outside the root's forward
    for b in c.blocks:
        if b.inner is None and (b.inner_shard or b.tie_inner):
            return False
        if b.tie_inner and b.inner_shard and not b.shard and c.mp == "blocks":
            return False
    return all(not isinstance(v, int) or isinstance(v, bool) or (c.ws % v == 0 and v < c.ws) for v in _rafs(c))


def _rafs(c: CaseConfig) -> list[Any]:
    return [c.embed_raf, c.side_raf, c.root_raf, c.head_raf, *[v for b in c.blocks for v in (b.raf, b.inner_raf)]]


def _with_ws(c: CaseConfig, ws: int) -> CaseConfig:
    def fix(v: Any) -> Any:
        return v if v is None or isinstance(v, bool) or (ws % v == 0 and v < ws) else None

    blocks = tuple(dataclasses.replace(b, raf=fix(b.raf), inner_raf=fix(b.inner_raf)) for b in c.blocks)
    return dataclasses.replace(
        c,
        ws=ws,
        blocks=blocks,
        embed_raf=fix(c.embed_raf),
        side_raf=fix(c.side_raf),
        root_raf=fix(c.root_raf),
        head_raf=fix(c.head_raf),
    )


def _without(seq: tuple[Any, ...], i: int) -> tuple[Any, ...]:
    return seq[:i] + seq[i + 1 :]


def _simpler_layers(layers: tuple[LayerSpec, ...]) -> Iterator[tuple[LayerSpec, ...]]:
    if len(layers) > 1:
        for i in range(len(layers)):
            yield _without(layers, i)
    for i, layer in enumerate(layers):
        if layer.kind != "mlp":
            yield (*layers[:i], LayerSpec("mlp", layer.rows), *layers[i + 1 :])
        if layer.rows != 3:
            yield (*layers[:i], LayerSpec(layer.kind, 3), *layers[i + 1 :])


def _simpler_block(b: BlockSpec) -> Iterator[BlockSpec]:
    if b.inner is not None:
        yield dataclasses.replace(b, inner=None, inner_shard=False, tie_inner=False, inner_raf=None)
    for name, default in (
        ("calls", 1),
        ("output", "tensor"),
        ("ckpt", "none"),
        ("tie_inner", False),
        ("inner_shard", False),
        ("shard", True),
    ):
        if getattr(b, name) != default:
            yield dataclasses.replace(b, **{name: default})
    for name in ("raf", "inner_raf"):
        if getattr(b, name) is not None:
            yield dataclasses.replace(b, **{name: None})
    for layers in _simpler_layers(b.layers):
        yield dataclasses.replace(b, layers=layers)
    if b.inner is not None:
        for layers in _simpler_layers(b.inner):
            yield dataclasses.replace(b, inner=layers)


def simpler(c: CaseConfig) -> Iterator[CaseConfig]:
    """Candidate simplifications of ``c``, biggest first."""
    default = CaseConfig(ws=c.ws)
    for ws in (1, 2):
        if ws < c.ws:
            yield _with_ws(c, ws)
    for name in EVENT_FIELDS:
        seq = getattr(c, name)
        if seq:
            yield dataclasses.replace(c, **{name: ()})
        if len(seq) > 1:
            for i in range(len(seq)):
                yield dataclasses.replace(c, **{name: _without(seq, i)})
    if len(c.blocks) > 1:
        for i in range(len(c.blocks)):
            yield dataclasses.replace(c, blocks=_without(c.blocks, i))
    if c.steps > 1:
        yield dataclasses.replace(c, steps=c.steps - 1)
    for f in dataclasses.fields(CaseConfig):
        if f.name in ("ws", "seed", "blocks", "sabotage", "steps", *EVENT_FIELDS):
            continue
        if getattr(c, f.name) != getattr(default, f.name):
            extra: dict[str, Any] = {"prefetch_pairs": ()} if f.name == "prefetch" else {}
            if f.name in ("side", "side_unit"):
                extra["side_raf"] = None
            if f.name == "head_unit" and c.tie_embed != "list":
                extra["loss"] = "plain"
            yield dataclasses.replace(c, **{f.name: getattr(default, f.name)}, **extra)
    for i, b in enumerate(c.blocks):
        for nb in _simpler_block(b):
            yield dataclasses.replace(c, blocks=(*c.blocks[:i], nb, *c.blocks[i + 1 :]))


def shrink(c: CaseConfig, status: str, attempt: Callable[[CaseConfig], str], budget: int) -> tuple[CaseConfig, str]:
    """Greedy: take the first simpler configuration that fails the same way; repeat until none does."""
    want, tried = symptom_key(status), set()
    progress = True
    while progress and budget > 0:
        progress = False
        for cand in simpler(c):
            if budget <= 0:
                break
            if cand in tried or not _valid(cand):
                continue
            tried.add(cand)
            budget -= 1
            got = attempt(cand)
            if symptom_key(got) == want:
                c, status, progress = cand, got, True
                print(f"    shrunk: {got[:160]}", flush=True)  # noqa: T201
                break
    return c, status


# ----------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    from tests.pool import WorkerPool

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0:20", help="a:b (half-open) or a comma list")
    parser.add_argument("--ws", type=int, default=None, help="force the world size (else drawn from the seed)")
    parser.add_argument("--config", action="append", help="a CaseConfig(...) expression to run (repeatable)")
    parser.add_argument("--timeout", type=float, default=120.0, help="per case (collectives time out after 30 s)")
    parser.add_argument("--shrink", action="store_true", help="shrink every failure")
    parser.add_argument("--budget", type=int, default=100, help="runs per shrink")
    parser.add_argument("--jsonl", default=None, help="append one JSON line per case here")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every failure's full report")
    parser.add_argument(
        "--accelerator-side",
        action="store_true",
        help="take the accelerator side of the backward walk's waits (tests/test_accelerator_path.py)",
    )
    parser.add_argument(
        "--recording-streams",
        action="store_true",
        help="the accelerator side over simulated streams that check the buffer rule (tests/stream_sim.py)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a drawn field in every seeded case (a Python literal), e.g. full_precision_eval=False to leave "
        "a known failure out; cases the override makes invalid are skipped",
    )
    args = parser.parse_args(argv)
    if args.config:
        cases = [eval(c, vars(rm)) for c in args.config]  # a configuration this harness printed
    elif ":" in args.seeds:
        lo, hi = (int(v) for v in args.seeds.split(":"))
        cases = [config_from_seed(s, args.ws) for s in range(lo, hi)]
    else:
        cases = [config_from_seed(int(s), args.ws) for s in args.seeds.split(",")]
    if args.set and not args.config:
        overrides = {k: ast.literal_eval(v) for k, v in (item.split("=", 1) for item in args.set)}
        cases = [c for c in (dataclasses.replace(c, **overrides) for c in cases) if _valid(c)]
    pools: dict[int, WorkerPool] = {}

    def run(ws: int, fn: Any, *fargs: Any) -> list[Any]:
        if ws not in pools:
            pools[ws] = WorkerPool(ws)
        if args.recording_streams:
            from tests.stream_sim import on_recording_streams

            fn, fargs = on_recording_streams, (fn, *fargs)
        elif args.accelerator_side:
            from tests.test_accelerator_path import _on_accelerator_side

            fn, fargs = _on_accelerator_side, (fn, *fargs)
        return pools[ws].run(fn, *fargs, timeout=args.timeout)

    def attempt(cfg: CaseConfig) -> str:
        stats: dict[str, Any] = {}
        try:
            diff = check_case(run, cfg, stats)
            return f"PASS max|diff| {diff:.2e}, {stats['collectives']} collectives on rank 0, equal on every rank"
        except AssertionError as e:
            if args.verbose:
                print(str(e)[-4000:], flush=True)  # noqa: T201
            return symptom(str(e))

    failed = []
    try:
        for cfg in cases:
            start = time.monotonic()
            status = attempt(cfg)
            seconds = time.monotonic() - start
            print(f"seed {cfg.seed:5d} ws {cfg.ws} {seconds:5.1f}s {status}", flush=True)  # noqa: T201
            if args.jsonl:
                with open(args.jsonl, "a") as f:
                    f.write(json.dumps({"config": repr(cfg), "status": status, "seconds": seconds}) + "\n")
            if not status.startswith("PASS"):
                if args.shrink:
                    small, small_status = shrink(cfg, status, attempt, args.budget)
                    failed.append((cfg, status, small, small_status))
                else:
                    failed.append((cfg, status, None, None))
    finally:
        for pool in pools.values():
            pool.close()
    for cfg, status, small, small_status in failed:
        print(f"\n=== seed {cfg.seed}: {status}\n{cfg!r}")  # noqa: T201
        if small is not None:
            print(f"--- shrunk: {small_status}\n{small!r}")  # noqa: T201
    print(f"\n{len(cases) - len(failed)} passed, {len(failed)} failed of {len(cases)}")  # noqa: T201
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
