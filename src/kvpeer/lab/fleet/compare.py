"""The fleet model against real engines: its predicted TTFT beside ``kvpeer bench trace``'s.

Rules:

1. A model run is matched to the bench arm of its policy's name (``affinity``,
   ``load``, ``kvpeer``); bounds and arms without a counterpart are left out. Of several
   model runs of one policy (links, loads), the first is taken.
2. For each of the mean, p50 and p90 TTFT: predicted, measured, their ratio (predicted /
   measured), and whether it lies within ``tolerance`` (issue 40: 25 %,
   ``|ratio - 1| <= 0.25``). A bench result saved before it reported the mean gives it
   from its turns' per-request TTFTs (the median over turns of each turn's mean); a
   figure either side still lacks is left out of the row.
3. The measured figure is the bench's reported one: the median over its turns.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

__all__ = ["TOLERANCE", "render_versus", "versus"]

TOLERANCE = 0.25
QUANTILES = ("mean", "p50", "p90")


def versus(model: Mapping[str, Any], bench: Mapping[str, Any],
           tolerance: float = TOLERANCE) -> list[dict[str, Any]]:  # fmt: skip
    """Rules 1-3: one row per arm both have, in the bench's order."""
    runs: dict[str, Mapping[str, Any]] = {}
    for run in model["runs"]:
        runs.setdefault(run["policy"], run)
    out = []
    for arm in bench["arms"]:
        run = runs.get(arm["arm"])
        if run is None:
            continue
        row: dict[str, Any] = {"arm": arm["arm"], "turns": arm.get("turns", 1)}
        for q in QUANTILES:
            predicted, measured = run.get(f"ttft_{q}_s"), arm.get(f"ttft_{q}_s")
            if q == "mean" and measured is None:
                measured = _turns_mean(bench, arm["arm"])
            if predicted is None or measured is None:
                continue
            ratio = predicted / measured if measured else None
            row[q] = {"predicted_s": predicted, "measured_s": measured, "ratio": ratio,
                      "within": ratio is not None and abs(ratio - 1.0) <= tolerance}
        row["reuse"] = {"predicted": run.get("reuse"), "measured": arm.get("reuse_realised")}
        out.append(row)
    return out


def _turns_mean(bench: Mapping[str, Any], arm: str) -> float | None:
    """Rule 2's mean of a result that did not report it: from its per-request rows."""
    means = [statistics.fmean(r[1] for r in turn["per_request"])
             for turn in bench.get("turns", ())
             if turn["arm"] == arm and turn.get("per_request")]
    return statistics.median(means) if means else None


def render_versus(rows: list[dict[str, Any]], tolerance: float = TOLERANCE) -> str:
    head = [f"{q + ' model':>10} {q + ' real':>9} {'ratio':>6}" for q in QUANTILES]
    lines = [f"{'arm':<10} {' '.join(head)}  within {100 * tolerance:.0f} %"]
    for row in rows:
        cells = []
        for q in QUANTILES:
            c = row.get(q)
            if c is None:
                cells.append(f"{'-':>10} {'-':>9} {'-':>6}")
                continue
            ratio = "-" if c["ratio"] is None else f"{c['ratio']:.2f}"
            cells.append(f"{c['predicted_s']:>10.3f} {c['measured_s']:>9.3f} {ratio:>6}")
        verdict = "yes" if all(row[q]["within"] for q in QUANTILES if q in row) else "no"
        lines.append(f"{row['arm']:<10} {' '.join(cells)}  {verdict}")
    return "\n".join(lines)
