"""Tier, sessions: reaping, pending work, drain and shutdown, statistics, admission.

Pins ``kvpeer.node.tier`` invariants 1 and 4 and the peer table's admission rules
over a cluster (docs/design.md §5.8, §6, §7; ``test_peertable.py`` drives it directly): a dead
session is reaped within one poll (its loads and stores fail, waiting probes
answer MISS, pinned serves go back to the parent); ``has_pending_work`` says
whether anything is in flight; ``drain_jobs`` is bounded and ``shutdown``
fails what is still held; the allow-list and ``max_peers`` decide which
sessions exist; a restarted peer gets a fresh session; one pair of nodes can
pull from each other at the same time.
"""

from __future__ import annotations

import logging

import pytest

from kvpeer.protocol import Connect, Disconnect
from kvpeer.testing.cluster import Cluster, TierNode, decoder, key, keys, kv_source, prefiller
from kvpeer.types import LookupResult

HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY
KEYS = keys(1, 2, 3)


@pytest.fixture
def cluster() -> Cluster:
    return Cluster()


def unanswered(kv_id: str, host: str, port: int) -> dict[str, object]:
    """A symmetric source role naming a peer nobody runs (it never answers)."""
    return {"remote_kv_source": {"kv_request_id": kv_id, "remote_host": host, "remote_port": port}}


def bytes_match(
    a: TierNode, b: TierNode, slots: tuple[int, ...], wanted: tuple[bytes, ...]
) -> bool:
    return [a.block(s) for s in slots] == [b.parent.expected(k) for k in wanted]


def bound_store_in_flight(cluster: Cluster, a: TierNode, b: TierNode) -> tuple[int, int]:
    """``b`` writes a stored batch into ``a`` and the write stays pending (load, store)."""
    b.plane.auto_complete = False
    b.store(b.request("p", decoder("kv1")), KEYS)
    store = max(b.submitted)
    load, _ = a.load(a.request("c", prefiller("kv1", b)), KEYS)
    cluster.run()
    assert len(b.plane.pending) == 1
    return load, store


class TestReaping:
    """A dead session is reaped within one poll; nothing it held hangs."""

    def test_loads_fail_when_the_producer_dies(self, cluster: Cluster) -> None:
        a, b = cluster.add("a", 1), cluster.add("b", 2)
        b.request("p", decoder("kv1"))
        load, _ = a.load(a.request("c", prefiller("kv1", b)), KEYS)
        cluster.run()
        assert a.stats().loads_in_flight == 1
        cluster.kill(b)
        a.step()
        assert a.outcome(load) is False
        assert (a.stats().sessions, a.stats().loads_in_flight) == (0, 0)

    def test_stores_fail_when_the_consumer_dies(self, cluster: Cluster) -> None:
        a, b = cluster.add("a", 1), cluster.add("b", 2)
        _, store = bound_store_in_flight(cluster, a, b)
        assert b.stats().transfers_in_flight == 1
        cluster.kill(a)
        b.step()
        assert b.outcome(store) is False
        assert (b.stats().sessions, b.stats().transfers_in_flight) == (0, 0)
        assert b.parent.pins == {}
        assert b.stats().bound_ids == 0

    def test_waiting_probes_answer_miss(self, cluster: Cluster) -> None:
        a, b = cluster.add("a", 1), cluster.add("b", 2)
        req = a.request("c", kv_source("kv1", b))
        cluster.run()
        a.lookup(req, *KEYS)
        a.step()
        cluster.kill(b)
        a.step()
        assert a.lookup(req, *KEYS) == [MISS] * 3

    def test_pinned_serves_go_back_to_the_parent(self, cluster: Cluster) -> None:
        a, b = cluster.add("a", 1), cluster.add("b", 2)
        b.parent.put(key(1))
        b.parent.put(key(2))
        b.parent.pending.add(key(2))  # HIT_PENDING: the serve stays open
        req = a.request("c", kv_source("kv1", b))
        a.lookup(req, key(1), key(2))
        cluster.run()
        assert len(b.parent.open_requests) == 1
        assert b.parent.pinned_slots() == 1
        assert b.stats().pinned_blocks == 1
        cluster.kill(a)
        b.step()
        assert b.parent.open_requests == {}
        assert b.parent.pins == {}
        assert b.unreported() == set()


