"""The router overhead bench's arithmetic and argument handling (fast; no processes)."""

from __future__ import annotations

import pytest

from kvpeer.cli import build_parser
from kvpeer.lab.bench.router_bench import (
    RepeatResult,
    RouterBenchSpec,
    percentile,
    render,
    summarize,
)


def test_percentile_interpolates_between_ranks() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)


def test_summary_is_medians_over_repeats_of_per_repeat_differences() -> None:
    def repeat(base: float, added: float, rps: float, cpu: float) -> RepeatResult:
        direct = [base] * 100
        return RepeatResult(direct, [base + added] * 100, rps * 2, rps, cpu, 1000)

    repeats = [repeat(0.001, 0.0005, 1000, 0.5), repeat(0.002, 0.0007, 900, 0.4),
               repeat(0.009, 0.0100, 100, 1.0)]  # one disturbed repeat
    summary = summarize(repeats)
    assert summary["direct_p50_ms"] == pytest.approx(2.0)
    assert summary["added_p50_ms"] == pytest.approx(0.7)
    assert summary["router_rps"] == 900
    assert summary["direct_rps"] == 1800
    assert summary["router_capacity_rps_per_core"] == pytest.approx(2000)
    text = render({"spec": {"requests": 100, "repeats": 3, "stream": False,
                            "prompt_tokens": 256, "concurrency": 32},
                   "router_cpu": 1, "summary": summary})
    assert "latency p50 (ms)" in text
    assert "0.700" in text


def test_arguments() -> None:
    parse = build_parser().parse_args
    assert RouterBenchSpec.from_args(parse(["bench", "router", "--quick"])).requests == 300
    spec = RouterBenchSpec.from_args(parse(
        ["bench", "router", "--requests", "10", "--concurrency", "4", "--stream"]))
    assert (spec.requests, spec.concurrency, spec.repeats, spec.stream) == (10, 4, 3, True)
    with pytest.raises(ValueError, match="requests must be at least 1"):
        RouterBenchSpec(requests=0)
