"""Mooncake trace parsing, infinite-cache reuse, scaling and token blocks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpeer.errors import ConfigError
from kvpeer.lab.trace.mooncake import parse_lines, read_trace
from kvpeer.lab.trace.reuse import infinite_cache_reuse
from kvpeer.lab.trace.scaling import TraceScale, scale_trace
from kvpeer.lab.trace.tokens import BlockTokens


def line(ts: float, n: int, out: int, ids: list[int]) -> str:
    return json.dumps({"timestamp": ts, "input_length": n, "output_length": out,
                       "hash_ids": ids})


SHARED = [line(0, 1100, 5, [0, 1, 2]), line(10, 1600, 7, [0, 1, 3, 4]), line(20, 600, 1, [0, 5])]


def test_a_trace_is_read_in_order_with_its_fields(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(SHARED) + "\n\n")
    requests = read_trace(path)
    assert [r.line for r in requests] == [1, 2, 3]
    assert requests[1].timestamp_ms == 10
    assert requests[1].hash_ids == (0, 1, 3, 4)
    assert requests[0].full_blocks == (0, 1)  # 1100 tokens: two full blocks of 512


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        ("{not json", "3: not JSON"),
        ('{"timestamp": 1, "input_length": 5, "output_length": 1}', "3: field 'hash_ids' missing"),
        (line(30, 0, 1, []), "3: field 'input_length'"),
        (line(30, 600, -1, [1, 2]), "3: field 'output_length'"),
        (line(30, 600, 1, [1]), "3: field 'hash_ids' has 1 ids"),
        (line(30, 600, 1, [1, "x"]), "3: field 'hash_ids' must be"),  # type: ignore[list-item]
        (line(5, 600, 1, [1, 2]), "3: field 'timestamp' 5 is before"),
        ('{"timestamp": "soon", "input_length": 5, "output_length": 1, "hash_ids": [1]}',
         "3: field 'timestamp' must be a number"),
    ],
)
def test_a_bad_line_names_its_line_and_field(bad: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        list(parse_lines([SHARED[0], SHARED[1], bad], "t.jsonl"))


def test_a_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="trace"):
        read_trace(tmp_path / "absent.jsonl")


def test_infinite_cache_reuse_counts_ids_seen_before() -> None:
    reuse = infinite_cache_reuse(parse_lines(SHARED))
    assert (reuse.blocks, reuse.reused) == (9, 3)  # 0,1 in the second; 0 in the third
    full = infinite_cache_reuse(parse_lines(SHARED), full_only=True)
    assert (full.blocks, full.reused) == (2 + 3 + 1, 3)


def test_a_trace_with_no_shared_ids_gives_zero_reuse() -> None:
    lines = [line(i, 1024, 1, [2 * i, 2 * i + 1]) for i in range(50)]
    assert infinite_cache_reuse(parse_lines(lines)).reused == 0
    assert infinite_cache_reuse(parse_lines(lines)).fraction == 0.0


def test_scaling_keeps_shared_ids_shared_and_blocks_whole() -> None:
    requests = list(parse_lines(SHARED))
    scaled = scale_trace(requests, TraceScale(block_tokens=32, time_scale=3.0))
    assert [r.hash_ids for r in scaled] == [r.hash_ids for r in requests]
    assert [r.timestamp_ms for r in scaled] == [0, 30, 60]
    # 1100 = 2 full blocks + 76 -> 2 * 32 + round(76 / 16) = 69; blocks per prompt kept
    assert scaled[0].input_length == 69
    assert len(scaled[0].full_blocks) == 2
    assert [len(r.full_blocks) for r in scaled] == [len(r.full_blocks) for r in requests]
    assert infinite_cache_reuse(scaled) == infinite_cache_reuse(requests)
    tokens = BlockTokens(32)
    a, b = tokens.prompt(scaled[0]), tokens.prompt(scaled[1])
    assert len(a) == 69
    assert len(b) == scaled[1].input_length
    assert a[:64] == b[:64]
    assert a[64:69] != b[64:69]


def test_a_window_keeps_its_requests_relative_to_its_start() -> None:
    requests = list(parse_lines(SHARED))
    kept = scale_trace(requests, TraceScale(window_start_s=0.005, window_s=0.010))
    assert [(r.line, r.timestamp_ms) for r in kept] == [(2, 5.0)]


@pytest.mark.parametrize("kwargs", [{"block_tokens": 0}, {"time_scale": 0.0},
                                    {"window_s": 0.0}, {"window_start_s": -1.0}])
def test_a_bad_scale_is_named(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        TraceScale(**kwargs)  # type: ignore[arg-type]


def test_blocks_are_fixed_by_their_id_and_distinct() -> None:
    one, two = BlockTokens(64, seed=1), BlockTokens(64, seed=1, cache=1)
    assert one.block(7) == two.block(7) == one.block(7)
    blocks = {one.block(i) for i in range(2000)}
    assert len(blocks) == 2000
    assert all(16 <= t < 32_000 for b in blocks for t in b)
    assert BlockTokens(64, seed=2).block(7) != one.block(7)
