"""The router's ``/metrics`` shows what its prefix index holds (kvpeer.router.metrics):
blocks per engine and medium, hash mappings, speculative entries and the index's event
counters, so an operator (and ``kvpeer soak``) sees the router's memory follow the
engines'."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from kvpeer.router.feed import StreamSynced
from kvpeer.router.index import MEDIUM_CPU, MEDIUM_GPU, PrefixIndex
from kvpeer.router.kvevents import BlocksRemoved, BlocksStored
from kvpeer.router.metrics import _index_metrics

BS = 4


class Only(Collector):
    def __init__(self, index: PrefixIndex) -> None:
        self._index = index

    def collect(self) -> Iterator[Metric]:
        return _index_metrics(self._index)


def scrape(index: PrefixIndex) -> dict[str, float]:
    registry = CollectorRegistry()
    registry.register(Only(index))
    text = generate_latest(registry).decode()
    return {
        sample.name + "".join(f"{{{k}={v}}}" for k, v in sorted(sample.labels.items())):
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_blocks_mappings_and_event_counters_follow_the_events() -> None:
    index = PrefixIndex(BS)
    index.apply("a", StreamSynced())
    index.apply("a", BlocksStored.of_ids(MEDIUM_GPU, (1, 2, 3), None, tuple(range(12)), BS))
    index.apply("a", BlocksStored.of_ids(MEDIUM_CPU, (1,), None, tuple(range(4)), BS))
    index.apply("b", BlocksStored.of_ids(MEDIUM_GPU, (7,), 99, tuple(range(4)), BS))  # orphan

    held = scrape(index)
    assert held["kvpeer_router_index_blocks{engine=a}{medium=GPU}"] == 3
    assert held["kvpeer_router_index_blocks{engine=a}{medium=CPU}"] == 1
    assert held["kvpeer_router_index_hash_mappings{engine=a}"] == 3
    assert held["kvpeer_router_index_events_total{kind=orphans}"] == 1

    index.apply("a", BlocksRemoved(MEDIUM_GPU, (2, 3, 42)))
    after = scrape(index)
    assert after["kvpeer_router_index_blocks{engine=a}{medium=GPU}"] == 1
    assert after["kvpeer_router_index_events_total{kind=unknown_removed}"] == 1
    # Blocks 2 and 3 left every medium: their mappings are retired (still counted,
    # among the most recent max_retired); block 1 is still held.
    assert after["kvpeer_router_index_hash_mappings{engine=a}"] == 3
