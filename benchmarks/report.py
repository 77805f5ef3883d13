"""Markdown tables from the benchmark results, and the marked section of docs/benchmarks.md they replace."""

from __future__ import annotations

import datetime
import platform
import statistics
from pathlib import Path
from typing import Any

import torch

__all__ = ["END_MARKER", "START_MARKER", "markers", "render_tables", "write_section"]

START_MARKER = "<!-- bench:start -->"
END_MARKER = "<!-- bench:end -->"
NA = "n/a"
MIB = 2**20
IMPLS = ("fsdp_compose", "torch_fsdp2", "ddp")
TIME_HEADER = ["config", "fsdp_compose ms", "torch FSDP2 ms", "DDP ms", "fc / FSDP2", "fc / DDP"]
TIME_HEADER += ["CPU ms all ranks fc / FSDP2 / DDP", "CPU fc / FSDP2", "final loss fc/FSDP2/DDP"]
MEMORY_HEADER = ["config", "fsdp_compose", "torch FSDP2", "DDP", "fc / FSDP2", "fc / DDP", "DDP buckets"]
MEMORY_HEADER += ["ops fc/FSDP2/DDP", "step peaks fc / FSDP2"]
COMM_HEADER = ["config", "fsdp_compose", "torch FSDP2", "minimum", "fc / minimum", "fc calls", "DDP all-reduce"]


def _ms(values: list[float]) -> str:
    return f"{1000 * statistics.median(values):.1f}" if values else NA


def _ratio(num: list[float] | None, den: list[float] | None) -> str:
    if not num or not den:
        return NA
    return f"{statistics.median(a / b for a, b in zip(num, den, strict=True)):.2f}"


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _table(header: list[str], rows: list[list[str]]) -> str:
    align = ["---"] + ["---:"] * (len(header) - 1)
    return "\n".join([_row(header), _row(align), *(_row(r) for r in rows)])


def _time_row(res: dict[str, Any]) -> list[str]:
    times: dict[str, list[float]] = res["times"]
    fc, fsdp2, ddp = (times.get(name) for name in IMPLS)
    losses = " / ".join(f"{res['loss'][n]:.4f}" if n in res["loss"] else NA for n in IMPLS)
    cpu: dict[str, float] = res.get("cpu", {})
    cpu_ms = " / ".join(f"{1000 * cpu[n]:.0f}" if n in cpu else NA for n in IMPLS)
    cpu_ratio = (
        f"{cpu['fsdp_compose'] / cpu['torch_fsdp2']:.2f}" if {"fsdp_compose", "torch_fsdp2"} <= cpu.keys() else NA
    )
    return [
        res["config"],
        *(_ms(t) if t else NA for t in (fc, fsdp2, ddp)),
        _ratio(fc, fsdp2),
        _ratio(fc, ddp),
        cpu_ms,
        cpu_ratio,
        losses,
    ]


def _mem_cell(entry: dict[str, Any] | str | None) -> str:
    if not isinstance(entry, dict):
        return NA
    return f"{entry['peak'] / MIB:.2f} ({entry['baseline'] / MIB:.2f})"


def _memory_row(res: dict[str, Any]) -> list[str]:
    mem = res["memory"]
    fc, fsdp2 = mem.get("fsdp_compose"), mem.get("torch_fsdp2")
    ratio = f"{fc['peak'] / fsdp2['peak']:.2f}" if isinstance(fc, dict) and isinstance(fsdp2, dict) else NA
    ddp = mem.get("ddp")
    ddp_ratio = f"{fc['peak'] / ddp['peak']:.2f}" if isinstance(fc, dict) and isinstance(ddp, dict) else NA
    buckets = f"{ddp['hidden'] / MIB:.2f}" if isinstance(ddp, dict) else NA
    ops = " / ".join(str(mem[n]["ops"]) if isinstance(mem.get(n), dict) else NA for n in IMPLS)
    spread = " / ".join(_peak_range(mem.get(n)) for n in IMPLS[:2])
    return [res["config"], _mem_cell(fc), _mem_cell(fsdp2), _mem_cell(ddp), ratio, ddp_ratio, buckets, ops, spread]


def _peak_range(entry: dict[str, Any] | str | None) -> str:
    """The lowest and highest of the measured steps' peaks."""
    if not isinstance(entry, dict):
        return NA
    return f"{entry['peak_low'] / MIB:.2f}-{entry['peak'] / MIB:.2f}"


def _comm_row(res: dict[str, Any]) -> list[str]:
    coll = res["collectives"]
    fc, fsdp2, minimum = coll.get("fsdp_compose"), coll.get("torch_fsdp2"), coll["min"]

    def mib(entry: dict[str, Any] | None) -> str:
        return f"{entry['bytes'] / MIB:.3f}" if entry else NA

    ratio = f"{fc['bytes'] / minimum:.4f}" if fc and minimum else NA
    calls = " / ".join(f"{k} {v}" for k, v in sorted(fc["calls"].items())) if fc else NA
    ddp = f"{coll['ddp_allreduce'] / MIB:.3f}"
    return [res["config"], mib(fc), mib(fsdp2), f"{minimum / MIB:.3f}", ratio, calls, ddp]


