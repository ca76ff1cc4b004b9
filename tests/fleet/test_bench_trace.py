"""``kvpeer bench trace`` without engines: the window's requests, reuse, the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpeer.errors import ConfigError
from kvpeer.lab.bench.serve_stats import FleetCounters, RequestRecord
from kvpeer.lab.bench.serve_workloads import MAX_CONTEXT, VOCAB
from kvpeer.lab.bench.trace_bench import (
    TraceBenchSpec,
    bench_requests,
    render,
    reusable_tokens,
    summarise,
)
from kvpeer.lab.trace.mooncake import TraceRequest


def trace(tmp_path: Path) -> Path:
    rows = [
        (0, 1100, 40, [0, 1, 2]),
        (1000, 1600, 40, [0, 1, 3, 4]),
        (2000, 60_000, 5000, list(range(100, 218))),  # longer than the engines' context
        (9000, 600, 1, [0, 5]),  # outside a 5 s window
    ]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": n, "output_length": o,
                                        "hash_ids": ids}) + "\n" for t, n, o, ids in rows))
    return path


def test_a_window_becomes_requests_of_engine_blocks_at_scaled_times(tmp_path: Path) -> None:
    spec = TraceBenchSpec(trace(tmp_path), time_scale=2.0, window_s=5.0)
    fitted, sent = bench_requests(spec)
    assert [r.at_s for r in sent] == [0.0, 2.0, 4.0]
    # 1100 tokens = 2 full blocks of 512 + 76 -> 2 x 32 + 5 tokens; output 40 / 16
    assert (len(sent[0].prompt), sent[0].max_tokens) == (69, 2)
    assert sent[0].prompt[:64] == sent[1].prompt[:64]  # ids 0 and 1 shared
    assert sent[0].prompt[64:69] != sent[1].prompt[64:69]
    low, high = VOCAB
    assert all(low <= t < high for r in sent for t in r.prompt)
    long = sent[2]
    assert len(long.prompt) + long.max_tokens < MAX_CONTEXT  # cut to the context
    assert fitted[2].hash_ids[0] == 100  # a cut prompt keeps its first blocks


def test_reusable_tokens_count_usable_blocks_seen_before() -> None:
    a = TraceRequest(1, 0, 100, 1, (0, 1, 2, 3), 32)
    b = TraceRequest(2, 0, 128, 1, (0, 1, 7, 8), 32)  # 4 full blocks; usable 3
    c = TraceRequest(3, 0, 64, 1, (0, 1), 32)  # usable 1: the last token is computed
    assert reusable_tokens([a, b, c]) == 2 * 32 + 1 * 32
    assert reusable_tokens([a]) == 0


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [({"arms": ("none",)}, "--arms"), ({"block_tokens": 16}, "--block-tokens"),
     ({"time_scale": 0.0}, "time_scale"), ({"slo_s": 0.0}, "--slo")],
)
def test_bad_values_are_named(tmp_path: Path, kwargs: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        TraceBenchSpec(tmp_path / "t.jsonl", **kwargs)  # type: ignore[arg-type]


def test_an_empty_window_is_named(tmp_path: Path) -> None:
    spec = TraceBenchSpec(trace(tmp_path), window_start_s=100.0, window_s=5.0)
    with pytest.raises(ConfigError, match="no request in the window"):
        bench_requests(spec)


def test_an_arm_reports_ttfts_goodput_and_reuse_realised() -> None:
    records = [RequestRecord(0.0, t, t + 1, 100, 2, None) for t in (0.5, 1.0, 3.0)]
    records.append(RequestRecord(0.0, 9.0, 9.0, 100, 0, 0, error="HTTP 500"))
    row = summarise("kvpeer", records, FleetCounters(60.0, 36.0, (("pull", 2.0),)), 128, 2.0)
    assert (row["requests"], row["errors"]) == (4, 1)
    assert (row["ttft_p50_s"], row["ttft_p99_s"]) == (1.0, 3.0)
    assert row["goodput"] == 0.5
    assert row["reuse_realised"] == 96 / 128
    text = render({"trace": "t", "window_start_s": 0, "window_s": 5, "time_scale": 2,
                   "requests": 4, "reusable_tokens": 128, "arms": [row]})
    assert "kvpeer" in text
    assert "75.0%" in text
