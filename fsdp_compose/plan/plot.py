"""PNG of a sweep: memory per rank against the mesh (needs the ``plot`` extra: ``pip install fsdp-compose[plot]``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .planner import PlanResult

__all__ = ["plot_sweep"]

_GIB = float(1 << 30)


def plot_sweep(results: Sequence[PlanResult], path: str | Path, *, title: str | None = None) -> Path:
    """Stacked sharded state (parameters, gradients, optimizer state) and the forward / backward peaks per rank,
    one column per mesh of the sweep, on a log-scaled world-size axis when the meshes differ in size."""
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
    params = [r.record.sharded_param_bytes / _GIB for r in results]
    grads = [r.record.grad_bytes / _GIB for r in results]
    optimizer = [r.record.optimizer_bytes / _GIB for r in results]
    fig, ax = plt.subplots(figsize=(7.5, 4.2), dpi=100)
    ax.bar(xs, params, 0.6, label="sharded parameters", color="#4c72b0")
    ax.bar(xs, grads, 0.6, bottom=params, label="sharded gradients", color="#55a868")
    below = [p + g for p, g in zip(params, grads, strict=True)]
    ax.bar(xs, optimizer, 0.6, bottom=below, label="optimizer state", color="#c44e52")
    for phase, style in (("forward", "o--"), ("backward", "s-")):
        ax.plot(xs, [r.record.peaks[phase] / _GIB for r in results], style, color="black", label=f"peak ({phase})")
        if results[0].peak_model is not None:
            modelled = [(r.peak_model.peaks.get(phase, 0) if r.peak_model else 0) / _GIB for r in results]
            ax.plot(xs, modelled, "x", color="#dd8452", markersize=9, label=f"analytic peak ({phase})")
    ax.set_xticks(xs, labels, fontsize=8)
    ax.set_xlabel("ranks (mesh)")
    ax.set_ylabel("GiB per rank")
    ax.set_yscale("log")
    config = results[0].config
    ax.set_title(
        title or f"{config.model}: memory per rank (batch {config.batch_size} x seq {config.seq_len or 'default'})",
        fontsize=10,
    )
    ax.grid(axis="y", alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out)
    plt.close(fig)
    return out