def _header(args: Any, command: str, elapsed: float) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"Command: `{command}`\n\n"
        f"Date: {now}; torch {torch.__version__}; Python {platform.python_version()} on {platform.machine()}; "
        f"{args.nproc} gloo CPU ranks x 1 torch thread; wall time {elapsed:.0f} s.\n\n"
        f"Model: examples/gpt_model.py GPT, dim={args.dim} layers={args.layers} heads={args.heads} seq={args.seq} "
        f"vocab={args.vocab}; batch {args.batch} sequences per rank; AdamW(lr=1e-3); seed {args.seed}. "
        f"Configs: {', '.join(args.configs)}. Timing: {args.steps} interleaved rounds, first {args.warmup} dropped."
    )


def _notes(results: list[dict[str, Any]]) -> str:
    lines = []
    for res in results:
        for name, reason in res["na"].items():
            lines.append(f"- {res['config']} / {name}: n/a — {reason}")
    return "\n".join(lines)


def _frozen_summary(results: list[dict[str, Any]], args: Any) -> str:
    """fsdp_compose's frozen-parameter modes against DDP: peak memory and collective bytes, one line each."""
    lines = []
    for res in results:
        if not res["config"].startswith("frozen"):
            continue
        mem, coll = res.get("memory", {}), res["collectives"]
        fc, ddp = mem.get("fsdp_compose"), mem.get("ddp")
        mode = "replicate" if res["config"] == "frozen_replicate" else "shard"
        text = f'- `frozen_params="{mode}"` ({res["config"]}): '
        if args.memory and isinstance(fc, dict) and isinstance(ddp, dict):
            verdict = "<=" if fc["peak"] <= ddp["peak"] else ">"
            text += f"peak {fc['peak'] / MIB:.2f} MiB {verdict} DDP's {ddp['peak'] / MIB:.2f} MiB, "
            text += f"start-of-step {fc['baseline'] / MIB:.2f} MiB; "
        if "fsdp_compose" in coll:
            text += f"collectives {coll['fsdp_compose']['bytes'] / MIB:.3f} MiB per step per rank"
        lines.append(text.rstrip("; ,") + ".")
    if not lines:
        return ""
    return "**Frozen parameters** (every block but the last frozen), fsdp_compose against DDP:\n\n" + "\n".join(lines)


def render_tables(results: list[dict[str, Any]], args: Any, command: str, elapsed: float) -> str:
    """The whole report: header, step time, memory, communication, n/a reasons."""
    time_table = _table(TIME_HEADER, [_time_row(r) for r in results])
    parts = [
        _header(args, command, elapsed),
        "**Step time** — median ms per step; ratios are medians of per-round ratios (< 1: fsdp_compose faster). "
        "CPU: the processes' CPU ms per step (every thread, gloo's included) summed over the ranks, averaged over "
        "the timed rounds: with more ranks than cores the step time follows it.",
        time_table,
    ]
    if args.memory:
        parts += [
            f"**Peak live tensor MiB**: the highest of {args.memory_steps} non-timed steps, each implementation "
            "alone, max over ranks; start-of-step MiB (parameters, optimizer state, persistent buffers) in brackets; "
            "the lowest and highest step in the last column (a step's peak depends on when gloo's thread lets go of "
            "a finished collective's buffers). "
            "DDP buckets: C++-only buffers first touched in backward, counted as alive since the start. "
            "Ops: ATen ops per step as the dispatch mode sees them (a DTensor op counts once), rank 0.",
            _table(
                MEMORY_HEADER,
                [_memory_row(r) for r in results],
            ),
        ]
    parts += [
        "**Collective MiB per step per rank** (all-gather output + reduce-scatter input + all-reduce tensor). "
        "Minimum: all-gather of the padded parameters in forward, again in backward for resharded units "
        "(not the root), reduce-scatter of the padded trainable parameters. DDP: all-reduced gradient bytes, "
        "computed (its C++ reducer is not hooked); a ring all-reduce moves about twice that. frozen_replicate: "
        "fsdp_compose keeps frozen parameters whole on every rank, so the minimum counts no all-gather for the "
        "frozen units (torch FSDP2 has no such option and shards them as in frozen).",
        _table(
            COMM_HEADER,
            [_comm_row(r) for r in results],
        ),
    ]
    frozen = _frozen_summary(results, args)
    if frozen:
        parts.append(frozen)
    notes = _notes(results)
    if notes:
        parts.append(notes)
    return "\n\n".join(parts) + "\n"


def markers(name: str) -> tuple[str, str]:
    """The start and end markers of the section ``name`` (``bench``: run.py's)."""
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def write_section(path: Path, body: str, name: str = "bench") -> None:
    """Replace the text between the ``name`` markers in ``path`` (appended, or a new file, when absent)."""
    start_marker, end_marker = markers(name)
    section = f"{start_marker}\n{body}{end_marker}"
    text = path.read_text() if path.exists() else "# Benchmarks\n\nSee benchmarks/README.md for what is measured.\n"
    start, end = text.find(start_marker), text.find(end_marker)
    if start != -1 and end > start:
        text = text[:start] + section + text[end + len(end_marker) :]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
