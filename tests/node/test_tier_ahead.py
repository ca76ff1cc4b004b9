"""Tier, pulling ahead: a router's prefetch staged before the engine looks the prompt up.

Pins ``kvpeer.node.ahead`` invariants 1-6 over a cluster: a prefetch fetches into
staging rows at once; the engine's lookup of a staged key answers HIT without asking
any peer and its load is a copy reported in the same call, bytes equal to the
producer's; a load that arrives while the fetch runs waits for it; every refusal is
named and stages nothing; staging is bounded (oldest staged evicted first), expires,
and every row comes back whatever happens (fetch fails, source dies, shutdown).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpeer.node.ahead import row_copier
from kvpeer.protocol import Codec, Prefetch, PrefetchRefused
from kvpeer.testing.cluster import (
    BLOCK_LEN,
    NUM_BLOCKS,
    Cluster,
    TierNode,
    keys,
    kv_source,
    prefiller,
)
from kvpeer.transport.base import InboundFrame
from kvpeer.transport.data.base import PrimaryRegion
from kvpeer.types import Key, LookupResult, TransferJob

CODEC = Codec()
KEYS = keys(1, 2, 3)
TOKENS = (1, 2, 3)  # keys_of below: one token per block, token n -> key(n)
ROWS = [40, 41, 42, 43]  # staging rows of ``a`` (its loads use the top half: 63 down)
ROUTER = "10.0.0.9:7000"
TTL_S = 10.0


def keys_of(tokens: Sequence[int], max_keys: int) -> list[Key]:
    if any(t == 666 for t in tokens):
        raise ValueError("token 666 is cursed")
    return list(keys(*tokens[:max_keys]))


def setup(
    rows: Sequence[int] = ROWS, *, allow: bool = True, held: bool = True,
    extra: dict[str, object] | None = None,
) -> tuple[Cluster, TierNode, TierNode]:
    """``a`` pulls ahead (staging ``rows``; ``extra`` tier keys), ``b`` holds blocks."""
    cluster = Cluster()
    config: dict[str, object] = {"prefetch_ttl_s": TTL_S, **(extra or {})}
    # The in-memory network cannot tell a sender's address: the default rule (loopback
    # for an open node) would obey it, so "not allowed" is prefetch_from [] here.
    config["prefetch_from"] = ["10.0.0.0/8"] if allow else []
    a = cluster.add("a", 1, config)
    b = cluster.add("b", 2, {"held_bytes": 16 * BLOCK_LEN} if held else {})
    if rows:
        region = PrimaryRegion(memoryview(a.region.memory), NUM_BLOCKS, BLOCK_LEN)
        a.tier.configure_staging(list(rows), keys_of, row_copier(region), BLOCK_LEN)
    return cluster, a, b


def produce(b: TierNode, wanted: Sequence[Key]) -> None:
    ctx = b.request(f"local-{wanted[0]!r}")
    job = b.store(ctx, wanted)
    b.step()
    assert b.outcome(job) is True
    b.finish(ctx)


def poll(*nodes: TierNode, times: int = 4) -> None:
    for _ in range(times):
        for node in nodes:
            node.tier.poll()


class Router:
    """A router on the in-memory network: sends prefetches, reads refusals."""

    def __init__(self, cluster: Cluster) -> None:
        self.control = cluster.net.attach(ROUTER)
        self.answers: list[object] = []

    def prefetch(self, to: TierNode, source: TierNode | str, tokens: Sequence[int],
                 kv_id: str = "r1") -> None:  # fmt: skip
        named = source if isinstance(source, str) else source.peer_id
        message = Prefetch(kv_request_id=kv_id, source=named, tokens=tuple(tokens))
        assert self.control.connect(to.peer_id).transmit(CODEC.encode(message))

    def refusals(self) -> list[PrefetchRefused]:
        frames: list[InboundFrame] = self.control.receive()
        self.answers.extend(CODEC.decode(f.frame) for f in frames)
        return [m for m in self.answers if isinstance(m, PrefetchRefused)]


def rows_accounted(a: TierNode) -> None:
    """Invariant 1: every staging row is free or in exactly one entry."""
    ahead = a.tier.ahead
    staged, fetching, free = ahead.statistics()
    assert staged + fetching + free == len(ahead.rows)


def ahead_counts(a: TierNode) -> dict[str, int]:
    return a.tier.counters().ahead


def engine_pull(
    a: TierNode, wanted: Sequence[Key], req: str = "c", source: TierNode | None = None
) -> tuple[int, tuple[int, ...]]:
    """``a``'s engine: a request (naming ``source`` as the router would, or none) looks
    ``wanted`` up and loads them."""
    ctx = a.request(req, kv_source(f"kv-{req}", source) if source is not None else None)
    assert a.lookup(ctx, *wanted) == [LookupResult.HIT] * len(wanted)
    assert a.tier.pull_confirmed(ctx)
    return a.load(ctx, wanted)


class TestStaged:
    def test_a_staged_prompt_is_a_copy_reported_in_the_same_call(self) -> None:
        cluster, a, b = setup()
        produce(b, KEYS)
        router = Router(cluster)
        router.prefetch(a, b, TOKENS)
        poll(a, b)  # b never reaches a serve window: it serves held blocks
        assert a.stats().staged_blocks == 3
        # the fetch into staging is a pull from b like any other (kvpeer_pulled_*)
        assert a.stats().blocks_loaded == 3
        assert a.tier.counters().loads_ok == 1
        asked = b.parent.lookups
        job_id, dest = engine_pull(a, KEYS)
        results = a.tier.take_results()  # no poll: the copy was done inside submit_load
        a.record(results)
        assert a.outcome(job_id) is True
        assert [a.block(s) for s in dest] == [b.parent.expected(k) for k in KEYS]
        assert results[0].transfer_bytes == 3 * BLOCK_LEN
        assert b.parent.lookups == asked
        assert a.stats().staged_blocks == 0
        assert a.stats().staging_free == len(ROWS)
        counts = ahead_counts(a)
        assert (counts["blocks_staged"], counts["blocks_used"], counts["jobs_served"]) == (3, 3, 1)
        assert router.refusals() == []
        rows_accounted(a)

    def test_a_fetch_from_another_peer_is_not_waited_for(self) -> None:
        """Invariant 8: a request naming c never waits for a fetch from b: those keys
        are absent for it, and it pulls from its own source the ordinary way."""
        cluster, a, b = setup()
        c = cluster.add("c", 3)
        produce(b, KEYS)
        Router(cluster).prefetch(a, b, TOKENS)
        a.tier.poll()  # being fetched from b
        ctx = a.request("x", kv_source("kv-x", c))
        assert not a.tier.ahead.holds(KEYS[0], c.peer_id)
        assert a.tier.ahead.holds(KEYS[0], b.peer_id)
        job_id, _ = a.load(ctx, KEYS)  # the ordinary way: toward c
        assert a.tier.ahead.statistics()[1] == 3  # still fetching for others
        a.record(a.tier.take_results())
        assert a.outcome(job_id) is None  # not joined, not failed by staging
        poll(a, b)
        assert a.stats().staged_blocks == 3

    def test_staged_rows_are_adopted_by_the_engine_in_exchange_for_its_own(self) -> None:
        cluster, a, b = setup()
        produce(b, KEYS)
        Router(cluster).prefetch(a, b, TOKENS)
        poll(a, b)
        ctx = a.request("c")
        assert a.lookup(ctx, *KEYS) == [LookupResult.HIT] * 3
        assert a.tier.staged_state(list(KEYS)) is True
        given = [10, 11, 12]  # rows the engine just allocated for KEYS
        activity = a.tier.activity()
        taken = a.tier.adopt_staged(list(KEYS), given, ctx)
        assert taken is not None
        # no load is counted (nothing is copied), yet a metrics reader sees it at once
        assert a.tier.activity() > activity
        assert set(taken) <= set(ROWS)
        assert [a.block(row) for row in taken] == [b.parent.expected(k) for k in KEYS]
        assert a.tier.ahead.rows == frozenset(ROWS).difference(taken).union(given)
        assert a.stats().staging_free == len(ROWS)
        assert a.tier.staged_state(list(KEYS)) is None
        assert ahead_counts(a)["jobs_adopted"] == 1
        rows_accounted(a)

    def test_nothing_is_adopted_unless_every_key_is_staged(self) -> None:
        cluster, a, b = setup()
        produce(b, KEYS)
        Router(cluster).prefetch(a, b, TOKENS[:2])
        a.tier.poll()  # being fetched
        ctx = a.request("c", kv_source("kv-c", b))
        assert a.tier.staged_state(list(KEYS[:2]), ctx) is False
        assert a.tier.staged_state(list(KEYS[:2])) is None  # no source: not waited for
        assert a.tier.adopt_staged(list(KEYS[:2]), [10, 11], ctx) is None
        poll(a, b)
        assert a.tier.adopt_staged(list(KEYS), [10, 11, 12], ctx) is None  # KEYS[2] absent
        assert a.tier.adopt_staged(list(KEYS[:2]), [10, 10], ctx) is None  # a row twice
        assert a.tier.adopt_staged(list(KEYS[:2]), [10], ctx) is None  # too few rows
        assert a.stats().staged_blocks == 2
        assert a.tier.ahead.rows == frozenset(ROWS)

    def test_a_load_submitted_while_the_fetch_runs_waits_for_it(self) -> None:
        cluster, a, b = setup()
        produce(b, KEYS)
        Router(cluster).prefetch(a, b, TOKENS)
        a.tier.poll()  # a opens the session and asks; b has not answered
        assert a.stats().staged_blocks == 0
        job_id, dest = engine_pull(a, KEYS, source=b)
        a.record(a.tier.take_results())
        assert a.outcome(job_id) is None
        poll(a, b)
        a.step()
        assert a.outcome(job_id) is True
        assert [a.block(s) for s in dest] == [b.parent.expected(k) for k in KEYS]
        rows_accounted(a)

    def test_a_job_still_waiting_at_its_give_up_fails_and_the_fetch_stages_anyway(
        self,
    ) -> None:
        """The router's ``give_up_s``: a job waiting for a prefetch that has not landed by
        then fails (its engine computes); the fetch lands later and is staged unclaimed."""
        cluster, a, b = setup()
        produce(b, KEYS)
        Router(cluster).prefetch(a, b, TOKENS)
        a.tier.poll()  # a asks; b has not answered
        ctx = a.request("c", {"remote_kv_source": {**b.source("kv-c"), "give_up_s": 0.5}})
        assert a.lookup(ctx, *KEYS) == [LookupResult.HIT] * len(KEYS)
        job_id, _ = a.load(ctx, KEYS)
        a.record(a.tier.take_results())
        assert a.outcome(job_id) is None
        cluster.advance(0.5)
        a.tier.poll()
        a.record(a.tier.take_results())
        assert a.outcome(job_id) is False
        assert ahead_counts(a)["jobs_given_up"] == 1
        poll(a, b)  # the fetch lands: staged for whoever asks next, not handed out
        assert a.stats().staged_blocks == len(KEYS)
        rows_accounted(a)

    def test_a_job_with_a_key_not_staged_goes_the_ordinary_way(self) -> None:
        cluster, a, b = setup()
        produce(b, KEYS)
        Router(cluster).prefetch(a, b, TOKENS[:2])
        poll(a, b)
        ctx = a.request("c")
        assert a.lookup(ctx, KEYS[2]) == [LookupResult.MISS]  # no source, not staged
        job_id, _ = a.load(ctx, KEYS)
        a.record(a.tier.take_results())
        assert a.outcome(job_id) is False  # not ours, and no source: the engine computes
        assert a.stats().staged_blocks == 2  # still there for its own request

    def test_a_pd_consumer_never_takes_staged_blocks(self) -> None:
        """Its producer parks its stores for the one fetch of them all: a load served
        from staging would leave them waiting for a fetch that never comes."""
        cluster, a, b = setup()
        produce(b, KEYS)
        Router(cluster).prefetch(a, b, TOKENS)
        poll(a, b)
        ctx = a.request("decode", prefiller("pd1", b))
        a.lookup(ctx, *KEYS)
        job_id, _ = a.load(ctx, KEYS)
        a.record(a.tier.take_results())
        assert a.outcome(job_id) is None  # sent to the producer, not copied
        assert a.stats().staged_blocks == 3
        assert ahead_counts(a).get("jobs_served", 0) == 0

    def test_a_prefetch_behind_its_request_fetches_nothing(self) -> None:
        cluster, a, b = setup()
        produce(b, KEYS)
        ctx = a.request("c", kv_source("r1", b))  # the router's request won the race
        router = Router(cluster)
        router.prefetch(a, b, TOKENS, kv_id="r1")
        poll(a, b)
        (refusal,) = router.refusals()
        assert refusal.reason == "its request is here already"
        assert ahead_counts(a).get("blocks_fetched", 0) == 0
        a.finish(ctx)

    def test_a_second_prefetch_of_staged_keys_fetches_nothing(self) -> None:
        cluster, a, b = setup()
        produce(b, KEYS)
        router = Router(cluster)
        router.prefetch(a, b, TOKENS)
        poll(a, b)
        router.prefetch(a, b, TOKENS, kv_id="r2")
        poll(a, b)
        assert [r.kv_request_id for r in router.refusals()] == ["r2"]
        assert ahead_counts(a)["blocks_fetched"] == 3


class TestRefused:
    def test_no_prefetch_from_refuses_by_name_and_stages_nothing(self) -> None:
        cluster, a, b = setup(allow=False)
        produce(b, KEYS)
        router = Router(cluster)
        router.prefetch(a, b, TOKENS)
        poll(a, b)
        (refusal,) = router.refusals()
        assert "prefetch_from" in refusal.reason
        assert refusal.kv_request_id == "r1"
        assert a.tier.session(b.peer_id) is None  # nothing dialled on its say-so
        assert a.stats().staged_blocks == 0

    def test_no_staging_rows(self) -> None:
        cluster, a, b = setup(rows=[])
        router = Router(cluster)
        router.prefetch(a, b, TOKENS)
        poll(a, b)
        (refusal,) = router.refusals()
        assert "stages nothing" in refusal.reason

    def test_every_bad_prefetch_is_named(self) -> None:
        cluster, a, b = setup()
        router = Router(cluster)
        router.prefetch(a, "not-an-address", TOKENS, kv_id="bad-source")
        router.prefetch(a, a.peer_id, TOKENS, kv_id="self")
        router.prefetch(a, b, (7, 666), kv_id="cursed")
        poll(a, b)
        reasons = {r.kv_request_id: r.reason for r in router.refusals()}
        assert "host:port" in reasons["bad-source"]
        assert "this node" in reasons["self"]
        assert "cursed" in reasons["cursed"]
        assert a.stats().staged_blocks == 0
        assert a.stats().staging_free == len(ROWS)
        assert a.tier.session(b.peer_id) is None

    def test_an_obeyed_router_cannot_name_a_peer_outside_allowed_peers(self) -> None:
        """The prefetch's source goes through the peer table as a request's does: a peer
        ``allowed_peers`` leaves out is never dialled on a router's word."""
        cluster, a, b = setup(extra={"allowed_peers": ["c:3"]})
        produce(b, KEYS)
        router = Router(cluster)
        router.prefetch(a, b, TOKENS)
        poll(a, b)
        (refusal,) = router.refusals()
        assert refusal.reason.startswith(f"cannot reach {b.peer_id}")
        assert a.tier.session(b.peer_id) is None
        assert a.stats().staged_blocks == 0
        assert a.stats().staging_free == len(ROWS)

    def test_a_hostile_frame_shape_is_dropped(self) -> None:
        cluster, a, b = setup()
        router = Router(cluster)
        link = router.control.connect(a.peer_id)
        link.transmit(b"\x83\xa4type\xa8prefetch\xadkv_request_id\xa1r\xa6source\x01")
        link.transmit(CODEC.encode(Prefetch(kv_request_id="r", source=b.peer_id, tokens=(1,)))
                      .replace(b"\x01", b"\xff"))  # fmt: skip
        poll(a, b)
        assert a.stats().staged_blocks == 0
        rows_accounted(a)


