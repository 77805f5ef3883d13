"""Analytic model of the peak (placeholder)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .step import PlanConfig, StepRecord


@dataclass(frozen=True)
class PeakModel:
    peaks: dict[str, int]
    terms: dict[str, dict[str, int]]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def peak_model(config: PlanConfig, record: StepRecord) -> PeakModel | None:
    return None
