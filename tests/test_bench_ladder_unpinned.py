"""``kvpeer bench ladder --unpinned``'s report without engines: what the router did with
each request (pull, declined, holder), the held share read off the router's page, the
producer's wait from the traces, and the median of per-round ratios."""

from __future__ import annotations

import subprocess
import sys

from kvpeer.cli import build_parser
from kvpeer.lab.bench.ladder_unpinned import (
    ARMS,
    Request,
    UnpinnedSpec,
    classify,
    held_share,
    order,
    render,
    source_wait_ms,
    summarize,
)
from kvpeer.router.reasons import (
    REASON_CACHE,
    REASON_LOAD,
    REASON_PULL,
    REASON_PULL_EXPLORE,
    REASON_PULL_SLOWER,
)


def request(n: int, arm: str, ttft: float, engine: str = "b", plan: str = REASON_PULL,
            source: str | None = "a", rejected: float | None = None) -> Request:
    return Request(round=n, arm=arm, position=ARMS.index(arm), ttft_s=ttft, engine=engine,
                   plan=plan, source=source, predicted_ttft_s=0.5, rejected_pull_ttft_s=rejected,
                   cached_tokens=0, held_share=0.4, busy_overlapped=True)  # fmt: skip


def test_the_routers_choice_is_classified_by_engine_source_and_reason() -> None:
    assert classify("b", REASON_PULL, "a") == "pull"
    assert classify("b", "pull: pinned source", "a") == "pull"
    assert classify("b", REASON_PULL_EXPLORE, "a") == "explore"
    assert classify("b", REASON_PULL_SLOWER, None) == "declined"
    assert classify("b", REASON_LOAD, None) == "compute"
    assert classify("a", REASON_CACHE, None) == "holder"
    assert classify("", "no healthy engine", None) == "other"
    assert request(0, "unpinned", 1.0, plan=REASON_PULL_SLOWER, source=None).decision == (
        "declined"
    )


def test_the_held_share_is_the_sources_gauge_on_the_routers_page() -> None:
    page = "\n".join([
        "# HELP kvpeer_router_source_held_share Share of peers' lookups ...",
        "# TYPE kvpeer_router_source_held_share gauge",
        'kvpeer_router_source_held_share{source="b"} 1.0',
        'kvpeer_router_source_held_share{source="a"} 0.34375',
        'kvpeer_router_engine_up{engine="a"} 1.0',
    ])  # fmt: skip
    assert held_share(page, "a") == 0.34375
    assert held_share(page, "b") == 1.0
    assert held_share(page, "c") is None
    assert held_share("", "a") is None


def test_the_producers_wait_is_its_first_fetch_to_its_first_write() -> None:
    events = [
        {"engine": "client", "event": "sent", "ms": 0.0},
        {"engine": "a", "event": "fetch_received", "ms": 3.0},
        {"engine": "a", "event": "transfer_started", "ms": 2150.5},
        {"engine": "a", "event": "transfer_started", "ms": 2200.0},
    ]
    assert source_wait_ms(events) == 2147.5
    assert source_wait_ms(events[:2]) is None  # never wrote
    assert source_wait_ms(events[:1]) is None  # nothing pulled


def test_the_arms_take_turns_round_by_round() -> None:
    assert [order(n) for n in range(4)] == [
        ("unpinned", "pinned", "computed"),
        ("pinned", "computed", "unpinned"),
        ("computed", "unpinned", "pinned"),
        ("unpinned", "pinned", "computed"),
    ]


def test_the_summary_takes_the_median_of_per_round_ratios_and_counts_decisions() -> None:
    requests = [
        request(0, "unpinned", 1.0, plan=REASON_PULL_SLOWER, source=None, rejected=2.5),
        request(0, "pinned", 2.0, plan="pull: pinned source"),
        request(0, "computed", 1.0, plan=REASON_LOAD, source=None),
        request(1, "unpinned", 0.3),
        request(1, "pinned", 0.6, plan="pull: pinned source"),
        request(1, "computed", 1.2, plan=REASON_LOAD, source=None),
        request(2, "unpinned", 3.0, engine="a", plan=REASON_CACHE, source=None),
        request(2, "pinned", 1.0, plan="pull: pinned source"),
        request(2, "computed", 1.0, plan=REASON_LOAD, source=None),
    ]
    result = summarize(UnpinnedSpec(prompts=3), requests, {"start": 3.2, "end": 4.1})
    assert result["per_round_ratios"]["unpinned/pinned"] == [0.5, 0.5, 3.0]
    assert result["ratios"]["unpinned/pinned"] == 0.5
    assert result["ratios"]["unpinned/computed"] == 1.0  # of 1.0, 0.25, 3.0
    assert result["ratios"]["pinned/computed"] == 1.0  # of 2.0, 0.5, 1.0
    assert result["medians"] == {"unpinned": 1.0, "pinned": 1.0, "computed": 1.0}
    assert result["decisions"]["unpinned"] == {
        "pull": 1, "explore": 0, "declined": 1, "holder": 1, "compute": 0, "other": 0}  # fmt: skip
    assert result["decisions"]["pinned"]["pull"] == 3
    assert result["decisions"]["computed"]["compute"] == 3
    first = result["requests"][0]
    assert (first["arm"], first["decision"], first["rejected_pull_ttft_s"]) == (
        "unpinned", "declined", 2.5)  # fmt: skip
    assert result["load_average"] == {"start": 3.2, "end": 4.1}
    text = render(result)
    assert "load average 3.2 -> 4.1" in text
    assert "compute: pull slower" in text
    assert "2500" in text  # the rejected pull's predicted TTFT, ms
    assert "unpinned decisions: pull 1, declined 1, holder 1" in text
    assert "unpinned/pinned      0.50x  median of rounds: 0.50, 0.50, 3.00" in text


def test_an_empty_run_renders_dashes() -> None:
    result = summarize(UnpinnedSpec(), [], {"start": 0.0, "end": 0.0})
    assert result["ratios"] == dict.fromkeys(("unpinned/pinned", "unpinned/computed",
                                              "pinned/computed"))  # fmt: skip
    assert "TTFT medians: unpinned - ms" in render(result)


def test_the_command_takes_unpinned_with_the_ladders_options() -> None:
    args = build_parser().parse_args(
        ["bench", "ladder", "--unpinned", "--prompts", "3", "--idle-seconds", "0.5"]
    )
    assert (args.unpinned, args.prompts, args.idle_seconds) == (True, 3, 0.5)
    assert build_parser().parse_args(["bench", "ladder"]).unpinned is False
    done = subprocess.run(
        [sys.executable, "-m", "kvpeer", "bench", "ladder", "--unpinned", "--prompts", "0"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert "expected a whole number of rounds >= 1, got '0'" in done.stderr