class TestBounded:
    def test_staging_full_takes_the_prefix_that_fits_then_evicts_oldest(self) -> None:
        cluster, a, b = setup(rows=[40, 41])
        produce(b, keys(1, 2, 3, 4, 5))
        router = Router(cluster)
        router.prefetch(a, b, (1, 2, 3))
        poll(a, b)
        assert a.stats().staged_blocks == 2
        assert a.tier.ahead.holds(keys(1)[0])
        assert not a.tier.ahead.holds(keys(3)[0])
        router.prefetch(a, b, (4,), kv_id="r2")
        poll(a, b)
        assert not a.tier.ahead.holds(keys(1)[0])  # the oldest went
        assert a.tier.ahead.holds(keys(2)[0])
        assert a.tier.ahead.holds(keys(4)[0])
        assert ahead_counts(a)["blocks_evicted"] == 1
        rows_accounted(a)

    def test_nothing_fits_while_every_row_is_being_fetched(self) -> None:
        cluster, a, b = setup(rows=[40])
        produce(b, keys(1, 2))
        router = Router(cluster)
        router.prefetch(a, b, (1,))
        a.tier.poll()  # fetching, not staged: cannot be evicted
        router.prefetch(a, b, (2,), kv_id="r2")
        a.tier.poll()
        assert "staging full" in router.refusals()[0].reason

    def test_a_request_that_never_comes_frees_its_rows_at_the_ttl(self) -> None:
        cluster, a, b = setup()
        produce(b, KEYS)
        Router(cluster).prefetch(a, b, TOKENS)
        poll(a, b)
        assert a.stats().staged_blocks == 3
        deadline = a.tier.next_deadline()
        assert deadline is not None
        assert deadline <= cluster.clock.now + TTL_S
        cluster.clock.advance(TTL_S)
        a.tier.poll()
        assert a.stats().staged_blocks == 0
        assert a.stats().staging_free == len(ROWS)
        assert ahead_counts(a)["blocks_expired"] == 3
        ctx = a.request("late")
        assert a.lookup(ctx, *KEYS) == [LookupResult.MISS] * 3


