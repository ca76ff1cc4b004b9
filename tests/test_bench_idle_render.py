"""``kvpeer bench idle``'s result and table, built from made-up measurements (no engines)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpeer.lab.bench.idle import (
    BASELINE,
    KVPEER_NIXL,
    KVPEER_TCP,
    VLLM_P2P,
    IdleSpec,
    LookupTiming,
    idle_row,
    lookup_row,
    render,
    summarize,
)
from kvpeer.lab.engines.launcher import EngineOutcome, Hold

ENGINE_CORE = "VLLM::EngineCor"


def outcome(
    name: str, idle: dict[str, float], serving: dict[str, float] | None = None
) -> EngineOutcome:
    holds = {"idle": Hold(10.0, sum(idle.values()), idle)}
    if serving is not None:
        holds["serving"] = Hold(20.0, sum(serving.values()), serving)
    return EngineOutcome(
        engine_id=f"kvpeer-idle-{name}", runs={}, files={}, seconds={}, holds=holds
    )


def full_result() -> dict[str, object]:
    idle = [
        idle_row(
            BASELINE, outcome(BASELINE, {"python": 0.0, ENGINE_CORE: 0.1, "VLLM::Worker": 0.1})
        ),
        idle_row(
            VLLM_P2P,
            outcome(
                VLLM_P2P,
                {"python": 1.0, ENGINE_CORE: 9.0, "VLLM::Worker": 6.0},
                {ENGINE_CORE: 30.0},
            ),
        ),
        idle_row(
            KVPEER_TCP,
            outcome(
                KVPEER_TCP,
                {"python": 0.0, ENGINE_CORE: 0.2, "VLLM::Worker": 0.1},
                {ENGINE_CORE: 1.0},
            ),
        ),
        idle_row(
            KVPEER_NIXL,
            outcome(KVPEER_NIXL, {"python": 0.0, ENGINE_CORE: 8.0, "VLLM::Worker": 0.1}),
        ),
    ]
    lookups = [
        lookup_row(
            VLLM_P2P,
            8,
            LookupTiming(0.2, 8),
            [LookupTiming(s, 8) for s in (0.010, 0.012, 0.030)],
            2.0,
        ),
        lookup_row(
            KVPEER_TCP,
            8,
            LookupTiming(0.05, 8),
            [LookupTiming(s, 8) for s in (0.002, 0.001, 0.009)],
            2.0,
        ),
    ]
    return summarize(IdleSpec.full(), idle, lookups)


def test_idle_rows_split_cores_by_role() -> None:
    row = idle_row(
        VLLM_P2P, outcome(VLLM_P2P, {"python": 1.0, ENGINE_CORE: 9.0, "VLLM::Worker": 6.0})
    )

    assert row["cores"] == 1.6
    assert row["cores_by_role"] == {"main": 0.1, "engine_core": 0.9, "worker": 0.6}
    assert "serving_cores" not in row


def test_kvpeer_is_compared_with_both_baselines() -> None:
    compare = full_result()["compare"]
    assert isinstance(compare, dict)

    assert compare["idle_cores_over_baseline"][KVPEER_TCP] == 0.01
    assert compare["idle_cores_vs_vllm_p2p"] == pytest.approx(
        {KVPEER_TCP: 0.03 / 1.6, KVPEER_NIXL: 0.81 / 1.6}, abs=1e-4
    )
    assert compare["idle_engine_core_vs_vllm_p2p"][KVPEER_TCP] == pytest.approx(
        0.02 / 0.9, abs=1e-4
    )
    assert compare["lookup_median_vs_vllm_p2p"] == pytest.approx({KVPEER_TCP: 2 / 12}, abs=1e-4)


def test_lookup_rows_count_timeouts_and_keep_them_out_of_the_latencies() -> None:
    row = lookup_row(
        KVPEER_TCP, 8, LookupTiming(None, 0), [LookupTiming(0.004, 8), LookupTiming(None, 0)], 1.5
    )

    assert (row["answered"], row["timeouts"]) == (1, 1)
    assert row["latencies_ms"] == [4.0, None]
    assert row["median_ms"] == row["max_ms"] == 4.0
    assert row["first_ms"] is None
    assert row["consumer_plane"] == "tcp"


def test_render_puts_kvpeer_next_to_the_baselines() -> None:
    result = full_result()
    text = render(result)
    lines = text.splitlines()

    def line_of(name: str, after: int = 0) -> str:
        return next(line for line in lines[after:] if line.split()[:1] == [name])

    assert "0.019x" in line_of(KVPEER_TCP)  # idle cores vs vLLM's p2p tier
    assert "+0.01" in line_of(KVPEER_TCP)  # cores over the no-tier baseline
    assert line_of(VLLM_P2P).split()[1] == "1.600"
    assert "busy-polls" in text  # the nixl row is explained
    lookup_header = next(i for i, line in enumerate(lines) if line.startswith("lookup -> answer"))
    kvpeer_lookups = line_of(KVPEER_TCP, lookup_header).split()
    assert kvpeer_lookups[2:6] == ["2.00", "9.00", "3/3", "8/8"]  # median, max, answered, hits
    assert kvpeer_lookups[-1] == "0.167x"
    json.dumps(result)  # --json prints it as is


def test_render_without_a_baseline_or_lookups() -> None:
    quick = IdleSpec.quick()
    idle = [
        idle_row(name, outcome(name, {ENGINE_CORE: cpu}))
        for name, cpu in zip(quick.engines, (10.0, 0.1), strict=True)
    ]

    text = render(summarize(quick, idle, []))

    assert "lookup -> answer" not in text
    assert "0.010x" in next(
        line for line in text.splitlines() if line.startswith(f"  {KVPEER_TCP}")
    )


def test_the_ready_line_counts_only_once_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CI read the tier's ready line while the engine was still writing it and failed to
    parse its first half: a line counts once its newline is there, and only the tier's
    own ready line gives the block length."""
    from concurrent.futures import Future

    from kvpeer.lab.bench import idle

    log = tmp_path / "engine.log"
    engines: Future[list[EngineOutcome]] = Future()
    log.write_text("INFO kvpeer tier e0 starting\nINFO kvpeer tier e0 ready: 12 blocks x 9")
    monkeypatch.setattr(idle, "SIGNAL_TIMEOUT_S", 0.2)
    with pytest.raises(TimeoutError):  # half a line, never finished
        idle._wait_for_text(log, idle.READY_LINE, engines, "ready")
    log.write_text(log.read_text() + "8304 bytes, data planes tcp\n")
    line = idle._wait_for_text(log, idle.READY_LINE, engines, "ready")
    assert idle._block_len(line) == 98304
    with pytest.raises(ValueError, match="not the kvpeer tier's ready line"):
        idle._block_len("INFO kvpeer tier e0 starting")
