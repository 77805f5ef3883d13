"""PNG of a sweep: memory per rank against the mesh (needs the ``plot`` extra: ``pip install fsdp-compose[plot]``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .planner import PlanResult

__all__ = ["plot_sweep"]

_GIB = float(1 << 30)


_GROUPS = (  # stacked bar segments: (legend, labels of the measured breakdown, colour)
    (
        "sharded state (parameters, gradients, optimizer)",
        ("sharded parameters", "sharded gradients", "reduce-scatter output", "optimizer state", "batch"),
        "#4c72b0",
    ),
    ("gathered parameters", ("gathered parameters",), "#dd8452"),
    ("collective buffers", ("all-gather buffers", "reduce-scatter input", "all-reduce buffers"), "#937860"),
    ("unsharded gradients", ("unsharded gradients",), "#55a868"),
    ("activations and temporaries", ("activations and temporaries",), "#c44e52"),
)


def plot_sweep(results: Sequence[PlanResult], path: str | Path, *, title: str | None = None) -> Path:
    """One bar per mesh of the sweep: what is live at the backward peak, stacked (GiB per rank); the forward peak
    as a line and the analytic model's peaks (where it applies) as crosses."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("plotting needs matplotlib: pip install 'fsdp-compose[plot]'") from exc
    if not results:
        raise ValueError("nothing to plot: the sweep is empty")
    labels = [f"{r.config.world_size}\n{r.config.mesh_name().replace(' x ', chr(10))}" for r in results]
    xs = list(range(len(results)))
    fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=100)
    bottoms = [0.0] * len(results)
    for legend, names, colour in _GROUPS:
        heights = [sum(r.record.breakdown["backward"].get(n, 0) for n in names) / _GIB for r in results]
        ax.bar(xs, heights, 0.6, bottom=bottoms, label=legend, color=colour)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    ax.plot(xs, [r.record.peaks["forward"] / _GIB for r in results], "o--", color="black", label="forward peak")
    modelled = [(x, r.peak_model.peaks) for x, r in zip(xs, results, strict=True) if r.peak_model is not None]
    if modelled:
        for phase, marker in (("backward", "x"), ("forward", "+")):
            ax.plot(
                [x for x, _ in modelled],
                [peaks[phase] / _GIB for _, peaks in modelled],
                marker,
                color="black",
                markersize=11,
                linestyle="none",
                label=f"analytic model, {phase} peak",
            )
    ax.set_xticks(xs, labels, fontsize=8)
    ax.set_xlabel("ranks (mesh)")
    ax.set_ylabel("GiB per rank at the backward peak")
    ax.set_ylim(0, max(max(bottoms), max(r.record.peaks["forward"] for r in results) / _GIB) * 1.45)
    record, config = results[0].record, results[0].config
    precision = config.param_dtype or "fp32"
    ax.set_title(
        title
        or f"{config.model}: memory per rank (batch {config.batch_size} x {record.seq_len}, {precision}, "
        f"{config.optimizer})",
        fontsize=10,
    )
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", ncol=2)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out)
    plt.close(fig)
    return out