class TestEngineReset:
    def test_a_reset_drops_what_is_staged_and_what_is_still_coming(self) -> None:
        """vLLM's reset_cache (new weights, sleep): nothing staged before it is handed
        out after it; the rows stay staging rows."""
        cluster, a, b = setup()
        produce(b, keys(1, 2, 3, 4))
        router = Router(cluster)
        router.prefetch(a, b, (1, 2))
        poll(a, b)  # staged
        router.prefetch(a, b, (3, 4), kv_id="r2")
        a.tier.poll()  # being fetched
        ctx = a.request("c")
        job_id, _ = engine_pull(a, keys(3, 4), "d", source=b)  # waits for the fetch
        rows = a.tier.reset_staging()
        assert rows == frozenset(ROWS)
        a.record(a.tier.take_results())
        assert a.outcome(job_id) is False
        poll(a, b)  # the fetch that was running lands: discarded
        assert a.stats().staged_blocks == 0
        assert a.stats().staging_free == len(ROWS)
        assert a.lookup(ctx, *keys(1, 2, 3, 4)) == [LookupResult.MISS] * 4
        rows_accounted(a)


class TestFallbacks:
    def test_a_source_without_the_blocks_stages_nothing(self) -> None:
        cluster, a, b = setup()
        Router(cluster).prefetch(a, b, TOKENS)  # b holds none of them
        poll(a, b)
        b.step()
        poll(a, b)
        assert a.stats().staged_blocks == 0
        assert a.stats().staging_free == len(ROWS)
        assert ahead_counts(a)["fetches_failed"] == 1
        assert a.tier.counters().loads_failed == 1  # counted as any failed pull
        rows_accounted(a)

    def test_the_source_dying_mid_fetch_fails_the_waiting_job_and_frees_the_rows(self) -> None:
        cluster, a, b = setup()
        produce(b, KEYS)
        Router(cluster).prefetch(a, b, TOKENS)
        a.tier.poll()
        job_id, _ = engine_pull(a, KEYS, source=b)
        cluster.kill(b)
        for _ in range(8):
            a.step()
        assert a.outcome(job_id) is False
        assert a.stats().staging_free == len(ROWS)
        ctx = a.request("after")
        assert a.lookup(ctx, *KEYS) == [LookupResult.MISS] * 3

    def test_shutdown_fails_waiting_jobs_and_holds_nothing(self) -> None:
        cluster, a, b = setup()
        produce(b, KEYS)
        Router(cluster).prefetch(a, b, TOKENS)
        a.tier.poll()
        job_id, _ = engine_pull(a, KEYS, source=b)
        a.tier.shutdown()
        a.record(a.tier.take_results())
        assert a.outcome(job_id) is False
        staged, fetching, free = a.tier.ahead.statistics()
        assert (staged, fetching, free) == (0, 0, len(ROWS))
        ctx = a.request("after")
        assert a.lookup(ctx, *KEYS) == [LookupResult.MISS] * 3

    def test_the_engines_own_job_ids_never_collide_with_ahead_fetches(self) -> None:
        cluster, a, b = setup()
        produce(b, KEYS)
        Router(cluster).prefetch(a, b, TOKENS)
        poll(a, b)
        reported = [r.job_id for r in a.tier.take_results()]
        assert reported == []  # the ahead fetch (a negative id) never reaches the engine
        ctx = a.request("c")
        a.lookup(ctx, *KEYS)
        job = TransferJob(7, KEYS, (60, 61, 62), ctx)
        a.submitted.add(7)
        a.tier.submit_load(job)
        assert [r.job_id for r in a.tier.take_results()] == [7]
