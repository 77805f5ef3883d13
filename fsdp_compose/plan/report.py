"""Text tables of a plan and of a sweep."""

from __future__ import annotations

from collections.abc import Sequence

from .planner import PlanResult
from .step import PHASES, moves_activations

__all__ = ["fmt_bytes", "render", "render_sweep"]

_UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def fmt_bytes(nbytes: float) -> str:
    """``1.50 GiB``, ``12.3 MiB``, ``512 B``."""
    for name, size in _UNITS:
        if abs(nbytes) >= size:
            value = nbytes / size
            return f"{value:.2f} {name}" if value < 100 else f"{value:.1f} {name}"
    return f"{int(nbytes)} B"


def _ratio(measured: float, reference: float) -> str:
    return f"{measured / reference:.4f}" if reference else "-"


def _table(rows: Sequence[Sequence[str]], right: Sequence[int] = ()) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for index, row in enumerate(rows):
        cells = [cell.rjust(widths[i]) if i in right else cell.ljust(widths[i]) for i, cell in enumerate(row)]
        lines.append("  " + "  ".join(cells).rstrip())
        if index == 0:
            lines.append("  " + "  ".join("-" * width for width in widths))
    return lines


def _describe(result: PlanResult) -> list[str]:
    config, record = result.config, result.record
    reduce = config.reduce_dtype or "as param_dtype"
    precision = f"param_dtype {config.param_dtype or 'as stored'}, reduce_dtype {reduce}"
    raf = config.reshard_after_forward
    seq = record.seq_len
    return [
        f"fsdp_compose plan: {config.model} on {config.world_size} ranks ({config.mesh_name()}), rank {config.rank}",
        f"  {record.parameters / 1e9:.3f} B parameters in {record.units} units; {precision}; optimizer "
        f"{config.optimizer}; reshard_after_forward={raf}; batch {config.batch_size} x seq {seq} per data-parallel "
        f"rank; activation checkpointing {'on' if config.activation_checkpointing else 'off'}",
        f"  simulated in {result.seconds:.1f} s, {record.ops} ops in the measured step",
    ]


def _memory(result: PlanResult) -> list[str]:
    record, state, model = result.record, result.state, result.peak_model
    rows = [["memory per rank", "measured", "analytic", "measured / analytic"]]
    for label, measured, analytic in (
        ("sharded parameters", record.sharded_param_bytes, state.params),
        ("gradients (sharded)", record.grad_bytes, state.grads),
        ("optimizer state", record.optimizer_bytes, state.optimizer),
    ):
        rows.append([label, fmt_bytes(measured), fmt_bytes(analytic), _ratio(measured, analytic)])
    floor = result.floor_bytes
    total = record.sharded_param_bytes + record.grad_bytes + record.optimizer_bytes
    rows.append(["state vs ZeRO-3 floor (no padding)", fmt_bytes(total), fmt_bytes(floor), _ratio(total, floor)])
    for phase in PHASES:
        modelled = model.peaks.get(phase) if model is not None else None
        measured = record.peaks[phase]
        rows.append(
            [
                f"peak during {phase}",
                fmt_bytes(measured),
                fmt_bytes(modelled) if modelled is not None else "-",
                _ratio(measured, modelled) if modelled else "-",
            ]
        )
    return _table(rows, right=(1, 2, 3))


def _composition(result: PlanResult, phase: str) -> list[str]:
    record = result.record
    peak = record.peaks[phase]
    op = record.peak_ops[phase].replace("aten.", "")
    lines = [f"live at the {phase} peak ({fmt_bytes(peak)}, after {op or 'the start'}):"]
    rows = [["what", "bytes", "share"]]
    for name, nbytes in record.breakdown[phase].items():
        rows.append([name, fmt_bytes(nbytes), f"{100 * nbytes / peak:.1f}%" if peak else "-"])
    lines += _table(rows, right=(1, 2))
    gathered = record.gathered_at_peak[phase]
    if gathered:
        units = ", ".join(f"{name} {fmt_bytes(n)}" for name, n in gathered.items())
        lines.append(f"  gathered units: {units}")
    return lines


