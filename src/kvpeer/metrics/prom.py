"""The catalog as Prometheus metrics: a collector over one node, in a private registry.

Nothing is counted here: each scrape takes one :class:`~kvpeer.metrics.reading.NodeReading`
(under the node's lock) and renders every catalog series, zeros included.
:class:`MetricsServer` also answers ``GET /peers`` (:mod:`kvpeer.metrics.peers`).
"""

from __future__ import annotations

import math
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, generate_latest, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from kvpeer.metrics.catalog import CATALOG, MetricType
from kvpeer.metrics.peers import encode, peers_document
from kvpeer.metrics.reading import NodeReading, ThreadCpu, read_node, read_tier, values
from kvpeer.node.counters import HistogramSnapshot
from kvpeer.node.driver import DrivenTier
from kvpeer.node.tier import Tier

__all__ = ["PREFIX", "MetricsServer", "NodeCollector", "registry_for", "tier_scraper"]

PREFIX = "kvpeer_"


def _buckets(snapshot: HistogramSnapshot) -> list[tuple[str, float]]:
    cumulative = 0
    out: list[tuple[str, float]] = []
    for bound, count in zip((*snapshot.buckets, math.inf), snapshot.counts, strict=True):
        cumulative += count
        out.append(("+Inf" if bound == math.inf else repr(bound), float(cumulative)))
    return out


class NodeCollector(Collector):
    """Reads ``node`` at each scrape and yields every catalog metric as ``kvpeer_*``."""

    def __init__(
        self, node: DrivenTier | Callable[[ThreadCpu], NodeReading], prefix: str = PREFIX
    ) -> None:
        """``node``, or a function that takes one reading (benchmarks read a bare tier)."""
        self._read = (lambda cpu: read_node(node, cpu)) if isinstance(node, DrivenTier) else node
        self._prefix = prefix
        self._cpu = ThreadCpu()

    def collect(self) -> Iterator[Metric]:
        current = values(self._read(self._cpu))
        for metric in CATALOG:
            name = self._prefix + metric.name
            labels = list(metric.labels)
            family: CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily
            if metric.type is MetricType.COUNTER:
                family = CounterMetricFamily(name, metric.help, labels=labels)
            elif metric.type is MetricType.GAUGE:
                family = GaugeMetricFamily(name, metric.help, labels=labels)
            else:
                family = HistogramMetricFamily(name, metric.help, labels=labels)
            for label_values, value in current[metric.name].items():
                if isinstance(value, HistogramSnapshot):
                    assert isinstance(family, HistogramMetricFamily)
                    family.add_metric(list(label_values), _buckets(value), value.total)
                else:
                    assert not isinstance(family, HistogramMetricFamily)
                    family.add_metric(list(label_values), value)
            yield family


def registry_for(
    node: DrivenTier | Callable[[ThreadCpu], NodeReading],
) -> CollectorRegistry:
    """A private registry (never prometheus-client's global one) with ``node``'s metrics."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(NodeCollector(node))
    return registry


def tier_scraper(tier: Tier, lock: threading.Lock) -> Callable[[], bytes]:
    """One full scrape of a bare ``tier`` per call (reading under ``lock``, the text
    rendered outside it), as ``/metrics`` would serve it: what benchmarks run."""

    def read(cpu: ThreadCpu) -> NodeReading:
        with lock:
            return read_tier(tier, cpu)

    registry = registry_for(read)
    return lambda: generate_latest(registry)


StartResponse = Callable[..., Any]
App = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]


def node_app(node: DrivenTier) -> App:
    """``/peers`` (JSON) for ``node``; every other path is prometheus-client's ``/metrics``."""
    metrics = make_wsgi_app(registry_for(node))

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        if environ.get("PATH_INFO", "").rstrip("/") != "/peers":
            return metrics(environ, start_response)  # type: ignore[no-any-return]
        body = encode(peers_document(node))
        headers = [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
        start_response("200 OK", headers)
        return [body]

    return app


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not logged."""


class MetricsServer:
    """``/metrics`` and ``/peers`` over HTTP for one node, on a daemon thread."""

    def __init__(self, node: DrivenTier, host: str, port: int) -> None:
        family, _, _, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]

        class Server(ThreadingWSGIServer):
            address_family = family

        self._server: WSGIServer = make_server(
            str(address[0]), port, node_app(node), Server, handler_class=_QuietHandler
        )
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="metrics-http", daemon=True
        )
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._server.server_port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
