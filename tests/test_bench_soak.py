"""``kvpeer soak`` without engines: arguments, the fault schedule, request classes, the
resource comparison, the verdict and the summary; /proc readers and the fleet's removal
of leftovers on this process and files of the test's own."""

from __future__ import annotations

import itertools
import os
import uuid
from pathlib import Path

import pytest

from kvpeer.cli import build_parser
from kvpeer.lab.bench.soak_run import release_free_heap
from kvpeer.lab.bench.soak_verdict import (
    FAULT_KINDS,
    RESOURCE_TOLERANCE,
    WARMUP_FAULT,
    WITNESS,
    Outcome,
    SoakSpec,
    Tally,
    classify,
    compare_processes,
    in_fault_window,
    render,
    schedule,
    summary,
    verdict,
)
from kvpeer.lab.engines.procs import group_pids, process_info, shm_in_use
from kvpeer.lab.engines.serving import _remove_unused

MIB = 1 << 20


def test_the_cli_parses_every_option() -> None:
    args = build_parser().parse_args(
        ["soak", "--minutes", "2.5", "--fault-every", "7", "--seed", "3", "--json"]
    )
    spec = SoakSpec.from_args(args)
    assert (spec.minutes, spec.fault_every_s, spec.seed, spec.seconds) == (2.5, 7.0, 3, 150.0)
    assert args.json
    assert args.model is None
    defaults = SoakSpec.from_args(build_parser().parse_args(["soak", "--minutes", "1"]))
    assert (defaults.fault_every_s, defaults.seed) == (15.0, 0)


def test_minutes_are_required() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["soak"])


@pytest.mark.parametrize(("minutes", "every"), [(0, 15), (-1, 15), (1, 0.5)])
def test_bad_values_are_named(minutes: float, every: float) -> None:
    with pytest.raises(ValueError, match=r"--minutes|--fault-every"):
        SoakSpec(minutes=minutes, fault_every_s=every)


def test_the_schedule_is_seeded_bounded_and_spares_the_witness() -> None:
    first = list(itertools.islice(schedule(5, 15.0), 300))
    assert first == list(itertools.islice(schedule(5, 15.0), 300))
    assert first != list(itertools.islice(schedule(6, 15.0), 300))
    assert all(10.0 <= f.gap_s <= 20.0 for f in first)
    assert {f.kind for f in first} == set(FAULT_KINDS)
    for fault in first:
        if fault.kind == "freeze":
            assert 2.0 <= fault.freeze_s <= 5.0
        else:  # the witness is never killed nor restarted: it is compared for leaks
            assert fault.engine != WITNESS
            assert fault.freeze_s == 0.0
    assert {f.engine for f in first if f.kind == "freeze"} == {"a", "b"}


def test_request_classes() -> None:
    assert classify(Outcome("pd", 1.0, error="boom")) == "failed"
    assert classify(Outcome("pd", 1.0, matched=False, named_peer=True, cached=512)) == "mismatch"
    assert classify(Outcome("pd", 1.0, matched=True, named_peer=True, cached=0)) == "fallback"
    assert classify(Outcome("pd", 1.0, matched=True, named_peer=True, cached=31)) == "fallback"
    assert classify(Outcome("pd", 1.0, matched=True, named_peer=True, cached=32)) == "ok"
    assert classify(Outcome("shared", 1.0, matched=True, named_peer=False, cached=0)) == "ok"


def test_failures_count_against_the_soak_only_outside_fault_windows() -> None:
    windows = [(10.0, 20.0), (30.0, float("inf"))]
    assert in_fault_window(10.0, windows)
    assert in_fault_window(20.0, windows)
    assert not in_fault_window(25.0, windows)
    assert in_fault_window(1e9, windows)  # a fault still in progress
    assert in_fault_window(8.0, windows, until_s=11.0)  # in flight when the fault hit
    assert not in_fault_window(21.0, windows, until_s=29.0)
    tally = Tally()
    tally.add(Outcome("pd", 8.0, error="killed mid-stream", ended_s=10.5), windows)
    tally.add(Outcome("pd", 15.0, error="engine gone"), windows)
    assert tally.unexplained == []
    tally.add(Outcome("shared", 25.0, error="refused"), windows)
    assert tally.unexplained == ["shared at 25.0 s: refused"]
    tally.add(Outcome("pd", 26.0, matched=True, cached=512), windows)
    assert tally.counts == {"pd": {"failed": 2, "ok": 1}, "shared": {"failed": 1}}
    assert tally.from_cache == 1
    assert (tally.total("failed"), tally.total("ok"), tally.total("mismatch")) == (3, 1, 0)


