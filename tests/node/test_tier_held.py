"""Tier, held blocks: a peer served from kvpeer's own copy, without the serve window.

Pins ``kvpeer.node.held`` invariants 1-5 and producer invariant 9 over a cluster:
a lookup whose keys are all held is answered on arrival (the producer never steps),
the fetch that follows is written from the copy, so the engine reusing the primary
slot after its store job was reported never reaches the peer; the copy is bounded
by ``held_bytes`` and releases the least recently used block first; pins a peer
holds expire; nothing is held after shutdown; ``held_bytes`` 0 is the old path.
"""

from __future__ import annotations

import pytest

from kvpeer.metrics import ThreadCpu, values
from kvpeer.metrics.reading import read_tier
from kvpeer.node.held import HeldBlocks
from kvpeer.protocol import LookupResponse
from kvpeer.testing.cluster import BLOCK_LEN, Cluster, TierNode, keys, kv_source
from kvpeer.types import LookupResult, RequestContext

KEYS = keys(1, 2, 3)
STORE_S = 30.0  # store_timeout_s default


def peer_lookups(node: TierNode) -> dict[str, float]:
    """``node``'s ``peer_lookups_total`` as its metrics export it, by path."""
    series = values(read_tier(node.tier, ThreadCpu()))["peer_lookups_total"]
    return {path: float(value) for (path,), value in series.items()}  # type: ignore[arg-type]


def cluster_with(held_blocks: int) -> tuple[Cluster, TierNode, TierNode]:
    """Consumer ``a`` and producer ``b`` holding up to ``held_blocks`` copies."""
    cluster = Cluster()
    a = cluster.add("a", 1)
    b = cluster.add("b", 2, {"held_bytes": held_blocks * BLOCK_LEN})
    return cluster, a, b


def produce(b: TierNode, wanted: tuple[bytes, ...]) -> dict[bytes, int]:
    """``b`` computes ``wanted`` for a local request and stores them (the store job is
    reported at once: nobody pulls a local request's blocks). Returns key -> slot."""
    ctx = b.request(f"local-{wanted[0]!r}")
    job = b.store(ctx, wanted)
    b.step()
    assert b.outcome(job) is True
    b.finish(ctx)
    return {k: b.parent.slots[k] for k in wanted}


def poll(*nodes: TierNode, times: int = 4) -> None:
    """Driver polls only: no node reaches a serve window."""
    for _ in range(times):
        for node in nodes:
            node.tier.poll()


def probe(a: TierNode, b: TierNode, req_id: str = "c", kv_id: str = "kv1") -> RequestContext:
    """``a`` opens a request pulling from ``b`` and sends its lookup of KEYS; ``b``
    receives it (driver polls only). Returns the request."""
    ctx = a.request(req_id, kv_source(kv_id, b))
    a.step()
    poll(a, b)
    a.lookup(ctx, *KEYS)
    a.step()
    poll(a, b)
    return ctx


def load_originals(a: TierNode, b: TierNode, ctx: RequestContext) -> None:
    """``a``'s probes of KEYS were answered: all hit, and the load brings ``b``'s
    original blocks (driver polls only on ``b``)."""
    a.step()
    assert a.lookup(ctx, *KEYS) == [LookupResult.HIT] * 3
    job_id, dest = a.load(ctx, KEYS)
    poll(a, b)
    a.step()
    assert a.outcome(job_id) is True
    assert [a.block(s) for s in dest] == [b.parent.expected(k) for k in KEYS]


def pull_without_producer_steps(a: TierNode, b: TierNode, wanted: tuple[bytes, ...]) -> int:
    """``a`` probes ``b`` for ``wanted`` and loads the hits while ``b`` never calls
    ``serve_external_requests``. Returns the load's job id (reported or not)."""
    ctx = a.request("c", kv_source("kv1", b))
    poll(a, b)
    a.step()  # session up
    poll(a, b)
    assert a.lookup(ctx, *wanted) == [LookupResult.RETRY] * len(wanted)
    a.step()  # the probes go out as one lookup
    poll(a, b)
    a.step()
    answers = a.lookup(ctx, *wanted)
    if answers != [LookupResult.HIT] * len(wanted):
        return -1
    job_id, _ = a.load(ctx, wanted)
    poll(a, b)
    a.step()
    return job_id


