"""Tier, producer side: offload policy, parking and binding, late fetches, bounded state.

Pins ``kvpeer.node.bindings`` invariants 1-5 over a cluster (docs/design.md §5.1,
§5.4-§5.6; ``test_bindings.py`` drives the module directly): stores for
a ``remote_decoder`` id are parked until a fetch for it arrives, in either
order; parked stores nobody fetched fail and tombstone the id, so a late
fetch is rejected in one round trip and a late store fails at once;
tombstones and early fetches expire and no collection grows with requests.
"""

from __future__ import annotations

import pytest

from kvpeer.protocol import AbortFetch, Fetch, TransferDone
from kvpeer.testing.cluster import Cluster, TierNode, decoder, keys, kv_source, prefiller
from kvpeer.types import LookupResult, OffloadPolicy

KEYS = keys(1, 2, 3)
UNBOUND_S = 60.0  # unbound_store_timeout_s default
LOAD_S = 30.0  # load_timeout_s default
ABORT_ACK_S = 12.0  # abort_ack_timeout_s default
RETENTION_S = 2 * LOAD_S  # tombstone_retention_s default


@pytest.fixture
def cluster() -> Cluster:
    return Cluster()


@pytest.fixture
def a(cluster: Cluster) -> TierNode:
    """The decoder (consumer)."""
    return cluster.add("a", 1)


@pytest.fixture
def b(cluster: Cluster) -> TierNode:
    """The prefiller (producer)."""
    return cluster.add("b", 2)


def delivered(a: TierNode, b: TierNode, slots: tuple[int, ...], wanted: tuple[bytes, ...]) -> bool:
    """The consumer's slots hold exactly the producer's blocks."""
    return [a.block(s) for s in slots] == [b.parent.expected(k) for k in wanted]


class TestPolicy:
    """REQUEST_LEVEL exactly for a producer leg with an id (docs/design.md §5.5)."""

    def test_producer_leg_with_an_id(self, b: TierNode) -> None:
        assert b.start("p", decoder("kv1"))[1] is OffloadPolicy.REQUEST_LEVEL

    def test_producer_leg_that_also_pulls(self, a: TierNode, b: TierNode) -> None:
        params = {**decoder("kv1"), **kv_source("kv0", a)}
        assert b.start("p", params)[1] is OffloadPolicy.REQUEST_LEVEL

    @pytest.mark.parametrize(
        "params",
        [None, {}, {"remote_decoder": {}}, {"remote_decoder": {"kv_request_id": None}}],
        ids=["none", "empty", "decoder-without-id", "decoder-null-id"],
    )
    def test_everything_else_is_chunk_level(
        self, b: TierNode, params: dict[str, object] | None
    ) -> None:
        assert b.start("p", params)[1] is OffloadPolicy.CHUNK_LEVEL

    def test_consumer_leg_is_chunk_level(self, a: TierNode, b: TierNode) -> None:
        assert a.start("c", prefiller("kv1", b))[1] is OffloadPolicy.CHUNK_LEVEL

    def test_decoder_without_id_store_succeeds_locally(self, b: TierNode) -> None:
        req = b.request("p", {"remote_decoder": {}})
        job = b.store(req, KEYS)
        b.step()
        assert b.outcome(job) is True
        assert b.stats().parked_ids == 0


