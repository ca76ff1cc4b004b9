"""``kvpeer bench faults`` without engines: arguments, statistics, the judge, the table."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvpeer.cli import build_parser
from kvpeer.lab.bench import faults_run
from kvpeer.lab.bench.faults import (
    BUDGET_S,
    FAULTS,
    REFUSED_BOUND_S,
    FaultsSpec,
    Renewal,
    Sample,
    add_arguments,
    cells,
    judge,
    render,
    to_json,
)
from kvpeer.lab.bench.faults_run import Pair, Workload, phase


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def sample(fault: str, run: int, fallback_s: float, **extra: object) -> Sample:
    fields: dict[str, object] = {"tier": "kvpeer", "outputs_equal": True, **extra}
    return Sample(fault=fault, run=run, latency_s=1.0 + fallback_s, local_s=1.0, **fields)  # type: ignore[arg-type]


def test_defaults_are_every_fault_both_tiers_five_runs() -> None:
    spec = FaultsSpec.from_args(parse())
    assert spec.runs == 5
    assert spec.faults == tuple(f.name for f in FAULTS)
    assert spec.tiers == ("kvpeer", "p2p")
    assert not spec.quick


def test_quick_is_one_run_unless_runs_is_given() -> None:
    assert FaultsSpec.from_args(parse("--quick")).runs == 1
    assert FaultsSpec.from_args(parse("--quick", "--runs", "3")).runs == 3


def test_lists_are_comma_separated() -> None:
    spec = FaultsSpec.from_args(parse("--faults", "restarted, backed-off", "--tiers", "p2p"))
    assert spec.faults == ("restarted", "backed-off")
    assert spec.tiers == ("p2p",)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--runs", "0"), "--runs"),
        (("--faults", "meteor"), "meteor"),
        (("--tiers", "lmcache"), "lmcache"),
    ],
)
def test_bad_arguments_are_named(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FaultsSpec.from_args(parse(*argv))


def test_the_cli_knows_the_subcommand() -> None:
    args = build_parser().parse_args(["bench", "faults", "--quick", "--tiers", "kvpeer"])
    assert args.tiers == ["kvpeer"]
    assert callable(args.func)


def test_bounds_follow_issue_11() -> None:
    bounds = {f.name: f.bound_s for f in FAULTS}
    assert bounds["healthy"] is None
    # The request budget: frozen, killed while the request waits (its sockets close
    # only after the kernel tore its memory down), restarted (a fresh process answers).
    for name in (
        "frozen-first-contact",
        "frozen-in-session",
        "killed-during-lookup",
        "killed-mid-transfer",
        "restarted",
    ):
        assert bounds[name] == BUDGET_S == 2.0
    for name in ("killed-before-contact", "backed-off"):  # refused, or backed off
        assert bounds[name] == REFUSED_BOUND_S == 0.25


def test_fallback_is_latency_less_the_local_run() -> None:
    assert Sample("kvpeer", "restarted", 0, 1.30, 1.05, True).fallback_s == pytest.approx(0.25)


def test_median_and_max_over_the_runs() -> None:
    runs = [sample("killed-before-contact", i, s) for i, s in enumerate([0.05, 0.01, 0.2, 0.03])]
    cell = judge("kvpeer", "killed-before-contact", runs)
    assert cell.median_s == pytest.approx(0.04)
    assert cell.max_s == pytest.approx(0.2)
    assert (cell.runs, cell.outputs_equal, cell.ok) == (4, 4, True)


def test_a_fallback_over_its_bound_fails_the_kvpeer_cell_naming_run_time_and_phase() -> None:
    runs = [
        sample("frozen-in-session", 0, 1.5),
        sample("frozen-in-session", 1, 9.8, phase="timeout heartbeat"),
    ]
    cell = judge("kvpeer", "frozen-in-session", runs)
    assert not cell.ok
    assert cell.problems == ("run 1: fallback 9.800 s > bound 2 s (phase timeout heartbeat)",)


def test_vllms_tier_is_measured_not_judged_on_time_but_on_outputs() -> None:
    slow = [sample("frozen-in-session", 0, 30.0, tier="p2p")]
    assert judge("p2p", "frozen-in-session", slow).ok
    wrong = [sample("frozen-in-session", 0, 0.1, tier="p2p", outputs_equal=False)]
    assert judge("p2p", "frozen-in-session", wrong).problems == (
        "run 0: output differs from the local run",
    )


def test_a_differing_output_or_an_error_fails_and_errors_are_not_in_the_statistics() -> None:
    runs = [
        sample("restarted", 0, 0.1),
        sample("restarted", 1, 0.0, outputs_equal=False),
        Sample("kvpeer", "restarted", 2, 0.0, 0.0, False, error="URLError: refused"),
    ]
    cell = judge("kvpeer", "restarted", runs)
    assert (cell.errors, cell.outputs_equal, cell.runs) == (1, 1, 3)
    assert cell.median_s == pytest.approx(0.05)
    assert cell.problems == (
        "run 1: output differs from the local run",
        "run 2: URLError: refused",
    )


def test_controls_have_no_bound() -> None:
    assert judge("kvpeer", "healthy", [sample("healthy", 0, -0.9)]).ok


def test_cells_come_in_fault_then_tier_order() -> None:
    samples = [
        sample("restarted", 0, 0.1, tier="p2p"),
        sample("restarted", 0, 0.1),
        sample("healthy", 0, -0.5),
    ]
    assert [(c.fault, c.tier) for c in cells(samples)] == [
        ("healthy", "kvpeer"),
        ("restarted", "kvpeer"),
        ("restarted", "p2p"),
    ]


def test_the_table_has_a_row_per_cell_and_lists_problems() -> None:
    samples = [
        sample("killed-during-lookup", 0, 0.012, phase="lookup hit; fetch failed"),
        sample("frozen-in-session", 0, 9.8),
        sample("frozen-in-session", 0, 3.0, tier="p2p"),
    ]
    result = to_json(
        FaultsSpec(runs=1), samples, model="tiny-llama", prompt_tokens=384, seconds=42.0
    )
    text = render(result)
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["fault", "tier", "median", "max"]
    row = next(line for line in lines if line.startswith("killed-during-lookup"))
    assert row.split()[1:4] == ["kvpeer", "12", "ms"]
    assert row.split()[8:11] == ["1", "1/1", "ok"]
    assert row.endswith("lookup hit; fetch failed")
    assert "FAIL" in next(
        line for line in lines if "frozen-in-session" in line and "kvpeer" in line
    )
    assert "frozen-in-session/kvpeer: run 0: fallback 9.800 s > bound 2 s" in text
    assert not result["ok"]
    assert result["samples"][0]["fallback_s"] == pytest.approx(0.012)


def test_a_fresh_pair_is_listed_and_fails_the_run_only_on_the_kvpeer_tier() -> None:
    samples = [sample("healthy", 0, -0.5), sample("healthy", 0, 0.1, tier="p2p")]
    broken_p2p = Renewal("p2p", "frozen-in-session run 4", "no pull worked for 60 s")
    result = to_json(
        FaultsSpec(runs=1), samples, model="tiny-llama", prompt_tokens=384, seconds=1.0,
        renewals=[broken_p2p],
    )  # fmt: skip
    assert result["ok"]
    assert result["renewals"] == [
        {"tier": "p2p", "after": "frozen-in-session run 4", "why": "no pull worked for 60 s"}
    ]
    text = render(result)
    assert "p2p after frozen-in-session run 4: no pull worked for 60 s" in text
    assert "problems:" not in text
    broken_kvpeer = Renewal("kvpeer", "restarted run 2", "no pull worked for 60 s")
    result = to_json(
        FaultsSpec(runs=1), samples, model="tiny-llama", prompt_tokens=384, seconds=1.0,
        renewals=[broken_p2p, broken_kvpeer],
    )  # fmt: skip
    assert not result["ok"]
    assert "kvpeer: after restarted run 2: no pull worked for 60 s" in render(result)


def test_phase_reads_the_consumers_counter_deltas() -> None:
    assert phase({}) == "no contact"
    delta = {
        "session_events_total[opened]": 1.0,
        "lookups_total[hit]": 1.0,
        "fetches_total[failed]": 1.0,
        "sessions_closed_total[peer_lost]": 1.0,
        "pulled_blocks_total": 3.0,
        "sessions": 1.0,
    }
    assert phase(delta) == ("fetch failed; lookup hit; session opened; closed peer_lost; 3 blocks")
    assert phase({"timeouts_total[handshake]": 1.0}) == "timeout handshake"


def test_a_tier_whose_engine_stops_answering_is_reported_not_raised(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An engine that stops answering ends that tier's measurement; the run goes on to
    the next tier and the result says where it stopped."""
    started: list[str] = []

    def start(pair: Pair) -> None:
        started.append(pair.tier)
        if pair.tier == "p2p":
            raise TimeoutError("timed out")

    monkeypatch.setattr(Pair, "start", start)
    monkeypatch.setattr(faults_run, "measure_tier", lambda pair, spec: None)
    work = Workload(tmp_path, prompt_tokens=8, max_model_len=64)
    spec = FaultsSpec(runs=1, tiers=("p2p", "kvpeer"))
    samples, stops = faults_run.run(spec, work, tmp_path, progress=lambda _m: None)
    assert started == ["p2p", "kvpeer"]
    assert samples == []
    assert stops == [Renewal("p2p", "start", "measurement stopped: TimeoutError: timed out")]


def test_an_interrupted_run_stops_every_tier_and_keeps_what_was_measured(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    started: list[str] = []

    def measure(pair: Pair, spec: FaultsSpec) -> None:
        started.append(pair.tier)
        pair.samples.append(sample("healthy", 0, 0.1, tier=pair.tier))
        raise KeyboardInterrupt

    monkeypatch.setattr(Pair, "start", lambda pair: None)
    monkeypatch.setattr(faults_run, "measure_tier", measure)
    work = Workload(tmp_path, prompt_tokens=8, max_model_len=64)
    spec = FaultsSpec(runs=1, tiers=("kvpeer", "p2p"))
    samples, stops = faults_run.run(spec, work, tmp_path, progress=lambda _m: None)
    assert started == ["kvpeer"]
    assert [s.tier for s in samples] == ["kvpeer"]
    assert stops == [Renewal("kvpeer", "start", "measurement stopped: interrupted")]