class TestPendingWork:
    """has_pending_work is true exactly while something is in flight or owed."""

    def test_idle_tier_has_no_work(self, cluster: Cluster) -> None:
        a = cluster.add("a", 1)
        assert not a.tier.has_pending_work()
        a.step()
        assert not a.tier.has_pending_work()

    def test_work_comes_and_goes_with_a_pd_transfer(self, cluster: Cluster) -> None:
        a, b = cluster.add("a", 1), cluster.add("b", 2)
        load, store = bound_store_in_flight(cluster, a, b)
        assert a.tier.has_pending_work()  # load in flight
        assert b.tier.has_pending_work()  # transfer in flight
        b.plane.complete_all()
        b.record(b.tier.get_finished_jobs())  # b collects the write, reports the store
        assert b.outcome(store) is True
        assert not b.tier.has_pending_work()
        cluster.run()
        assert (a.outcome(load), b.outcome(store)) == (True, True)
        assert not a.tier.has_pending_work()
        assert not b.tier.has_pending_work()

    def test_a_peer_lookup_is_work_until_served(self, cluster: Cluster) -> None:
        a, b = cluster.add("a", 1), cluster.add("b", 2)
        req = a.request("c", kv_source("kv1", b))
        cluster.run()
        assert not b.tier.has_pending_work()
        a.lookup(req, *KEYS)
        assert a.tier.has_pending_work()  # probes to flush
        a.step()
        b.record(b.tier.get_finished_jobs())  # the lookup arrives
        assert b.tier.has_pending_work()
        b.tier.serve_external_requests(b.parent)
        assert not b.tier.has_pending_work()

    def test_unread_results_are_work(self, cluster: Cluster) -> None:
        a = cluster.add("a", 1)
        a.load(a.request("local"), KEYS)  # fails at once: no source
        assert a.tier.has_pending_work()
        a.step()
        assert not a.tier.has_pending_work()

    def test_drain_is_bounded_with_a_stuck_write(
        self, cluster: Cluster, caplog: pytest.LogCaptureFixture
    ) -> None:
        a = cluster.add("a", 1)
        b = cluster.add("b", 2, fake_sleep=True)
        bound_store_in_flight(cluster, a, b)
        for write in b.plane.pending.values():
            write.busy = True
        caplog.set_level(logging.WARNING, logger="kvpeer.tier")
        start = cluster.clock.now
        b.tier.drain_jobs(timeout_s=0.5)
        assert 0.5 <= cluster.clock.now - start < 0.6
        assert len(b.plane.pending) == 1  # drain never cancels
        assert any("still busy" in r.getMessage() for r in caplog.records)

    def test_drain_without_work_returns_at_once(self, cluster: Cluster) -> None:
        a, b = cluster.add("a", 1, fake_sleep=True), cluster.add("b", 2)
        load, _ = a.load(a.request("c", prefiller("kv1", b)), ())
        start = cluster.clock.now
        a.tier.drain_jobs()
        assert cluster.clock.now == start
        a.step()
        assert a.outcome(load) is True

    def test_shutdown_fails_everything_still_held(self, cluster: Cluster) -> None:
        a, b = cluster.add("a", 1), cluster.add("b", 2)
        load, store = bound_store_in_flight(cluster, a, b)
        parked = b.store(b.request("p2", decoder("kv2")), keys(4))
        assert b.stats().parked_batches == 1
        b.tier.shutdown()
        b.tier.shutdown()  # idempotent
        b.record(b.tier.get_finished_jobs())
        assert (b.outcome(store), b.outcome(parked)) == (False, False)
        assert b.unreported() == set()
        assert b.tier.get_finished_jobs() == []
        assert b.parent.pins == {}
        assert b.plane.closed
        assert not cluster.net.is_up(b.peer_id)
        assert b.sent_of(Disconnect, to=a) != []
        del cluster.nodes[b.peer_id]
        a.step()
        assert a.outcome(load) is False


