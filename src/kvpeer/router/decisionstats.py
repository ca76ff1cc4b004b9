"""Counting plans and outcomes: what the router's decisions predicted against what the
engines reported, as plain numbers for the edge to export (router/metrics.py)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Final

from kvpeer.router.policy import Plan
from kvpeer.router.reasons import REASONS

__all__ = ["DecisionStats", "PredictionRecord"]

_ERROR_BUCKETS: Final = (-1024, -256, -64, -1, 0, 64, 256, 1024)  # actual - predicted


@dataclass(frozen=True, slots=True)
class PredictionRecord:
    request_id: str
    engine: str
    predicted_cached_tokens: int
    actual_cached_tokens: int | None
    predicted_ttft_s: float | None
    actual_ttft_s: float | None


class DecisionStats:
    """Counters of plans and outcomes, as plain numbers for the edge to export."""

    def __init__(self, recent: int) -> None:
        self._counts: dict[str, float] = {}
        self._reasons: dict[str, int] = dict.fromkeys(REASONS, 0)
        self._errors = [0] * (len(_ERROR_BUCKETS) + 1)
        self._recent: deque[PredictionRecord] = deque(maxlen=recent)

    def add(self, name: str, value: float = 1.0) -> None:
        self._counts[name] = self._counts.get(name, 0.0) + value

    def planned(self, plan: Plan) -> None:
        self.add("plans_total")
        self._reasons[plan.reason] = self._reasons.get(plan.reason, 0) + 1
        if plan.source is not None:
            self.add("pulls_planned_total")
        self.add("predicted_pulled_tokens_planned_total", plan.predicted_pulled_tokens)

    def finished(self, record: PredictionRecord) -> None:
        self._recent.append(record)
        if record.actual_cached_tokens is None:
            self.add("cached_tokens_unreported_total")
            return
        self.add("predicted_cached_tokens_total", record.predicted_cached_tokens)
        self.add("actual_cached_tokens_total", record.actual_cached_tokens)
        error = record.actual_cached_tokens - record.predicted_cached_tokens
        self.add("cached_tokens_abs_error_total", abs(error))
        bucket = next((i for i, le in enumerate(_ERROR_BUCKETS) if error <= le), -1)
        self._errors[bucket] += 1

    def recent(self) -> tuple[PredictionRecord, ...]:
        return tuple(self._recent)

    def snapshot(self) -> dict[str, float]:
        out = {
            name: 0.0
            for name in (
                "plans_total", "pulls_planned_total", "outcomes_total",
                "outcomes_failed_total", "outcomes_unmatched_total", "outcomes_warmup_total",
                "predicted_cached_tokens_total", "actual_cached_tokens_total",
                "cached_tokens_abs_error_total", "cached_tokens_unreported_total",
                "predicted_pulled_tokens_planned_total", "explorations_total",
            )
        }
        out.update(self._counts)
        for reason, count in self._reasons.items():
            out[f"plans_by_reason:{reason}"] = float(count)
        cumulative = 0
        for le, count in zip((*_ERROR_BUCKETS, "+Inf"), self._errors, strict=True):
            cumulative += count
            out[f"cached_tokens_error_bucket:le={le}"] = float(cumulative)
        return out