class TestParking:
    """Stores and the fetch for one id meet in either order, byte-exact."""

    def test_stores_before_fetch(self, cluster: Cluster, a: TierNode, b: TierNode) -> None:
        producer = b.request("p", decoder("kv1"))
        first, second = b.store(producer, keys(1, 2)), b.store(producer, keys(3))
        stats = b.stats()
        assert (stats.parked_ids, stats.parked_batches, stats.bound_ids) == (1, 2, 0)
        cluster.run()
        assert b.outcome(first) is None  # still parked: nobody fetched yet
        req = a.request("c", prefiller("kv1", b))
        job, slots = a.load(req, KEYS)
        cluster.run()
        assert a.outcome(job) is True
        assert delivered(a, b, slots, KEYS)
        assert (b.outcome(first), b.outcome(second)) == (True, True)
        assert b.stats().parked_ids == 0
        assert b.stats().bound_ids == 1
        assert b.parent.pins == {}
        assert a.plane.violations == []

    def test_fetch_before_the_producer_request(
        self, cluster: Cluster, a: TierNode, b: TierNode
    ) -> None:
        req = a.request("c", prefiller("kv1", b))
        job, slots = a.load(req, KEYS)
        cluster.run()
        assert b.stats().early_fetches == 1
        producer = b.request("p", decoder("kv1"))
        assert b.stats().early_fetches == 0
        assert b.stats().bound_ids == 1
        store = b.store(producer, KEYS)
        assert b.stats().parked_ids == 0
        cluster.run()
        assert (a.outcome(job), b.outcome(store)) == (True, True)
        assert delivered(a, b, slots, KEYS)

    def test_fetch_after_request_before_stores(
        self, cluster: Cluster, a: TierNode, b: TierNode
    ) -> None:
        producer = b.request("p", decoder("kv1"))
        req = a.request("c", prefiller("kv1", b))
        job, slots = a.load(req, KEYS)
        cluster.run()
        assert b.stats().bound_ids == 1
        b.store(producer, keys(1, 2))
        cluster.run()
        assert a.outcome(job) is None  # key 3 not stored yet: the round waits
        b.store(producer, keys(3))
        cluster.run()
        assert a.outcome(job) is True
        assert delivered(a, b, slots, KEYS)

    def test_producer_finished_before_fetch(
        self, cluster: Cluster, a: TierNode, b: TierNode
    ) -> None:
        producer = b.request("p", decoder("kv1"))
        store = b.store(producer, KEYS)
        b.finish(producer)
        cluster.run()
        req = a.request("c", prefiller("kv1", b))
        job, slots = a.load(req, KEYS)
        cluster.run()
        assert (a.outcome(job), b.outcome(store)) == (True, True)
        assert delivered(a, b, slots, KEYS)
        assert b.stats().producer_ids == 0

    def test_several_fetch_rounds_of_one_id(
        self, cluster: Cluster, a: TierNode, b: TierNode
    ) -> None:
        producer = b.request("p", decoder("kv1"))
        b.store(producer, KEYS)
        req = a.request("c", prefiller("kv1", b))
        first, first_slots = a.load(req, keys(1, 2))
        cluster.run()
        second, second_slots = a.load(req, keys(3))
        cluster.run()
        assert (a.outcome(first), a.outcome(second)) == (True, True)
        assert delivered(a, b, first_slots + second_slots, KEYS)

    def test_short_supply_fails_when_the_producer_finishes(
        self, cluster: Cluster, a: TierNode, b: TierNode
    ) -> None:
        producer = b.request("p", decoder("kv1"))
        b.store(producer, keys(1, 2))
        req = a.request("c", prefiller("kv1", b))
        job, _ = a.load(req, KEYS)
        cluster.run()
        assert a.outcome(job) is None
        b.finish(producer)
        cluster.run()
        assert a.outcome(job) is False  # promptly: no clock advance
        assert a.sent_of(AbortFetch) == []


def tombstone(cluster: Cluster, b: TierNode, kv_id: str = "kv1") -> tuple[int, int]:
    """Park a store for ``kv_id`` and let it expire; returns (store job, tombstones)."""
    producer = b.request(f"p-{kv_id}", decoder(kv_id))
    store = b.store(producer, KEYS)
    cluster.advance(UNBOUND_S)  # the reap is due at the end: the next step does it
    cluster.step()
    return store, b.stats().tombstones