class TestServedWithoutTheEngine:
    def test_lookup_and_fetch_need_no_serve_window(self) -> None:
        _, a, b = cluster_with(8)
        produce(b, KEYS)
        asked = b.parent.lookups
        job_id = pull_without_producer_steps(a, b, KEYS)
        assert a.outcome(job_id) is True
        answers = b.sent_of(LookupResponse, a)
        assert [r.hits for r in answers] == [(True, True, True)]
        assert b.parent.lookups == asked  # the parent was never asked
        assert b.parent.requests_seen == 0
        session = b.session(a).statistics()
        assert session.producer.lookups_held == 1
        assert peer_lookups(b) == {"held": 1.0, "engine": 0.0}

    def test_bytes_are_the_copy_even_after_the_engine_reused_the_slot(self) -> None:
        _, a, b = cluster_with(8)
        where = produce(b, KEYS)
        for slot in where.values():  # store jobs reported: the engine may reuse them
            b.region.write(slot, b"\xee" * BLOCK_LEN)
        ctx = probe(a, b)
        load_originals(a, b, ctx)

    def test_a_lookup_not_all_held_waits_for_the_serve_window(self) -> None:
        _, a, b = cluster_with(8)
        produce(b, KEYS)
        b.parent.put(keys(9)[0])  # in the engine's primary, never stored to the tier
        wanted = (*KEYS, *keys(9))
        assert pull_without_producer_steps(a, b, wanted) == -1
        assert b.sent_of(LookupResponse, a) == []
        assert b.tier.needs_serve()
        b.step()  # the serve window answers it, as before
        poll(a, b)
        assert [r.hits for r in b.sent_of(LookupResponse, a)] == [(True,) * 4]
        assert b.session(a).statistics().producer.lookups_held == 0
        assert peer_lookups(b) == {"held": 0.0, "engine": 1.0}

    def test_held_bytes_zero_is_the_serve_window_path(self) -> None:
        cluster = Cluster()
        a = cluster.add("a", 1)
        b = cluster.add("b", 2)
        produce(b, KEYS)
        assert pull_without_producer_steps(a, b, KEYS) == -1
        assert b.stats().held_blocks == 0
        b.step()
        poll(a, b)
        assert [r.hits for r in b.sent_of(LookupResponse, a)] == [(True,) * 3]


def resolve_request(a: TierNode, b: TierNode) -> RequestContext:
    """``a`` opens a request the router told holds KEYS at ``b`` (``held_tokens``: no
    lookup, a resolve fetch), its session up (driver polls only on ``b``)."""
    table = {k: (i + 1) * 32 for i, k in enumerate(KEYS)}
    params = {"remote_kv_source": {**kv_source("kv1", b)["remote_kv_source"],  # type: ignore[dict-item]
                                   "held_tokens": 96}}  # fmt: skip
    ctx = RequestContext("c", params, key_position=table.get)
    a.tier.on_new_request(ctx)
    poll(a, b)
    a.step()
    poll(a, b)
    return ctx


class TestResolveFetch:
    """The router's ``held_tokens``: the consumer skips the lookup and fetches with
    ``resolve``; a producer holding every demanded key serves it without a window."""

    def test_a_resolve_fetch_of_held_keys_needs_no_serve_window(self) -> None:
        _, a, b = cluster_with(8)
        where = produce(b, KEYS)
        for slot in where.values():
            b.region.write(slot, b"\xee" * BLOCK_LEN)  # the engine reused them
        ctx = resolve_request(a, b)
        load_originals(a, b, ctx)
        assert b.parent.requests_seen == 0  # no serve window, no parent
        assert b.sent_of(LookupResponse, a) == []
        assert peer_lookups(b) == {"held": 1.0, "engine": 0.0}  # the router reads it

    def test_a_resolve_fetch_not_all_held_counts_as_the_engines(self) -> None:
        _, a, b = cluster_with(8)
        produce(b, KEYS[:2])
        b.parent.put(KEYS[2])  # in the engine's primary, never stored to the tier
        ctx = resolve_request(a, b)
        a.step()
        assert a.lookup(ctx, *KEYS) == [LookupResult.HIT] * 3  # as the router said
        a.load(ctx, KEYS)
        poll(a, b)
        assert peer_lookups(b) == {"held": 0.0, "engine": 1.0}