def test_processes_are_judged_within_five_percent_unless_replaced() -> None:
    before = [
        ("router-shared", 1, 100, 190 * MIB, 10 * MIB, 0, 40),
        ("a:VLLM::EngineCor", 2, 100, 1000 * MIB, 0, 256 * MIB, 100),
        ("a:VLLM::Worker", 3, 100, 1000 * MIB, 0, 256 * MIB, 100),
        ("b:VLLM::EngineCor", 4, 100, 1000 * MIB, 0, 256 * MIB, 100),
    ]
    grown = 1000 * MIB * (1 + RESOURCE_TOLERANCE)
    after = [
        # RSS less shared memory exactly at the bound: fine (anonymous and file pages add up)
        ("router-shared", 1, 100, 180 * MIB, 30 * MIB, 0, 42),
        ("a:VLLM::EngineCor", 2, 100, int(grown) + 4096, 0, 512 * MIB, 100),  # past it
        ("a:VLLM::Worker", 3, 999, 1000 * MIB, 0, 0, 100),  # pid reused: not the same process
        ("b:VLLM::EngineCor", 4, 100, 5000 * MIB, 0, 0, 500),  # b restarted: not judged
    ]
    rows = compare_processes(before, after, restarted={"b"})
    problems = [p for row in rows for p in row.problems()]
    assert len(problems) == 2
    assert "a:VLLM::EngineCor (pid 2) private RSS" in problems[0]
    assert problems[1] == "a:VLLM::Worker (pid 3) is gone"
    assert rows[0].rss_growth == pytest.approx(0.05)
    assert rows[0].fds_growth == pytest.approx(0.05)
    assert rows[1].shmem_after == 512 * MIB  # shown, never judged
    assert rows[0].file_growth == pytest.approx(2.0)  # shown apart, and judged in the sum
    assert rows[0].anon_growth == pytest.approx(-10 / 190)
    assert not rows[3].judged
    for fds_before, fds_after, judged in [(40, 46, "ok"), (40, 47, "> 5% and > 6 more"),
                                          (200, 210, "ok"), (200, 211, "> 5% and > 6 more")]:
        fds = compare_processes([("router-shared", 1, 100, 200 * MIB, 0, 0, fds_before)],
                                [("router-shared", 1, 100, 200 * MIB, 0, 0, fds_after)], set())
        problems = fds[0].problems()
        assert problems == ([] if judged == "ok" else
                            [f"router-shared (pid 1) fds {fds_before} -> {fds_after} ({judged})"])
    assert (rows[3].unjudged_why, rows[0].unjudged_why) == ("restarted", "")


def test_the_driver_is_shown_but_not_judged() -> None:
    # The soak's own process only generates load (its clients are not kvpeer); the
    # routers run as processes of their own and are judged.
    row = compare_processes(
        [("driver", 1, 100, 100 * MIB, 0, 0, 40)], [("driver", 1, 100, 200 * MIB, 0, 0, 80)], set()
    )[0]
    assert (row.judged, row.unjudged_why, row.problems()) == (False, "load generator", [])
    assert row.rss_growth == pytest.approx(1.0)


def test_the_verdict_names_every_failed_check() -> None:
    good = Tally()
    good.add(Outcome("pd", 1.0, matched=True, named_peer=True, cached=512), [])
    assert verdict(good, [], [], faults=3) == []
    bad = Tally()
    bad.add(Outcome("pd", 1.0, matched=False), [])
    bad.add(Outcome("pd", 2.0, error="x"), [])
    problems = verdict(bad, [], ["psm_1"], faults=0)
    assert problems == [
        "1 output(s) differ from their reference",
        "no request succeeded",
        "left in /dev/shm: psm_1",
        "failed outside a fault window: pd at 2.0 s: x",
        "no fault was injected (run longer or lower --fault-every)",
    ]


def test_summary_and_table() -> None:
    tally = Tally()
    tally.add(Outcome("pd", 1.0, matched=True, named_peer=True, cached=512), [])
    tally.add(Outcome("shared", 2.0, matched=True, named_peer=True, cached=0), [])
    rows = compare_processes(
        [("driver", 1, 1, 100 * MIB, 0, 0, 10)], [("driver", 1, 1, 101 * MIB, 0, 0, 10)], set()
    )
    result = summary(
        spec=SoakSpec(minutes=1),
        tally=tally,
        rows=rows,
        faults=[{"kind": "freeze", "engine": "a"}, {"kind": "kill-restart", "engine": "b"}],
        pulled_blocks=96,
        leftovers=[],
        removed_by_fleet=["psm_1"],
        seconds=80.0,
        logs=[],
    )
    assert result["ok"]
    assert result["faults"] == {"freeze": 1, "kill-restart": 1}
    assert result["requests"] == {"pd": {"ok": 1}, "shared": {"fallback": 1}}
    text = render(result)
    assert "kvpeer soak ok: 1 min, seed 0, 2 faults" in text
    assert "+1.0%" in text
    assert "removed by the fleet (vLLM's files of killed groups): 1" in text