class TestLateFetch:
    """Parked stores with no fetch fail; the id is tombstoned, then forgotten."""

    def test_parked_stores_fail_after_the_unbound_timeout(
        self, cluster: Cluster, b: TierNode
    ) -> None:
        producer = b.request("p", decoder("kv1"))
        first = b.store(producer, keys(1))
        cluster.advance(UNBOUND_S / 2)
        second = b.store(producer, keys(2))
        cluster.advance(UNBOUND_S / 2 - 1)
        cluster.step()
        assert b.unreported() == {first, second}
        cluster.advance(1)
        cluster.step()
        assert (b.outcome(first), b.outcome(second)) == (False, False)
        stats = b.stats()
        assert (stats.parked_ids, stats.parked_batches, stats.tombstones) == (0, 0, 1)
        assert b.parent.pins == {}

    def test_fetch_for_a_tombstoned_id_is_rejected_at_once(
        self, cluster: Cluster, a: TierNode, b: TierNode
    ) -> None:
        tombstone(cluster, b)
        req = a.request("c", prefiller("kv1", b))
        job, _ = a.load(req, KEYS)
        cluster.run()
        assert a.outcome(job) is False  # the clock did not move: one round trip
        done = b.sent_of(TransferDone, to=a)
        assert [d.success for d in done] == [False]
        assert a.sent_of(AbortFetch) == []
        consumer = a.session(b).statistics().consumer
        assert (consumer.loads_in_flight, consumer.loads_aborting) == (0, 0)
        cluster.advance(LOAD_S + ABORT_ACK_S + 1)
        cluster.step(2)
        assert a.sent_of(AbortFetch) == []
        assert a.lookup(req, *KEYS) == [LookupResult.MISS] * 3

    def test_rejection_happens_in_the_tick_that_received_the_fetch(
        self, cluster: Cluster, a: TierNode, b: TierNode
    ) -> None:
        tombstone(cluster, b)
        req = a.request("c", prefiller("kv1", b))
        cluster.run()  # handshake done
        a.load(req, KEYS)
        assert len(a.sent_of(Fetch, to=b)) == 1
        b.tier.get_finished_jobs()  # b's one tick: receives the fetch
        assert [d.success for d in b.sent_of(TransferDone, to=a)] == [False]

    def test_store_for_a_tombstoned_id_fails_at_once(self, cluster: Cluster, b: TierNode) -> None:
        tombstone(cluster, b)
        late = b.store(b.request("p-late", decoder("kv1")), keys(4))
        assert b.stats().parked_ids == 0
        b.step()
        assert b.outcome(late) is False
        assert b.parent.pins == {}

    def test_tombstones_expire(self, cluster: Cluster, b: TierNode) -> None:
        _, tombstones = tombstone(cluster, b)
        assert tombstones == 1
        cluster.advance(RETENTION_S - 1)
        cluster.step()
        assert b.stats().tombstones == 1
        cluster.advance(1)
        cluster.step()
        assert b.stats().tombstones == 0
        b.store(b.request("p-again", decoder("kv1")), keys(4))
        assert b.stats().parked_ids == 1  # a store parks again

    def test_configured_timeouts_are_honoured(self, cluster: Cluster) -> None:
        b = cluster.add("b", 2, {"unbound_store_timeout_s": 5, "tombstone_retention_s": "45"})
        store = b.store(b.request("p", decoder("kv1")), KEYS)
        cluster.advance(4.5)
        cluster.step()
        assert b.outcome(store) is None
        cluster.advance(0.5)
        cluster.step()
        assert b.outcome(store) is False
        cluster.advance(44.5)
        cluster.step()
        assert b.stats().tombstones == 1
        cluster.advance(0.5)
        cluster.step()
        assert b.stats().tombstones == 0

    def test_fetch_after_tombstone_expired_waits_for_stores(
        self, cluster: Cluster, a: TierNode, b: TierNode
    ) -> None:
        tombstone(cluster, b)
        cluster.advance(RETENTION_S)
        cluster.step()
        req = a.request("c", prefiller("kv1", b))
        job, slots = a.load(req, KEYS)
        cluster.run()
        assert a.outcome(job) is None
        b.store(b.request("p-again", decoder("kv1")), KEYS)
        cluster.run()
        assert a.outcome(job) is True
        assert delivered(a, b, slots, KEYS)

    def test_early_fetches_expire(self, cluster: Cluster, a: TierNode, b: TierNode) -> None:
        req = a.request("c", prefiller("kv-nobody", b))
        job, _ = a.load(req, KEYS)
        cluster.run()
        assert b.stats().early_fetches == 1
        cluster.advance(LOAD_S)
        cluster.run()  # the consumer gives up: abort_fetch, abort_ack
        assert a.outcome(job) is False
        assert len(a.sent_of(AbortFetch, to=b)) == 1
        cluster.advance(ABORT_ACK_S)
        cluster.step()
        assert b.stats().early_fetches == 0


