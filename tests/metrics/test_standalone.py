"""Two standalone nodes pulling, seen through real HTTP ``/metrics`` scrapes.

The producer is a ``kvpeer serve --metrics-port`` process; the consumer a node in
this process with its own metrics server. Every number is checked against what
actually moved.
"""

from __future__ import annotations

import time
import urllib.request
import uuid
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvpeer.metrics.catalog import CATALOG, INFO, MetricType
from kvpeer.metrics.prom import MetricsServer
from tests.metrics.conftest import HEARTBEATS
from tests.net.procs import (
    BLOCK_LEN,
    LocalNode,
    NodeProcess,
    free_port,
    keys_of,
    start_serve,
    wait_until,
)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[("kvpeer_" + name, frozenset(labels.items()))]


def histogram_count(samples: Samples, name: str) -> float:
    return value(samples, name + "_count")


def test_every_series_exists_at_zero_before_the_first_event(
    producer: tuple[NodeProcess, int],
) -> None:
    _, port = producer
    samples = scrape(port)
    for metric in CATALOG:
        name = "kvpeer_" + metric.name
        if metric.name == INFO:
            (info,) = [labels for (n, labels) in samples if n == name]
            assert dict(info)["data_planes"] == "tcp"
            continue
        for label_values in metric.label_values:
            labels = frozenset(zip(metric.labels, label_values, strict=True))
            if metric.type is MetricType.HISTOGRAM:
                assert samples[(name + "_count", labels)] == 0
                assert samples[(name + "_bucket", labels | {("le", "+Inf")})] == 0
            elif metric.name == "engine_wait_seconds":  # a setting: engine_wait_s's default
                assert samples[(name, labels)] == 0.25
            elif metric.name != "thread_cpu_seconds_total":
                assert samples[(name, labels)] == 0, name


def test_pulled_bytes_equal_served_bytes_and_a_killed_producer_fails_fetches(
    producer: tuple[NodeProcess, int],
) -> None:
    serve, serve_port = producer
    with LocalNode("tcp", config=HEARTBEATS) as consumer:
        server = MetricsServer(consumer.node, "127.0.0.1", 0)
        try:
            first = consumer.pull(serve.peer_id, keys_of(range(8)), range(8))
            second = consumer.pull(serve.peer_id, keys_of(range(8, 20)), range(8, 20))
            assert (first.loaded, second.loaded) == (True, True)
            consumer.assert_blocks(range(20), range(20))
            moved = 20 * BLOCK_LEN

            mine, theirs = scrape(server.port), scrape(serve_port)
            assert value(mine, "pulled_bytes_total") == moved
            assert value(theirs, "served_bytes_total") == moved
            assert value(mine, "pulled_blocks_total") == 20
            assert value(theirs, "served_blocks_total") == 20
            assert value(mine, "fetches_total", result="ok") == 2
            assert histogram_count(mine, "fetch_duration_seconds") == 2
            assert histogram_count(mine, "fetch_size_bytes") == 2
            assert value(mine, "fetch_size_bytes_sum") == moved
            assert histogram_count(mine, "lookup_duration_seconds") >= 2
            assert value(mine, "lookups_total", result="retry") >= 20
            assert value(mine, "lookups_total", result="hit") >= 20
            assert value(mine, "sessions") == value(theirs, "sessions") == 1
            assert value(mine, "session_events_total", event="opened") == 1
            assert value(theirs, "thread_cpu_seconds_total") >= 0  # serve's engine thread polls

            # A PD load the producer never serves, then the producer dies.
            load = consumer.start_pd_load(
                serve.peer_id, f"gone-{uuid.uuid4().hex}", keys_of(range(4)), range(32, 36)
            )
            assert wait_until(lambda: value(scrape(server.port), "loads_in_flight") == 1)
            serve.kill()
            assert load.wait() is False
            load.finish()
            after = scrape(server.port)
            assert value(after, "fetches_total", result="failed") == 1
            assert value(after, "fetches_total", result="ok") == 2
            assert value(after, "session_events_total", event="closed") == 1
            closed = {
                dict(labels)["kind"]: v
                for (name, labels), v in after.items()
                if name == "kvpeer_sessions_closed_total" and v
            }
            assert closed == {"unreachable": 1}, closed
            assert value(after, "sessions") == 0
            assert value(after, "loads_in_flight") == 0
        finally:
            server.close()


IDLE_WINDOW_S = 10.0
IDLE_CORE_SHARE = 0.02


def test_an_idle_node_with_a_live_session_uses_under_2_percent_of_a_core(
    tmp_path: Path,
) -> None:
    """Default timers, one live session (heartbeats flowing), nothing to do: over a
    10-second window the node's own threads use less than 2 % of one core, read from
    its ``thread_cpu_seconds_total`` the way an operator's Prometheus would."""
    port = free_port()
    serve = start_serve(tmp_path, args=["--metrics-port", str(port)])
    try:
        assert serve.wait_for_output("metrics at"), serve.log()
        with LocalNode("tcp") as consumer:
            assert consumer.pull(serve.peer_id, keys_of(range(4)), range(4)).loaded
            before = value(scrape(port), "thread_cpu_seconds_total")
            started = time.monotonic()
            time.sleep(IDLE_WINDOW_S)  # the measured window itself, not a wait for state
            after = value(scrape(port), "thread_cpu_seconds_total")
            elapsed = time.monotonic() - started
            assert value(scrape(port), "sessions") == 1  # the session stayed up throughout
        share = (after - before) / elapsed
        assert share < IDLE_CORE_SHARE, f"idle node used {share:.1%} of a core"
    finally:
        serve.stop()