class TestStatistics:
    """statistics() counts sessions, requests, parked, tombstones, flights and pins."""

    def test_counts_follow_the_traffic(self, cluster: Cluster) -> None:
        a, b = cluster.add("a", 1), cluster.add("b", 2)
        assert a.stats().sessions == 0
        load, store = bound_store_in_flight(cluster, a, b)
        b.store(b.request("p2", decoder("kv2")), keys(4))
        b.store(b.request("p3", decoder("kv3")), keys(5, 6))
        b.store(b.request("p3b", decoder("kv3")), keys(7))
        a_stats, b_stats = a.stats(), b.stats()
        assert (a_stats.sessions, a_stats.requests, a_stats.consumer_ids) == (1, 1, 1)
        assert a_stats.loads_in_flight == 1
        assert (b_stats.sessions, b_stats.requests, b_stats.producer_ids) == (1, 4, 3)
        assert (b_stats.parked_ids, b_stats.parked_batches) == (2, 3)
        assert (b_stats.bound_ids, b_stats.transfers_in_flight) == (1, 1)
        assert b_stats.tombstones == 0
        b.plane.complete_all()
        cluster.run()
        assert (a.outcome(load), b.outcome(store)) == (True, True)
        assert (a.stats().loads_in_flight, b.stats().transfers_in_flight) == (0, 0)
        cluster.advance(61)
        cluster.step()
        assert (b.stats().tombstones, b.stats().parked_ids) == (2, 0)

    def test_pinned_blocks_of_served_lookups(self, cluster: Cluster) -> None:
        a, b = cluster.add("a", 1), cluster.add("b", 2)
        for k in KEYS:
            b.parent.put(k)
        req = a.request("c", kv_source("kv1", b))
        a.lookup(req, *KEYS, key(9))
        cluster.run()
        assert b.stats().pinned_blocks == 3
        a.finish(req)
        cluster.run()
        assert b.stats().pinned_blocks == 0
        assert b.parent.pins == {}


class TestAllowList:
    """allowed_peers refuses outbound sessions and ignores inbound ones."""

    def test_outbound_peer_not_allowed_runs_locally(self, cluster: Cluster) -> None:
        a = cluster.add("a", 1, {"allowed_peers": ["c:3"]})
        b = cluster.add("b", 2)
        req = a.request("c", kv_source("kv1", b))
        assert a.stats().peers_refused == 1
        assert a.stats().sessions == 0
        assert a.lookup(req, *KEYS) == [MISS] * 3
        load, _ = a.load(req, KEYS)
        cluster.run()
        assert a.outcome(load) is False
        assert a.sent() == []

    def test_allowed_peer_is_served(self, cluster: Cluster) -> None:
        a = cluster.add("a", 1, {"allowed_peers": "b:2"})
        b = cluster.add("b", 2, {"allowed_peers": ["a:1"]})
        b.parent.put(key(1))
        req = a.request("c", kv_source("kv1", b))
        a.lookup(req, key(1))
        cluster.run()
        assert a.lookup(req, key(1)) == [HIT]
        assert (a.stats().peers_refused, b.stats().peers_refused) == (0, 0)

    def test_inbound_peer_not_allowed_is_refused_at_once(self, cluster: Cluster) -> None:
        """No session, no dial-back; one disconnect on the peer's own connection, and
        the refused side computes locally at once (no handshake timeout to wait out)."""
        a = cluster.add("a", 1, {"handshake_timeout_s": 5})
        b = cluster.add("b", 2, {"allowed_peers": ["c:3"]})
        b.parent.put(key(1))
        req = a.request("c", kv_source("kv1", b))
        a.lookup(req, key(1))
        cluster.run()
        assert b.stats().sessions == 0
        assert b.stats().peers_refused >= 1
        refusals = b.sent_of(Disconnect, to=a)
        assert refusals
        assert all("allowed" in m.reason for m in refusals if isinstance(m, Disconnect))
        assert b.parent.lookups == 0
        assert a.stats().sessions == 0
        assert a.lookup(req, key(1)) == [MISS]