class TestBoundedState:
    """Nothing the tier keeps grows with the number of requests it served."""

    def test_300_pd_requests_leave_nothing_behind(self, cluster: Cluster) -> None:
        a, b = cluster.add("a", 1), cluster.add("b", 2)
        wanted = keys(1, 2)
        for batch in range(30):
            pairs = []
            late = []
            for i in range(10):
                n = batch * 10 + i
                kv_id = f"kv{n}"
                consumer = a.request(f"c{n}", prefiller(kv_id, b))
                producer = b.request(f"p{n}", decoder(kv_id))
                if n % 3 == 0:
                    b.store(producer, wanted)
                load, slots = a.load(consumer, wanted)
                if n % 3 == 1:
                    b.store(producer, wanted)
                if n % 3 == 2:
                    late.append(producer)  # the fetch arrives first
                pairs.append((consumer, producer, load, slots))
            cluster.run(3)
            for producer in late:
                b.store(producer, wanted)
            cluster.run(4)
            for consumer, producer, load, slots in pairs:
                assert a.outcome(load) is True, producer.req_id
                assert delivered(a, b, slots, wanted)
                a.finish(consumer)
                b.finish(producer)
            cluster.run(2)
        # Ids that end as tombstones (no decoder came) and early fetches (no
        # prefiller came); both requests finish, then everything expires.
        lonely = []
        for n in range(5):
            producer = b.request(f"lonely-p{n}", decoder(f"lonely{n}"))
            b.store(producer, wanted)
            consumer = a.request(f"lonely-c{n}", prefiller(f"orphan{n}", b))
            a.load(consumer, wanted)
            lonely.append((consumer, producer))
        cluster.run()
        cluster.advance(UNBOUND_S + 1)
        cluster.run()
        for consumer, producer in lonely:
            a.finish(consumer)
            b.finish(producer)
        assert b.stats().tombstones == 5
        cluster.advance(RETENTION_S)
        cluster.run()
        for node in (a, b):
            assert node.unreported() == set()
            stats = node.stats()
            counts = (
                stats.requests,
                stats.consumer_ids,
                stats.producer_ids,
                stats.failed_ids,
                stats.bound_ids,
                stats.parked_ids,
                stats.parked_batches,
                stats.tombstones,
                stats.early_fetches,
                stats.loads_in_flight,
                stats.transfers_in_flight,
                stats.pinned_blocks,
                stats.results_pending,
            )
            assert counts == (0,) * 13, stats
            session = node.session(b if node is a else a).statistics()
            assert (session.consumer.requests, session.producer.requests) == (0, 0)
            assert node.parent.pins == {}
            assert node.parent.open_requests == {}


def prefilled(kv_id: str, peer: TierNode) -> dict[str, object]:
    """A PD consumer leg sent after the producer's prefill leg answered (the router's)."""
    return {"remote_prefiller": {**peer.source(kv_id), "prefill_done": True}}


class TestPrefillDone:
    """A fetch that says its prefill leg answered fails at once where no producer
    request for the id ever ran (a restarted producer); others are unchanged."""

    def test_a_restarted_producer_fails_the_pull_in_one_round_trip(
        self, cluster: Cluster, a: TierNode, b: TierNode
    ) -> None:
        producer = b.request("p", decoder("kv1"))
        b.store(producer, KEYS)
        cluster.run()
        fresh = cluster.restart(b)
        req = a.request("c", prefilled("kv1", fresh))
        job, _ = a.load(req, KEYS)
        cluster.run()
        assert a.outcome(job) is False  # the clock did not move
        assert [d.success for d in fresh.sent_of(TransferDone, to=a)] == [False]
        assert [f.prefill_done for f in a.sent_of(Fetch)] == [True]
        assert fresh.stats().early_fetches == 0
        assert fresh.tier.counters().late_fetches_rejected == 1
        assert a.sent_of(AbortFetch) == []

    def test_without_the_hint_the_fetch_still_waits_as_an_early_fetch(
        self, cluster: Cluster, a: TierNode, b: TierNode
    ) -> None:
        fresh = cluster.restart(b)
        req = a.request("c", prefiller("kv1", fresh))
        job, _ = a.load(req, KEYS)
        cluster.run()
        assert a.outcome(job) is None  # a vLLM orchestrator's decoder-first fetch
        assert fresh.stats().early_fetches == 1
        assert [f.prefill_done for f in a.sent_of(Fetch)] == [False]

    @pytest.mark.parametrize("stores_first", [True, False])
    def test_a_producer_that_ran_the_prefill_serves_the_hinted_fetch(
        self, cluster: Cluster, a: TierNode, b: TierNode, stores_first: bool
    ) -> None:
        producer = b.request("p", decoder("kv1"))
        if stores_first:
            b.store(producer, KEYS)
        req = a.request("c", prefilled("kv1", b))
        job, slots = a.load(req, KEYS)
        cluster.run()
        if not stores_first:  # the fetch came before the stores: it binds and waits
            assert a.outcome(job) is None
            b.store(producer, KEYS)
            cluster.run()
        assert a.outcome(job) is True
        assert delivered(a, b, slots, KEYS)
