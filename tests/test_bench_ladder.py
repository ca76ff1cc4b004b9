"""``kvpeer bench ladder``'s summary: medians per rung, the issue's ratios against their
goals, and the step timeline of the slowest pull read from the engines' trace lines."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvpeer.lab.bench.ladder import RUNGS, LadderSpec, _Pull, render, summarize, timeline

PULL_ID = "3c1d6c1d142745a4bf578c22e169107b"


def trace(t: float, node: str, request: str, event: str, rest: str = "") -> str:
    return f"kvpeer.trace t={t:.6f} node={node} id={request} event={event} {rest}".rstrip()


def test_the_timeline_is_one_requests_lines_from_every_engine_in_time_order(
    tmp_path: Path,
) -> None:
    (tmp_path / "a.log").write_text(
        "\n".join([
            "(EngineCore pid=1) INFO something else entirely",
            trace(100.0020, "127.0.0.1:1", PULL_ID, "fetch_received", "blocks=47 round=0"),
            trace(100.0110, "127.0.0.1:1", PULL_ID, "transfer_done", "ok=1"),
            trace(100.0050, "127.0.0.1:1", "another-request", "fetch_received"),
        ])
    )  # fmt: skip
    (tmp_path / "b.log").write_text(
        "\n".join([
            trace(100.0000, "127.0.0.1:2", PULL_ID, "lookup_hit", "step=74"),
            trace(100.0128, "127.0.0.1:2", PULL_ID, "promotion", "waited_ms=11.17 landed=1"),
            trace(100.3898, "connector", PULL_ID, "sync_load_step_done"),
        ])
    )  # fmt: skip
    events = timeline(sorted(tmp_path.glob("*.log")), PULL_ID)
    assert [(e["engine"], e["event"]) for e in events] == [
        ("b", "lookup_hit"),
        ("a", "fetch_received"),
        ("a", "transfer_done"),
        ("b", "promotion"),
        ("b", "sync_load_step_done"),
    ]
    assert [e["ms"] for e in events] == [0.0, 2.0, 11.0, 12.8, 389.8]
    assert events[3]["detail"] == "waited_ms=11.17 landed=1"
    assert timeline(sorted(tmp_path.glob("*.log")), "") == []  # no request id header


def test_ratios_are_judged_against_the_issues_goals() -> None:
    samples = {
        "computed": [2.0, 2.4, 2.2],
        "local": [0.2, 0.1, 0.3],
        "pulled_idle": [0.25, 0.2, 0.3],
        "pulled_busy": [0.5, 0.45, 0.6],
        "local_busy": [0.3, 0.25, 0.2],
        "ahead_idle": [0.21, 0.2, 0.25],
        "ahead_busy": [0.3, 0.28, 0.35],
    }
    pulls = [
        _Pull("pulled_idle", 0.3, "x", "a", True),
        _Pull("pulled_busy", 0.6, PULL_ID, "a", True),
        _Pull("pulled_busy", 0.5, "y", "b", False),
    ]
    result = summarize(LadderSpec(prompts=3), samples, pulls, 2, pulls[1], [])
    assert result["medians"]["pulled_idle"] == 0.25
    assert result["ratios"]["pulled_idle/local"] == 0.25 / 0.2
    assert result["ratios"]["pulled_busy/local"] == 0.5 / 0.2
    assert result["ratios"]["pulled_busy/local_busy"] == 0.5 / 0.25
    assert result["met"] == {
        "pulled_idle/local": True,  # 1.25 <= 1.5
        "pulled_busy/local": False,  # 2.5 > 2
        "pulled_idle/computed": False,  # 0.25 / 2.2 = 0.114 > 0.1
        "ahead_idle/local": True,  # 1.05
        "ahead_busy/local": True,  # 1.5
        "ahead_idle/computed": True,  # 0.095
    }
    assert result["ratios"]["ahead_busy/pulled_busy"] == 0.3 / 0.5
    assert (result["pulled_from_producer"], result["same_output"], result["pulls"]) == (2, 2, 3)
    text = render(result)
    assert "goal <= 2x: missed" in text
    assert "goal <= 1.5x: met" in text
    assert f"slowest pull: pulled_busy 600 ms (request {PULL_ID})" in text
    assert "busy pulls that finished while the producer's long prefill ran: 2/6" in text
    assert "what pulling ahead saves" in text


def test_a_rung_without_samples_renders_a_dash_and_misses_its_goal() -> None:
    samples: dict[str, list[float]] = {rung: [] for rung in RUNGS}
    result = summarize(LadderSpec(), samples, [], 0, None, [])
    assert set(result["met"].values()) == {False}
    assert "slowest pull" not in render(result)


def test_the_command_names_a_bad_round_count() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvpeer", "bench", "ladder", "--prompts", "0"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "expected a whole number of rounds >= 1, got '0'" in done.stderr


def test_the_command_names_a_wait_the_tier_would_refuse() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvpeer", "bench", "ladder", "--sync-pull-wait", "5"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "sync_pull_wait_s: expected 0 to 1 seconds, got 5.0" in done.stderr


def test_a_pull_started_ahead_shows_its_prefetchs_fetch(tmp_path: Path) -> None:
    (tmp_path / "a.log").write_text(
        "\n".join([
            trace(200.004, "127.0.0.1:1", "ahead:3", "fetch_received", "blocks=48 round=0"),
            trace(200.009, "127.0.0.1:1", "ahead:7", "fetch_received", "blocks=48 round=0"),
        ])
    )  # fmt: skip
    (tmp_path / "b.log").write_text(
        "\n".join([
            trace(200.001, "127.0.0.1:2", "ahead:3", "prefetch", f"peer=x request={PULL_ID}"),
            trace(200.002, "127.0.0.1:2", "ahead:7", "prefetch", "peer=x request=other"),
            trace(200.012, "127.0.0.1:2", "ahead:3", "prefetch_done", "success=True"),
            trace(200.020, "127.0.0.1:2", PULL_ID, "staged_adopted", "blocks=48 step=9"),
        ])
    )  # fmt: skip
    events = timeline(sorted(tmp_path.glob("*.log")), PULL_ID)
    assert [(e["engine"], e["event"]) for e in events] == [
        ("b", "prefetch"),
        ("a", "fetch_received"),
        ("b", "prefetch_done"),
        ("b", "staged_adopted"),
    ]
