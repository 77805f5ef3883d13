"""``python -m fsdp_compose.plan``: plan a model's memory and communication per rank on N simulated ranks.

Examples::

    python -m fsdp_compose.plan --model llama-70b --world-size 1024 --param-dtype bf16 --reduce-dtype fp32
    python -m fsdp_compose.plan --model llama-8b --world-size 64 --replicate 8           # HSDP 8 x 8
    python -m fsdp_compose.plan --model llama-8b --world-size 64 --tp 8                  # FSDP 8 x TP 8
    python -m fsdp_compose.plan --model moe-30b-a3b --world-size 64 --ep 8 --param-dtype bf16   # experts on EP 8
    python -m fsdp_compose.plan --model gpt --sweep 8,64,256,1024 --plot sweep.png --json sweep.json
    python -m fsdp_compose.plan --model mypkg.models:build --model-arg width=4096 --world-size 128
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from .models import PRESETS
from .planner import PlanResult, plan, sweep
from .report import render, render_sweep
from .step import DTYPES, OPTIMIZERS, PlanConfig


def _reshard(value: str) -> bool | int:
    lowered = value.lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected true, false or an integer, got {value!r}") from None


def _model_arg(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected key=value, got {text!r}")
    return key, value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fsdp_compose.plan",
        description="Memory and communication per rank of fsdp_compose training, simulated in one process on "
        "torch's fake process group (no GPUs, no model memory).",
        epilog=__doc__.split("Examples::", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="gpt", help=f"a preset ({', '.join(PRESETS)}) or package.module:function")
    p.add_argument("--model-arg", action="append", type=_model_arg, default=[], metavar="KEY=VALUE")
    p.add_argument("--world-size", "-n", type=int, default=8, help="total ranks (default 8)")
    p.add_argument("--replicate", type=int, default=1, help="HSDP: replicate degree (shard = N / replicate / tp)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (the model's TP plan)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree (MoE models: experts on their own mesh)")
    p.add_argument("--rank", type=int, default=0, help="the rank to simulate (default 0)")
    p.add_argument("--param-dtype", choices=sorted(DTYPES), help="MixedPrecisionPolicy.param_dtype")
    p.add_argument("--reduce-dtype", choices=sorted(DTYPES), help="MixedPrecisionPolicy.reduce_dtype")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    p.add_argument("--foreach", action="store_true", help="multi-tensor optimizer (torch's CUDA default; slower)")
    p.add_argument("--reshard-after-forward", type=_reshard, default=True, metavar="true|false|K")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per data-parallel rank (default 1)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's, else 2048)")
    p.add_argument("--activation-checkpointing", action="store_true", help="checkpoint every block")
    p.add_argument("--sweep", help="comma-separated meshes: world sizes (8,64,1024) or RxS for HSDP (4x256)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON ('-': standard output)")
    p.add_argument("--plot", metavar="PATH", help="PNG of the sweep's memory per rank (needs matplotlib)")
    p.add_argument("--quiet", "-q", action="store_true", help="no table, no progress")
    return p


def _config(ns: argparse.Namespace) -> PlanConfig:
    return PlanConfig(
        model=ns.model,
        model_args=dict(ns.model_arg),
        world_size=ns.world_size,
        replicate=ns.replicate,
        tp=ns.tp,
        ep=ns.ep,
        rank=ns.rank,
        param_dtype=ns.param_dtype,
        reduce_dtype=ns.reduce_dtype,
        optimizer=ns.optimizer,
        foreach=ns.foreach,
        reshard_after_forward=ns.reshard_after_forward,
        batch_size=ns.batch_size,
        seq_len=ns.seq_len,
        activation_checkpointing=ns.activation_checkpointing,
    )


def _progress(quiet: bool) -> Any:
    def report(index: int, total: int, config: PlanConfig, result: PlanResult | None) -> None:
        if quiet:
            return
        if result is None:
            print(f"[{index + 1}/{total}] planning {config.world_size} ranks ({config.mesh_name()}) ...", flush=True)
        else:
            peak = max(result.record.peaks.values()) / (1 << 30)
            print(f"[{index + 1}/{total}] done in {result.seconds:.1f} s: peak {peak:.2f} GiB per rank", flush=True)

    return report


def main(argv: list[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    base = _config(ns)
    try:
        if ns.sweep:
            meshes = [item for item in ns.sweep.split(",") if item.strip()]
            results = sweep(base, meshes, progress=_progress(ns.quiet or ns.json == "-"))
        else:
            results = [plan(replace(base))]
    except (ValueError, TypeError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not ns.quiet and ns.json != "-":
        print(render_sweep(results) + "\n" if len(results) > 1 else render(results[0]))
    if ns.json:
        payload = [r.as_dict() for r in results] if len(results) > 1 else results[0].as_dict()
        text = json.dumps(payload, indent=1)
        if ns.json == "-":
            print(text)
        else:
            Path(ns.json).write_text(text + "\n")
    if ns.plot:
        from .plot import plot_sweep

        print(f"wrote {plot_sweep(results, ns.plot)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
