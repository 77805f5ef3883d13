"""``plan(config)``: one simulated rank's memory and communication for a training step; ``sweep`` over meshes."""

from __future__ import annotations

import gc
import logging
import resource
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .analytic import StateBytes, ideal_collective_bytes, min_collective_bytes, sharded_state, zero3_floor
from .peak_model import PeakModel, peak_model
from .simulate import fake_process_group, fake_tensors
from .step import PlanConfig, StepRecord, build_mesh, measure_step

__all__ = ["PlanResult", "parse_mesh", "plan", "sweep"]

logger = logging.getLogger(__name__)


@dataclass
class PlanResult:
    """The measured step of one rank (:class:`StepRecord`), the closed-form figures, and what was not simulated."""

    config: PlanConfig
    record: StepRecord
    state: StateBytes
    floor_bytes: int
    min_collectives: dict[str, int]
    ideal_collective_bytes: int
    peak_model: PeakModel | None
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    max_rss_bytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "config": asdict(self.config),
            "measured": self.record.as_dict(),
            "analytic": {
                "state": asdict(self.state),
                "zero3_floor": self.floor_bytes,
                "min_collectives": self.min_collectives,
                "ideal_collective_bytes": self.ideal_collective_bytes,
                "peak_model": None if self.peak_model is None else self.peak_model.as_dict(),
            },
            "notes": self.notes,
            "seconds": round(self.seconds, 3),
            "max_rss_bytes": self.max_rss_bytes,
        }


def _max_rss() -> int:
    """This process's peak resident set size so far, in bytes."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def _notes(config: PlanConfig, record: StepRecord) -> list[str]:
    notes = [
        "Simulated: this rank runs fsdp_compose's own step on torch's fake process group under FakeTensorMode "
        "(CPU kernels' memory behaviour; collectives complete at once, so there are no times, but every buffer "
        "lives exactly as long as the program keeps it).",
        "Not simulated: the backend's own buffers (gloo copies a reduce-scatter's input while it runs; NCCL keeps "
        "internal buffers), the CUDA caching allocator's reserve and fragmentation, and CUDA kernels that save "
        "other tensors than the CPU ones (e.g. a math SDPA fallback saving the attention matrix).",
    ]
    if config.shard > 1:
        notes.append(
            f"Rank {config.rank}: ranks differ only by their share of uneven dim-0 splits (torch.chunk gives the "
            "first ranks the full ceil(dim0/shards) rows; the flat buffers are padded to that on every rank)."
        )
    if config.tp > 1:
        notes.append(
            "Tensor parallel: DTensor's redistributions are counted as the collectives it issues (group 'tp'); "
            "they carry activations, so no minimum is given for them."
        )
    if config.ep > 1:
        notes.append(
            f"Expert parallel: each ep rank holds 1/{config.ep} of the experts, sharded over efsdp "
            f"({config.expert_shard} ranks); the all-to-alls move tokens (activations, no minimum), as many as a "
            "balanced routing would: every expert takes its capacity's worth of rows, used or not."
        )
    if not config.foreach and config.optimizer != "none":
        notes.append(
            "Optimizer: the per-parameter loop (torch's CPU default); torch's CUDA default, foreach=True, adds "
            "temporaries in the optimizer phase (planning with --foreach is exact but slower)."
        )
    if record.sharding_propagations > 0:
        notes.append(
            f"DTensor propagated shardings {record.sharding_propagations} time(s) in the measured step (a first use "
            "of some op): under FakeTensorMode its metadata-only tensors are counted, which a real run does not; "
            "the peaks may be overstated where they coincide (plan with more warm-up steps)."
        )
    return notes


def plan(config: PlanConfig) -> PlanResult:
    """Simulate rank ``config.rank`` of ``config.world_size`` for one training step in this process.

    The process must not have a default process group (the fake one is set up and torn down here).
    """
    config.validate()
    start = time.perf_counter()
    with fake_process_group(config.world_size, config.rank):
        mesh = build_mesh(config)
        with fake_tensors():
            record = measure_step(config, mesh, fake=True)
        del mesh
    units = record.unit_params
    result = PlanResult(
        config=config,
        record=record,
        state=sharded_state(units, config),
        floor_bytes=zero3_floor(units, config),
        min_collectives=min_collective_bytes(units, config),
        ideal_collective_bytes=ideal_collective_bytes(units, config),
        peak_model=peak_model(config, record),
        notes=_notes(config, record),
    )
    gc.collect()
    result.seconds = time.perf_counter() - start
    result.max_rss_bytes = _max_rss()
    logger.info("planned %s on %s in %.1f s", config.model, config.mesh_name(), result.seconds)
    return result


def parse_mesh(text: str, base: PlanConfig) -> PlanConfig:
    """``"1024"``: that world size with ``base``'s replicate and tp degrees; ``"4x256"``: HSDP replicate 4 x shard
    256 (times ``base.tp``)."""
    parts = text.lower().replace(" ", "").split("x")
    try:
        sizes = [int(part) for part in parts]
    except ValueError:
        raise ValueError(f"mesh {text!r}: expected N or RxS (integers)") from None
    if len(sizes) == 1:
        return replace(base, world_size=sizes[0])
    if len(sizes) == 2:
        return replace(base, world_size=sizes[0] * sizes[1] * base.tp, replicate=sizes[0])
    raise ValueError(f"mesh {text!r}: expected N or RxS")


def sweep(
    base: PlanConfig,
    meshes: Sequence[str],
    progress: Callable[[int, int, PlanConfig, PlanResult | None], None] | None = None,
) -> list[PlanResult]:
    """``plan`` for each mesh of ``meshes`` (see :func:`parse_mesh`), one after the other in this process.

    ``progress(index, total, config, result)`` is called before each plan (``result`` None) and after it.
    """
    configs = [parse_mesh(text, base) for text in meshes]
    for config in configs:
        config.validate()
    results = []
    for index, config in enumerate(configs):
        if progress is not None:
            progress(index, len(configs), config, None)
        result = plan(config)
        results.append(result)
        if progress is not None:
            progress(index, len(configs), config, result)
    return results