class TestPeerCap:
    """max_peers caps sessions: idle ones are evicted, handshaking before ready."""

    def test_handshaking_session_is_evicted_before_a_ready_one(self, cluster: Cluster) -> None:
        a = cluster.add("a", 1, {"max_peers": 2})
        b, d = cluster.add("b", 2), cluster.add("d", 4)
        a.request("c1", kv_source("kv1", b))
        cluster.run()
        cluster.advance(1)
        a.request("c2", unanswered("kv2", "c", 3))  # never answers: stays in handshake
        cluster.run()
        assert a.session(b).ready
        a.request("c3", kv_source("kv3", d))
        assert a.tier.session("c:3") is None
        assert a.tier.session(b.peer_id) is not None
        assert a.tier.session(d.peer_id) is not None
        assert (a.stats().sessions, a.stats().peers_refused) == (2, 0)
        assert a.sent_of(Disconnect, to=b) == []

    def test_least_recently_used_ready_session_goes_first(self, cluster: Cluster) -> None:
        """Among ready sessions no live request pulls from, the least recently used goes."""
        a = cluster.add("a", 1, {"max_peers": 2})
        b, c, d = cluster.add("b", 2), cluster.add("c", 3), cluster.add("d", 4)
        first = a.request("c1", kv_source("kv1", b))
        cluster.advance(1)
        second = a.request("c2", kv_source("kv2", c))
        cluster.run()
        a.finish(first)
        a.finish(second)
        cluster.run()
        a.request("c3", kv_source("kv3", d))
        assert a.tier.session(b.peer_id) is None
        assert len(a.sent_of(Disconnect, to=b)) == 1
        cluster.run()
        assert b.stats().sessions == 0  # b saw the disconnect
        assert a.session(c).ready
        assert a.session(d).ready

    def test_ready_sessions_of_live_requests_are_kept(self, cluster: Cluster) -> None:
        """A full cap of sessions live requests pull from: the newcomer runs locally."""
        a = cluster.add("a", 1, {"max_peers": 2})
        b, c, d = cluster.add("b", 2), cluster.add("c", 3), cluster.add("d", 4)
        a.request("c1", kv_source("kv1", b))
        a.request("c2", kv_source("kv2", c))
        cluster.run()
        req = a.request("c3", kv_source("kv3", d))
        assert a.tier.session(d.peer_id) is None
        assert a.session(b).ready
        assert a.session(c).ready
        assert a.stats().peers_refused == 1
        assert a.lookup(req, *KEYS) == [MISS] * 3

    def test_busy_sessions_are_kept_and_the_request_runs_locally(self, cluster: Cluster) -> None:
        a = cluster.add("a", 1, {"max_peers": 1})
        b, c = cluster.add("b", 2), cluster.add("c", 3)
        b.request("p", decoder("kv1"))
        load, _ = a.load(a.request("c1", prefiller("kv1", b)), KEYS)
        cluster.run()
        req = a.request("c2", kv_source("kv2", c))
        assert a.stats().peers_refused == 1
        assert a.tier.session(b.peer_id) is not None
        assert a.lookup(req, *KEYS) == [MISS] * 3
        assert a.outcome(load) is None
        assert a.sent(to=c) == []

    def test_inbound_peer_beyond_the_cap_evicts_an_idle_session(self, cluster: Cluster) -> None:
        a = cluster.add("a", 1)
        b = cluster.add("b", 2, {"max_peers": 1})
        c = cluster.add("c", 3)
        a.request("c1", kv_source("kv1", b))
        cluster.run()
        c.request("c2", kv_source("kv2", b))
        cluster.run()
        assert b.tier.session(a.peer_id) is None
        assert b.session(c).ready
        assert b.stats().sessions == 1


