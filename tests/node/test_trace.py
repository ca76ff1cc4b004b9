"""The request trace (``kvpeer.node.trace``): one pull between two in-process tiers.

Enabled, both sides' events of the pull appear on ``kvpeer.trace`` in order, under
the pull's ``kv_request_id`` and the right node and peer; disabled, nothing does.
"""

from __future__ import annotations

import logging

import pytest

from kvpeer.config import TierConfig
from kvpeer.lab.bench.serve_trace import TraceEvent, parse_line
from kvpeer.node.tier import Tier
from kvpeer.node.trace import TRACE_LOGGER
from kvpeer.testing import FakeDataPlane, FakeParent, Region
from kvpeer.testing.cluster import (
    BLOCK_LEN,
    NUM_BLOCKS,
    Cluster,
    RecordingControl,
    TierNode,
    keys,
    kv_source,
)
from kvpeer.types import LookupResult

KEYS = keys(1, 2, 3)


def traced_node(cluster: Cluster, host: str, port: int, *, trace: bool) -> TierNode:
    """Like :meth:`Cluster.add`, with the tier's trace on or off."""
    cfg = TierConfig.from_dict({"host": host, "port": port})
    region = Region(NUM_BLOCKS, BLOCK_LEN)
    plane = FakeDataPlane(cluster.fabric, cfg.peer_id, region, auto_complete=True)
    parent = FakeParent(region, cluster.job_ids)
    control = RecordingControl(cluster.net.attach(cfg.peer_id))
    tier = Tier(cfg, control, plane, clock=cluster.clock, trace=trace)
    node = TierNode(cfg, region, plane, parent, control, tier, cluster.job_ids)
    cluster.nodes[cfg.peer_id] = node
    return node


def pull(cluster: Cluster, consumer: TierNode, producer: TierNode) -> None:
    """``consumer`` probes ``producer`` for KEYS (it holds them) and loads them."""
    for k in KEYS:
        producer.parent.put(k)
    req = consumer.request("c", kv_source("kv1", producer))
    for _ in range(10):
        answers = consumer.lookup(req, *KEYS)
        if LookupResult.RETRY not in answers:
            break
        cluster.step()
    assert answers == [LookupResult.HIT] * 3
    job, _ = consumer.load(req, KEYS)
    cluster.run()
    assert consumer.outcome(job) is True
    consumer.finish(req)


def events(caplog: pytest.LogCaptureFixture) -> list[TraceEvent]:
    parsed = [parse_line(r.getMessage()) for r in caplog.records if r.name == TRACE_LOGGER]
    return [e for e in parsed if e is not None]


def test_one_pull_traces_both_sides_in_order(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=TRACE_LOGGER)
    cluster = Cluster()
    a = traced_node(cluster, "a", 1, trace=True)  # consumer
    b = traced_node(cluster, "b", 2, trace=True)  # producer
    pull(cluster, a, b)
    seen = [(e.node, e.event) for e in events(caplog) if e.kv_request_id == "kv1"]
    assert seen == [
        (a.peer_id, "lookup_asked"),
        (a.peer_id, "lookup_sent"),
        (b.peer_id, "lookup_received"),
        (b.peer_id, "lookup_answered"),
        (a.peer_id, "lookup_answered"),
        (a.peer_id, "lookup_hit"),
        (a.peer_id, "load_submitted"),
        (a.peer_id, "fetch_sent"),
        (b.peer_id, "fetch_received"),
        (b.peer_id, "transfer_started"),
        (b.peer_id, "transfer_done"),
        (a.peer_id, "transfer_done_received"),
        (a.peer_id, "load_done"),
        (a.peer_id, "load_reported"),
        (a.peer_id, "request_finished"),
    ]
    by_event = {(e.node, e.event): e for e in events(caplog)}
    assert {e.fields["peer"] for e in events(caplog) if e.node == a.peer_id} == {b.peer_id}
    assert {e.fields["peer"] for e in events(caplog) if e.node == b.peer_id} == {a.peer_id}
    answered = by_event[(b.peer_id, "lookup_answered")].fields
    assert answered["hits"] == "3"
    assert float(answered["waited_s"]) >= 0
    assert by_event[(b.peer_id, "transfer_started")].fields["blocks"] == "3"
    assert by_event[(b.peer_id, "transfer_done")].fields["bytes"] == str(3 * BLOCK_LEN)
    done = by_event[(a.peer_id, "load_done")].fields
    assert done["blocks"] == "3"
    assert done["bytes"] == str(3 * BLOCK_LEN)
    times = [e.t for e in events(caplog)]
    assert times == sorted(times)  # wall clock, one process
    # Engine-side events count the consumer engine's steps, which never go back.
    steps = [int(e.fields["step"]) for e in events(caplog) if "step" in e.fields]
    assert len(steps) == 5
    assert steps == sorted(steps)
    assert int(by_event[(a.peer_id, "request_finished")].fields["step"]) > steps[0]
    # The handshakes stand on their own lines (no request); each side dials the other.
    session = [(e.node, e.event) for e in events(caplog) if e.kv_request_id == "-"]
    for dialer, dialed in ((a, b), (b, a)):
        handshake = [
            (dialer.peer_id, "connect_sent"),
            (dialed.peer_id, "connect_received"),
            (dialed.peer_id, "connect_ack_sent"),
            (dialer.peer_id, "connect_ack_received"),
        ]
        assert [x for x in session if x in handshake] == handshake


def test_disabled_trace_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=TRACE_LOGGER)
    cluster = Cluster()
    a = traced_node(cluster, "a", 1, trace=False)
    b = traced_node(cluster, "b", 2, trace=False)
    pull(cluster, a, b)
    assert [r for r in caplog.records if r.name == TRACE_LOGGER] == []


def test_only_the_traced_side_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=TRACE_LOGGER)
    cluster = Cluster()
    a = traced_node(cluster, "a", 1, trace=False)
    b = traced_node(cluster, "b", 2, trace=True)
    pull(cluster, a, b)
    assert {e.node for e in events(caplog)} == {b.peer_id}
