"""kvpeer's metrics: one catalog, read from the tier's counters at scrape time.

Sits above :mod:`kvpeer.node` (it reads nodes); nothing below imports it.
``kvpeer.metrics.prom`` needs prometheus-client; the catalog and readings do not.
"""

from kvpeer.metrics.catalog import CATALOG, Metric, MetricType
from kvpeer.metrics.reading import NodeReading, ThreadCpu, read_node, values

__all__ = ["CATALOG", "Metric", "MetricType", "NodeReading", "ThreadCpu", "read_node", "values"]