class TestRestart:
    """A peer restart (new boot id) fails the old session's jobs; a new one works."""

    def test_old_jobs_fail_and_the_new_peer_serves(self, cluster: Cluster) -> None:
        a, b = cluster.add("a", 1), cluster.add("b", 2)
        b.request("p", decoder("kv1"))
        old_req = a.request("c", prefiller("kv1", b))
        old_load, _ = a.load(old_req, KEYS)
        cluster.run()
        old_session = a.session(b)
        b2 = cluster.restart(b)
        a.step()
        assert a.outcome(old_load) is False
        a.finish(old_req)
        b2.store(b2.request("p", decoder("kv1")), KEYS)
        req = a.request("c-new", prefiller("kv1", b2))
        load, slots = a.load(req, KEYS)
        cluster.run()
        assert a.session(b2) is not old_session
        assert a.outcome(load) is True
        assert bytes_match(a, b2, slots, KEYS)

    def test_restarted_peer_connects_first(self, cluster: Cluster) -> None:
        a, b = cluster.add("a", 1), cluster.add("b", 2)
        b.request("p", decoder("kv1"))
        old_load, _ = a.load(a.request("c", prefiller("kv1", b)), KEYS)
        cluster.run()
        b2 = cluster.restart(b)
        a.parent.put(key(5))
        req = b2.request("c2", kv_source("kv2", a))  # its connect reaches a first
        assert b2.sent_of(Connect, to=a) != []
        b2.lookup(req, key(5))
        cluster.run()
        assert a.outcome(old_load) is False
        assert b2.lookup(req, key(5)) == [HIT]
        load, slots = b2.load(req, (key(5),))
        cluster.run()
        assert b2.outcome(load) is True
        assert bytes_match(b2, a, slots, (key(5),))
        assert a.stats().sessions == 1


class TestBidirectional:
    """Two nodes pull from each other at once over one session each way."""

    def test_symmetric_both_ways(self, cluster: Cluster) -> None:
        a, b = cluster.add("a", 1), cluster.add("b", 2)
        a_keys, b_keys = keys(1, 2), keys(11, 12)
        for k in a_keys:
            a.parent.put(k)
        for k in b_keys:
            b.parent.put(k)
        from_b = a.request("ra", kv_source("ab", b))
        from_a = b.request("rb", kv_source("ba", a))
        a.lookup(from_b, *b_keys)
        b.lookup(from_a, *a_keys)
        cluster.run()
        assert a.lookup(from_b, *b_keys) == [HIT] * 2
        assert b.lookup(from_a, *a_keys) == [HIT] * 2
        load_a, slots_a = a.load(from_b, b_keys)
        load_b, slots_b = b.load(from_a, a_keys)
        cluster.run()
        assert (a.outcome(load_a), b.outcome(load_b)) == (True, True)
        assert bytes_match(a, b, slots_a, b_keys)
        assert bytes_match(b, a, slots_b, a_keys)
        assert (a.stats().sessions, b.stats().sessions) == (1, 1)

    def test_producer_and_consumer_on_one_request(self, cluster: Cluster) -> None:
        """A prefill node pulls a cached prefix from its decoder and serves it the result."""
        a, b = cluster.add("a", 1), cluster.add("b", 2)
        a.parent.put(key(1))
        prefill = b.request("p", {**decoder("kv-pd"), **kv_source("kv-prefix", a)})
        decode = a.request("d", prefiller("kv-pd", b))
        b.lookup(prefill, key(1))
        decode_load, decode_slots = a.load(decode, KEYS)
        cluster.run()
        assert b.lookup(prefill, key(1)) == [HIT]
        prefix_load, prefix_slots = b.load(prefill, (key(1),))
        cluster.run()
        assert b.outcome(prefix_load) is True
        assert bytes_match(b, a, prefix_slots, (key(1),))
        b.store(prefill, KEYS)
        cluster.run()
        assert a.outcome(decode_load) is True
        assert bytes_match(a, b, decode_slots, KEYS)
        a.finish(decode)
        b.finish(prefill)
        cluster.run()
        for node in (a, b):
            assert node.unreported() == set()
            assert node.stats().requests == 0
            assert node.parent.pins == {}