class TestPeerLookupsMetric:
    def test_counts_survive_the_session_that_counted_them(self) -> None:
        cluster, a, b = cluster_with(8)
        produce(b, KEYS)
        job_id = pull_without_producer_steps(a, b, KEYS)
        assert a.outcome(job_id) is True
        cluster.kill(a)
        cluster.advance(120.0)
        cluster.run()
        assert b.stats().sessions == 0
        assert peer_lookups(b) == {"held": 1.0, "engine": 0.0}


class TestBound:
    def test_never_more_than_held_bytes_least_recent_released_first(self) -> None:
        _, _, b = cluster_with(4)
        first = keys(1, 2)
        produce(b, first)
        produce(b, keys(3, 4))
        produce(b, keys(5, 6))
        stats = b.stats()
        assert (stats.held_blocks, stats.held_bytes) == (4, 4 * BLOCK_LEN)
        held = b.tier.held()
        assert held is not None
        assert [held.holds(k) for k in keys(1, 2, 3, 4, 5, 6)] == [False] * 2 + [True] * 4
        assert held.statistics().released == 2

    def test_a_block_used_again_is_released_last(self) -> None:
        _, _, b = cluster_with(3)
        produce(b, keys(1, 2, 3))
        produce(b, keys(3))  # stored again: the most recent now
        produce(b, keys(4))
        held = b.tier.held()
        assert held is not None
        assert [held.holds(k) for k in keys(1, 2, 3, 4)] == [True, False, True, True]

    def test_a_prompt_loses_its_tail_before_its_head(self) -> None:
        _, _, b = cluster_with(4)
        produce(b, keys(1, 2, 3))  # one prompt's blocks, in order
        produce(b, keys(4, 5))
        held = b.tier.held()
        assert held is not None
        assert [held.holds(k) for k in keys(1, 2, 3, 4, 5)] == [True, True, False, True, True]
        assert held.held_prefix("b", keys(1, 2, 3)) == 2  # still a prefix a peer can pull

    def test_a_prompt_served_to_a_peer_keeps_its_head_longest(self) -> None:
        _, a, b = cluster_with(4)
        produce(b, KEYS)
        produce(b, keys(7))
        ctx = probe(a, b)  # answered from held: KEYS are the most recent, the head most
        load_originals(a, b, ctx)
        produce(b, keys(8, 9))
        held = b.tier.held()
        assert held is not None
        kept = [held.holds(k) for k in (*KEYS, *keys(7, 8, 9))]
        assert kept == [True, True, False, False, True, True]

    def test_pinned_rows_are_not_released_and_keep_their_bytes(self) -> None:
        _, a, b = cluster_with(3)
        produce(b, KEYS)
        ctx = probe(a, b)  # answered from held: the three rows are pinned as supply
        produce(b, keys(7, 8))  # no row may be taken
        held = b.tier.held()
        assert held is not None
        assert held.statistics().skipped == 2
        assert all(held.holds(k) for k in KEYS)
        load_originals(a, b, ctx)
        assert held.statistics().pinned_blocks == 0  # the write finished: unpinned


class TestHostilePeer:
    def test_pins_of_a_peer_that_never_fetches_expire(self) -> None:
        cluster, a, b = cluster_with(3)
        produce(b, KEYS)
        contexts = []
        for n in range(5):  # five ids, each looked up, never fetched
            contexts.append(probe(a, b, f"c{n}", f"kv{n}"))
        held = b.tier.held()
        assert held is not None
        stats = held.statistics()
        assert stats.pinned_blocks == 3
        assert stats.bytes <= 3 * BLOCK_LEN
        produce(b, keys(8))
        assert not held.holds(keys(8)[0])  # every row pinned: not kept
        cluster.clock.advance(STORE_S + 1)
        poll(a, b)
        assert held.statistics().pinned_blocks == 0
        produce(b, keys(8))
        assert held.holds(keys(8)[0])
        assert b.stats().held_bytes <= 3 * BLOCK_LEN


class TestShutdown:
    def test_nothing_is_held_after_shutdown(self) -> None:
        _, a, b = cluster_with(8)
        produce(b, KEYS)
        probe(a, b)
        before = b.tier.held()
        assert before is not None
        assert before.statistics().pinned_blocks == 3  # pinned for a
        b.tier.shutdown()
        stats = b.stats()
        assert (stats.held_blocks, stats.held_bytes) == (0, 0)
        held = b.tier.held()
        assert held is not None
        assert held.pin(a.peer_id, KEYS) is None
        job = b.store(b.request("late"), keys(5))  # a store after shutdown keeps nothing
        b.step()
        assert b.outcome(job) is True
        assert not held.holds(keys(5)[0])