def test_proc_readers_see_this_process_and_its_open_shm_file() -> None:
    me = process_info(os.getpid())
    assert me is not None
    assert me.rss_bytes > 0
    assert me.fds > 0
    assert me.private_bytes == me.rss_bytes - me.shmem_bytes
    assert me.anon_bytes > 0
    assert me.file_bytes > 0
    assert me.anon_bytes + me.file_bytes + me.shmem_bytes == me.rss_bytes
    assert os.getpid() in group_pids(os.getpgid(0))
    assert process_info(2**22 + 1) is None  # beyond pid_max
    name = f"kvpeer-test-soak-{uuid.uuid4().hex[:8]}"
    path = Path("/dev/shm") / name
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        assert name in shm_in_use()
        assert _remove_unused({name}) == []  # held open: not a leftover
    finally:
        os.close(fd)
    assert name not in shm_in_use()
    assert _remove_unused({name, "kvpeer-test-soak-never-made"}) == [path]
    assert not path.exists()


def test_the_warm_up_fault_is_shown_apart_from_the_soaks() -> None:
    assert WARMUP_FAULT.kind == "kill-restart"
    assert WARMUP_FAULT.engine != WITNESS  # the witness lives from start to end
    result = summary(
        spec=SoakSpec(minutes=1),
        tally=Tally(),
        rows=[],
        faults=[],
        pulled_blocks=0,
        leftovers=[],
        removed_by_fleet=[],
        seconds=1.0,
        logs=[],
        warmup_faults=[{"kind": "kill-restart", "engine": "b", "seconds": 61.2}],
    )
    assert result["faults"] == {}
    assert "no fault was injected (run longer or lower --fault-every)" in result["problems"]
    assert result["warmup_fault_log"] == [{"kind": "kill-restart", "engine": "b", "seconds": 61.2}]
    assert "faults: none (and in warm-up, before the first sample: kill-restart of b (61 s))" in (
        render(result)
    )


def test_release_free_heap_returns_freed_pages_of_a_fragmented_heap() -> None:
    """64 KiB chunks come from the heap (under glibc's mmap threshold); keeping every
    tenth pins the heap's top, so free() alone returns almost nothing to the system."""
    chunks = [bytes(64 * 1024) for _ in range(2000)]  # 125 MiB
    kept = chunks[::10]
    del chunks
    before = process_info(os.getpid())
    assert release_free_heap()
    after = process_info(os.getpid())
    assert before is not None
    assert after is not None
    assert before.private_bytes - after.private_bytes > 50 * MIB
    assert len(kept) == 200


def test_trace_memory_names_the_line_that_kept_memory() -> None:
    from kvpeer.lab.bench.soak_memory import MemoryTrace

    trace = MemoryTrace(enabled=True)
    trace.start()
    trace.mark()
    kept = [bytes(1024) for _ in range(2048)]  # 2 MiB held past the second sample
    lines: list[str] = []
    trace.compare(lines.append)

    assert len(kept) == 2048
    top = trace.growth[0]
    assert top["bytes"] >= 2 * 2**20
    assert top["stack"][-1].startswith(f"{__file__}:")
    assert lines[0].startswith("driver allocations, second sample less first: +2.")
    assert "test_bench_soak.py" in lines[1]


def test_trace_memory_off_records_nothing() -> None:
    from kvpeer.lab.bench.soak_memory import MemoryTrace

    trace = MemoryTrace()
    trace.start()
    trace.mark()
    lines: list[str] = []
    trace.compare(lines.append)
    assert (trace.growth, lines) == ([], [])


def test_router_index_reads_the_index_gauges_of_a_metrics_page() -> None:
    import http.server
    import threading

    from kvpeer.lab.bench.soak_memory import router_index

    page = (
        b'kvpeer_router_index_blocks{engine="a",medium="GPU"} 2730.0\n'
        b'kvpeer_router_index_blocks{engine="a",medium="CPU"} 1365.0\n'
        b'kvpeer_router_index_hash_mappings{engine="a"} 4100.0\n'
        b'kvpeer_router_engine_up{engine="a"} 1.0\n'
    )

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        assert router_index(url) == {"a GPU": 2730, "a CPU": 1365, "a mappings": 4100}
    finally:
        server.shutdown()
        server.server_close()
    assert router_index(url, timeout_s=0.5) == {}  # nobody answers: nothing, no error