def _collectives(result: PlanResult) -> list[str]:
    record = result.record
    rows = [["collectives per step", "group", "calls", "bytes", "minimum", "bytes / minimum"]]
    for kind, groups in record.collectives.items():
        fsdp_groups = record.fsdp_collectives().get(kind, {})
        minimum = result.min_collectives.get(kind, 0)
        kind_bytes = sum(g["bytes"] for g in fsdp_groups.values())
        first = True
        for group, figures in groups.items():
            show = first and not moves_activations(kind, group) and minimum > 0
            rows.append(
                [
                    kind,
                    group,
                    str(figures["calls"]),
                    fmt_bytes(figures["bytes"]),
                    fmt_bytes(minimum) if show else "-",
                    (_ratio(kind_bytes, minimum) + (" (all groups)" if len(fsdp_groups) > 1 else "")) if show else "-",
                ]
            )
            first = first and not show
    fsdp = record.fsdp_collective_bytes
    minimum = sum(result.min_collectives.values())
    rows.append(["total (FSDP)", "", "", fmt_bytes(fsdp), fmt_bytes(minimum), _ratio(fsdp, minimum)])
    ideal = result.ideal_collective_bytes
    rows.append(["total without padding", "", "", "", fmt_bytes(ideal), _ratio(fsdp, ideal)])
    return _table(rows, right=(2, 3, 4, 5))


def _meshes(result: PlanResult) -> list[str]:
    """Per data-parallel mesh (shown when the experts have their own): what this rank holds and moves on it."""
    meshes = result.record.meshes
    if len(meshes) < 2:
        return []
    rows = [["per mesh", "dims", "parameters", "sharded", "gradients", "optimizer", "all-gather", "reduce-scatter"]]
    for name, figures in meshes.items():
        dims = " x ".join(f"{dim} {size}" for dim, size in figures["dims"].items())
        rows.append(
            [
                name,
                dims,
                f"{figures['parameters'] / 1e6:.2f} M",
                *(fmt_bytes(figures[key]) for key in ("sharded_param_bytes", "grad_bytes", "optimizer_bytes")),
                *(fmt_bytes(figures[key]) for key in ("all_gather", "reduce_scatter")),
            ]
        )
    return [*_table(rows, right=tuple(range(2, 8))), ""]


def _schedule(result: PlanResult) -> list[str]:
    """The engine's declared schedule of the planned model (what fc.describe_schedule prints), in one line each."""
    schedule = result.record.schedule
    if not schedule:
        return []
    return [
        "schedule (the engine's): units " + ", ".join(u["name"] for u in schedule["units"]) + " (registration order)",
        "  backward all-gathers: " + " -> ".join(schedule["gather_order"]),
        "  reductions: " + " -> ".join(schedule["reduce_order"]),
        "",
    ]


def render(result: PlanResult) -> str:
    """The full text report of one plan."""
    lines = [*_describe(result), "", *_schedule(result), *_meshes(result), *_memory(result)]
    for phase in ("forward", "backward"):
        lines += ["", *_composition(result, phase)]
    lines += [""] + _collectives(result) + [""] + [f"note: {note}" for note in result.notes]
    return "\n".join(lines)


def render_sweep(results: Sequence[PlanResult]) -> str:
    """One row per mesh: state, peaks and collective bytes per rank."""
    rows = [
        [
            "ranks",
            "mesh",
            "params",
            "grads",
            "optimizer",
            "peak fwd",
            "peak bwd",
            "peak opt",
            "collectives",
            "coll / min",
            "plan s",
        ]
    ]
    for result in results:
        record = result.record
        minimum = sum(result.min_collectives.values())
        fsdp = record.fsdp_collective_bytes
        rows.append(
            [
                str(result.config.world_size),
                result.config.mesh_name(),
                fmt_bytes(record.sharded_param_bytes),
                fmt_bytes(record.grad_bytes),
                fmt_bytes(record.optimizer_bytes),
                *(fmt_bytes(record.peaks[phase]) for phase in PHASES),
                fmt_bytes(record.collective_bytes),
                _ratio(fsdp, minimum) if minimum else "-",
                f"{result.seconds:.1f}",
            ]
        )
    return "\n".join(_table(rows, right=tuple(range(2, 11))))