@pytest.mark.parametrize("held_blocks", [1, 2])
def test_held_bytes_below_a_lookup_still_serves_through_the_window(held_blocks: int) -> None:
    _, a, b = cluster_with(held_blocks)
    produce(b, KEYS)
    assert pull_without_producer_steps(a, b, KEYS) == -1
    b.step()
    poll(a, b)
    assert [r.hits for r in b.sent_of(LookupResponse, a)] == [(True,) * 3]


class TestHeldBlocks:
    """The store itself: pins are counted per row and owed once each."""

    def held(self, rows: int = 2) -> tuple[HeldBlocks, bytearray]:
        primary = bytearray(b"".join(bytes([n]) * BLOCK_LEN for n in range(4)))
        return HeldBlocks(memoryview(primary), 4, BLOCK_LEN, rows * BLOCK_LEN,
                          serves=lambda peer: peer == "ok"), primary  # fmt: skip

    def test_slots_follow_the_primary_and_read_the_copy(self) -> None:
        held, primary = self.held()
        held.keep(keys(1, 2), (2, 3))
        primary[2 * BLOCK_LEN : 4 * BLOCK_LEN] = bytes(2 * BLOCK_LEN)  # reused
        slots = held.pin("ok", keys(2, 1))
        assert slots is not None
        assert all(s >= held.first_slot for s in slots)
        rows = [s - held.first_slot for s in slots]
        assert [bytes(held.view[r * BLOCK_LEN : (r + 1) * BLOCK_LEN]) for r in rows] == [
            bytes([3]) * BLOCK_LEN,
            bytes([2]) * BLOCK_LEN,
        ]

    def test_a_peer_whose_plane_cannot_read_held_rows_gets_nothing(self) -> None:
        held, _ = self.held()
        held.keep(keys(1), (0,))
        assert held.pin("other", keys(1)) is None
        assert held.statistics().pinned_blocks == 0

    def test_all_or_nothing(self) -> None:
        held, _ = self.held()
        held.keep(keys(1), (0,))
        assert held.pin("ok", keys(1, 2)) is None
        assert held.statistics().pinned_blocks == 0

    def test_the_held_prefix_counts_from_the_first_key_and_pins_nothing(self) -> None:
        held, _ = self.held(rows=3)
        held.keep(keys(1, 2, 4), (0, 1, 2))
        assert held.held_prefix("ok", keys(1, 2, 3, 4)) == 2
        assert held.held_prefix("ok", keys(3, 1)) == 0
        assert held.held_prefix("ok", ()) == 0
        assert held.held_prefix("other", keys(1, 2)) == 0  # its plane cannot read held rows
        assert held.statistics().pinned_blocks == 0
        held.close()
        assert held.held_prefix("ok", keys(1)) == 0

    def test_a_row_pinned_twice_needs_two_unpins(self) -> None:
        held, _ = self.held(rows=1)
        held.keep(keys(1), (0,))
        first = held.pin("ok", keys(1))
        second = held.pin("ok", keys(1))
        assert first is not None
        assert second is not None
        held.unpin(first)
        held.keep(keys(2), (1,))
        assert held.holds(keys(1)[0])
        assert not held.holds(keys(2)[0])
        held.unpin(second)
        with pytest.raises(ValueError, match="not pinned"):
            held.unpin(second)
        held.keep(keys(2), (1,))
        assert held.holds(keys(2)[0])
        assert not held.holds(keys(1)[0])

    def test_slots_outside_the_primary_are_never_copied(self) -> None:
        held, _ = self.held()
        held.keep(keys(1, 2), (4, -1))
        assert held.statistics().blocks == 0

    def test_close_releases_everything(self) -> None:
        held, _ = self.held()
        held.keep(keys(1), (0,))
        slots = held.pin("ok", keys(1))
        assert slots is not None
        held.close()
        held.unpin(slots)  # closed: every pin went with it
        held.keep(keys(2), (1,))
        assert held.statistics().blocks == 0
        assert held.pin("ok", keys(2)) is None
