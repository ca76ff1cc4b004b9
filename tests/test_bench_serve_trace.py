"""``kvpeer bench serve --trace``: trace lines parsed, merged by wall clock, rendered; the
slowest request of each workload picked; the router's own line per request (fake engines
behind the real router). Recorded lines, no vLLM."""

from __future__ import annotations

import logging
from pathlib import Path

from kvpeer.lab.bench.serve_bench import ServeBenchSpec, run_matrix
from kvpeer.lab.bench.serve_stats import RequestRecord
from kvpeer.lab.bench.serve_trace import (
    RouterCapture,
    Slowest,
    TraceEvent,
    parse_line,
    read_logs,
    render_timeline,
    timeline,
)
from tests.test_bench_serve import TINY, FakeArms, spec_from

ROUTER = (
    'kvpeer.trace t=100.000000 node=router id=r1 event=sent engine=b source=a '
    'reason="pull: predicted faster" predicted_ttft_s=0.400000 first_byte_s=0.900000 ok=1'
)
CONSUMER = [  # engine b's log: vLLM's own lines around ours
    "(APIServer pid=1) INFO 05-01 12:00:00 [logger.py:1] Received request cmpl-1",
    "kvpeer.trace t=100.010000 node=127.0.0.1:5711 id=r1 event=lookup_asked peer=127.0.0.1:5710",
    "kvpeer.trace t=100.400000 node=127.0.0.1:5711 id=r1 event=lookup_answered "
    "peer=127.0.0.1:5710 hits=32 keys=32 round=0",
    "kvpeer.trace t=100.800000 node=127.0.0.1:5711 id=r1 event=load_done peer=127.0.0.1:5710 "
    "blocks=32 bytes=25165824 seconds=0.350000",
    "kvpeer.trace t=100.020000 node=127.0.0.1:5711 id=other event=lookup_asked peer=x",
]
PRODUCER = [
    "kvpeer.trace t=100.020000 node=127.0.0.1:5710 id=r1 event=lookup_received "
    "peer=127.0.0.1:5711 keys=32 round=0",
    "kvpeer.trace t=100.390000 node=127.0.0.1:5710 id=r1 event=lookup_answered "
    "peer=127.0.0.1:5711 hits=32 keys=32 round=0 waited_s=0.370000",
    "kvpeer.trace t=100.79",  # cut short when the engine was killed
]
NAMES = {"127.0.0.1:5710": "a", "127.0.0.1:5711": "b"}


def test_a_line_is_parsed_after_any_log_prefix() -> None:
    event = parse_line("(EngineCore pid=7) " + CONSUMER[1] + "\n")
    assert event == TraceEvent(100.01, "127.0.0.1:5711", "r1", "lookup_asked",
                               {"peer": "127.0.0.1:5710"})  # fmt: skip
    router = parse_line(ROUTER)
    assert router is not None
    assert router.fields["reason"] == "pull: predicted faster"


def test_other_lines_and_cut_lines_are_not_events() -> None:
    assert parse_line(CONSUMER[0]) is None
    assert parse_line(PRODUCER[-1]) is None
    assert parse_line("kvpeer.trace t=1.0 node=x event=y") is None  # no id


def test_router_and_both_engines_merge_by_wall_clock(tmp_path: Path) -> None:
    (tmp_path / "a.log").write_text("\n".join(PRODUCER) + "\n")
    (tmp_path / "b.log").write_text("\n".join(CONSUMER) + "\n")
    logs = [tmp_path / "a.log", tmp_path / "b.log", tmp_path / "missing.log"]
    events = [parse_line(ROUTER), *read_logs(logs)]
    lines = render_timeline(timeline([e for e in events if e is not None], "r1"), NAMES)
    assert lines == [
        "+  0.000 router  sent to b (source a, pull: predicted faster), predicted TTFT 0.400 s",
        "+  0.010 b       lookup_asked peer=a",
        "+  0.020 a       lookup_received peer=b keys=32 round=0",
        "+  0.390 a       lookup_answered peer=b hits=32 keys=32 round=0 waited_s=0.370000",
        "+  0.400 b       lookup_answered peer=a hits=32 keys=32 round=0",
        "+  0.800 b       load_done peer=a blocks=32 bytes=25165824 seconds=0.350000",
        "+  0.900 router  first byte (TTFT 0.900 s)",
    ]


def test_the_slowest_measured_request_of_each_workload_is_picked() -> None:
    def rec(ttft: float, request_id: str | None, error: str | None = None) -> RequestRecord:
        return RequestRecord(0.0, ttft, ttft, 100, 1, 0, "b", "a", error, request_id)

    slowest = Slowest("kvpeer")
    slowest("none", "chat", [rec(9.0, "n1")])
    slowest("kvpeer", "chat", [rec(1.0, "k1"), rec(2.0, "k2"), rec(5.0, "k3", "HTTP 500"),
                               rec(7.0, None)])  # fmt: skip
    assert {w: r.request_id for w, r in slowest.picked.items()} == {"chat": "k2"}
    slowest("kvpeer", "chat", [rec(1.5, "k4")])  # a later repeat, faster: k2 stays
    assert slowest.picked["chat"].request_id == "k2"
    text = slowest.timelines([], NAMES)
    assert text[0].startswith("chat: slowest kvpeer request k2 (TTFT 2.000 s")
    assert text[1] == "  (no trace lines)"


def test_the_router_logs_one_line_per_request_named_by_its_request_id() -> None:
    spec = ServeBenchSpec(arms=("kvpeer",), shape=TINY, workloads=("pinned-chat",), trace=True)
    slowest = Slowest("kvpeer")
    capture = RouterCapture().install()
    try:
        result = run_matrix(spec, FakeArms(), lambda _m: None, slowest)
    finally:
        capture.remove()
    assert result.ok
    picked = slowest.picked["pinned-chat"]
    sent = [e for e in capture.events() if e.kv_request_id == picked.request_id]
    assert [(e.node, e.event) for e in sent] == [("router", "sent")]
    assert sent[0].fields["engine"] == picked.engine
    assert float(sent[0].fields["first_byte_s"]) <= picked.ttft_s + 0.5
    routed = {e.kv_request_id for e in capture.events()}
    assert len(routed) >= TINY.requests


def test_the_router_logs_nothing_untraced() -> None:
    spec = ServeBenchSpec(arms=("kvpeer",), shape=TINY, workloads=("pinned-chat",))
    capture = RouterCapture()
    logger = logging.getLogger("kvpeer.trace")
    level = logger.level
    logger.setLevel(logging.WARNING)  # what the CLI sets without KVPEER_TRACE
    logger.addHandler(capture)  # listening, but the router must not speak
    try:
        run_matrix(spec, FakeArms(), lambda _m: None)
    finally:
        logger.removeHandler(capture)
        logger.setLevel(level)
    assert capture.lines == []


def test_the_flag_is_parsed() -> None:
    assert spec_from("--trace").trace is True
    assert spec_from().trace is False
