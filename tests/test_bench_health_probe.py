"""The /health probe's bookkeeping without engines: its rows, its per-process CPU sums,
and its reading of this very process from /proc."""

from __future__ import annotations

import os

from kvpeer.lab.bench.health_probe import _by_role, _pids, _row, _slow_row, _threads


def test_a_row_counts_answers_over_the_limit_and_failed_probes() -> None:
    row = _row("kvpeer", "a", [0.002, 0.004, 1.5, 0.003], failed=2, limit=1.0)
    fields = row.split()
    assert fields[:3] == ["kvpeer", "a", "4"]
    assert float(fields[3]) == 3.5  # median, ms
    assert float(fields[5]) == 1500.0  # max, ms
    assert fields[6] == "3"  # one slow answer and two unanswered probes
    assert _row("none", "b", [], failed=5, limit=1.0).split()[-1] == "5"


def test_cpu_is_summed_per_process_role_over_the_interval() -> None:
    before = {("api", "main"): (1_000_000_000, 0), ("core", "main"): (0, 0)}
    after = {("api", "main"): (3_000_000_000, 500_000_000), ("core", "main"): (10**9, 0),
             ("core", "x"): (10**9, 2 * 10**9)}  # a thread born during the interval
    assert _by_role(before, after) == {"api": (2.0, 0.5), "core": (2.0, 2.0)}
    line = _slow_row("a", 0.6, before, after)
    assert line.startswith("a: answer 600 ms; api main thread ran 2000 ms, waited for a "
                           "CPU 500 ms")
    assert "none" in _slow_row("a", None, before, after)


def test_this_process_threads_are_read_from_proc() -> None:
    pids = _pids(os.getpid())
    assert pids == {"api": os.getpid()}  # no EngineCore child here
    first = _threads(pids)[("api", "main")]
    sum(range(2_000_000))  # some CPU on this thread
    second = _threads(pids)[("api", "main")]
    assert second[0] > first[0]
