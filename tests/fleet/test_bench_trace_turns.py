"""``kvpeer bench trace`` in turns (``--repeat``), its per-request record, and the context
fit it shares with ``kvpeer lab fleet --context``: without engines."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpeer.errors import ConfigError
from kvpeer.lab.bench.serve_stats import FleetCounters, RequestRecord
from kvpeer.lab.bench.trace_bench import MEDIAN_FIELDS, TraceBenchSpec, median_rows, summarise
from kvpeer.lab.trace.mooncake import TraceRequest
from kvpeer.lab.trace.scaling import fit_context


def row(arm: str, p50: float, reuse: float | None = 0.5, errors: int = 0) -> dict[str, object]:
    return {"arm": arm, "requests": 3, "errors": errors, "slo_s": 2.0, "reusable_tokens": 64,
            "ttft_mean_s": p50 + 0.1, "ttft_p50_s": p50, "ttft_p90_s": 2 * p50,
            "ttft_p99_s": 3 * p50, "goodput": 1.0, "reuse_realised": reuse}


def test_an_arms_figures_are_the_median_of_its_turns_in_first_seen_order() -> None:
    turns = [row("kvpeer", 1.0), row("affinity", 5.0), row("kvpeer", 3.0, errors=1),
             row("affinity", 4.0), row("kvpeer", 2.0)]
    kvpeer, affinity = median_rows(turns)
    assert (kvpeer["arm"], kvpeer["turns"], kvpeer["errors"]) == ("kvpeer", 3, 1)
    assert kvpeer["ttft_p50_s"] == 2.0
    assert kvpeer["ttft_mean_s"] == pytest.approx(2.1)
    assert kvpeer["ttft_p90_s"] == 4.0
    assert affinity["ttft_p50_s"] == 4.5  # an even count: the middle two's mean
    assert set(MEDIAN_FIELDS) <= set(kvpeer)
    # a turn without a figure leaves the arm without it
    (partial,) = median_rows([row("load", 1.0), row("load", 2.0, reuse=None)])
    assert partial["reuse_realised"] is None


@pytest.mark.parametrize("repeat", [0, 21])
def test_repeat_is_bounded(tmp_path: Path, repeat: int) -> None:
    with pytest.raises(ConfigError, match="--repeat"):
        TraceBenchSpec(tmp_path / "t.jsonl", repeat=repeat)


def test_a_row_keeps_each_requests_ttft_engine_and_plan_and_the_mean() -> None:
    ok = RequestRecord(0.5, 0.25, 0.75, 64, 2, 32, engine="a", plan="pull")
    other = RequestRecord(1.0, 0.75, 1.0, 96, 2, 0, engine="b", plan="compute")
    failed = RequestRecord(1.5, 0.0, 0.0, 64, 0, None, error="boom")
    summary = summarise("kvpeer", [ok, other, failed], FleetCounters(32, 0, (), 0.0), 64, 2.0)
    assert summary["ttft_mean_s"] == pytest.approx(0.5)
    assert summary["per_request"] == [[0.5, 0.25, 64, "a", "pull"],
                                      [1.0, 0.75, 96, "b", "compute"]]


def test_a_request_is_fitted_to_a_context_keeping_its_first_blocks() -> None:
    long = TraceRequest(1, 0, 5000, 3000, tuple(range(157)), 32)
    fit = fit_context(long, 2048)
    assert fit.output_length == 512  # a quarter of the context
    assert fit.input_length == 2048 - 512 - 1
    assert fit.hash_ids == tuple(range(-(-1535 // 32)))  # its first 48 blocks
    short = TraceRequest(2, 0, 100, 0, (7, 8, 9, 10), 32)
    assert fit_context(short, 2048) == TraceRequest(2, 0, 100, 1, (7, 8, 9, 10), 32)
