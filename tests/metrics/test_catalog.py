"""The catalog's own rules, the thread CPU meter, and the layering of kvpeer.metrics."""

from __future__ import annotations

import re
import threading
import time

from kvpeer.metrics.catalog import CATALOG, MetricType
from kvpeer.metrics.reading import ThreadCpu
from kvpeer.node.counters import Histogram

NAME = re.compile(r"^[a-z][a-z0-9_]*$")
FORBIDDEN_LABELS = {"peer", "peer_id", "host", "port", "request", "req_id", "kv_request_id", "key"}


def test_names_units_and_labels_follow_the_conventions() -> None:
    assert len({m.name for m in CATALOG}) == len(CATALOG)
    for metric in CATALOG:
        assert NAME.match(metric.name), metric.name
        assert metric.help.endswith("."), metric.name
        assert not FORBIDDEN_LABELS & set(metric.labels), metric.name
        counter = metric.type is MetricType.COUNTER
        assert metric.name.endswith("_total") == counter, metric.name
        if metric.unit in ("seconds", "bytes"):
            assert metric.name.removesuffix("_total").endswith("_" + metric.unit), metric.name
        for values in metric.label_values:
            assert len(values) == len(metric.labels), metric.name
        assert bool(metric.buckets) == (metric.type is MetricType.HISTOGRAM), metric.name
        assert len(metric.label_values) <= 16, f"{metric.name}: too many series"


def test_histogram_buckets_sum_count_and_recent() -> None:
    histogram = Histogram((1.0, 2.0))
    for sample in (0.5, 1.0, 1.5, 3.0):
        histogram.observe(sample)
    snapshot = histogram.snapshot()
    assert snapshot.counts == (2, 1, 1)  # <=1, <=2, overflow
    assert (snapshot.count, snapshot.total, snapshot.recent) == (4, 6.0, (0.5, 1.0, 1.5, 3.0))


def test_thread_cpu_counts_kvpeer_threads_only_and_never_goes_down() -> None:
    meter = ThreadCpu()
    before = meter.seconds()

    def burn() -> None:
        end = time.thread_time() + 0.15
        while time.thread_time() < end:
            pass

    other = threading.Thread(target=burn, name="not-ours")
    other.start()
    other.join()
    assert meter.seconds() - before < 0.05
    ours = threading.Thread(target=burn, name="kvpeer-test-burn")
    ours.start()
    while ours.is_alive():
        during = meter.seconds()
        time.sleep(0.01)
    ours.join()
    after = meter.seconds()
    assert after >= during
    assert after - before >= 0.05
