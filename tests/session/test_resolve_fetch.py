"""Resolve fetches (protocol 1.2): a consumer told what the producer holds fetches
without a lookup round trip, and the producer looks the keys up itself.

Node ``a`` is the consumer, ``b`` the producer. The producer may look keys up only in
a serve window (producer invariant 1), so a resolve fetch waits for one, as a lookup
would, and is answered only by its round's ``transfer_done`` (no ``lookup_resp``).
"""

from __future__ import annotations

from functools import partial

import pytest

from kvpeer.protocol import (
    RESOLVE_VERSION,
    AbortFetch,
    Fetch,
    LookupResponse,
    TransferDone,
)
from kvpeer.session import SessionSettings
from kvpeer.session.results import CloseKind
from kvpeer.testing import SessionPair
from kvpeer.testing.harness import make_hello
from kvpeer.testing.steps import inject, sent
from kvpeer.types import Key

KV = "req-1"
K1, K2 = b"key-1", b"key-2"
PLAIN_FITS = 10_000  # bytes: a 40-key plain fetch's charge fits, with its lookup's it does not


def resolve_fetch(pair: SessionPair, keys: list[Key], first_slot: int = 10) -> int:
    job_id = pair.next_job_id()
    slots = list(range(first_slot, first_slot + len(keys)))
    pair.a.session.request_blocks(job_id, KV, keys, slots, pair.clock.now, resolve=True)
    pair.pump()
    return job_id


def done(pair: SessionPair) -> list[tuple[int, bool, str | None]]:
    return [(m.round_seq, m.success, m.reason) for m in sent(pair.b, TransferDone)]


def serve_and_write(pair: SessionPair) -> None:
    """One serve window on the producer, its writes landing, the answers delivered."""
    pair.serve()
    pair.b.plane.complete_all()
    pair.pump()


def finish(pair: SessionPair) -> None:
    """The consumer's request ends; nothing may be left on the producer."""
    pair.a.session.finish_consumer(KV, pair.clock.now)
    pair.pump()
    assert_settled(pair)


def assert_settled(pair: SessionPair) -> None:
    assert pair.b.parent.open_jobs == {}
    assert pair.b.parent.pinned_slots() == 0
    assert pair.b.parent.open_requests == {}
    assert pair.b.plane.pending == {}
    stats = pair.b.session.statistics().producer
    assert (stats.store_jobs_open, stats.transfers_in_flight, stats.rounds) == (0, 0, 0)
    assert (stats.requests, stats.lookups_queued) == (0, 0)


@pytest.mark.parametrize(
    ("version", "resolves"),
    [(RESOLVE_VERSION, True), ((1, 1), False), ((1, 0), False), (None, False)],
    ids=["1.2", "1.1", "1.0", "vllm"],
)
def test_only_peers_of_the_resolve_version_are_sent_resolve_fetches(
    version: tuple[int, int] | None, resolves: bool
) -> None:
    # b is a peer of ``version`` (None: vLLM's tier, no extension)
    pair = SessionPair(hello_b=partial(make_hello, "b", kvpeer=version or False))
    assert pair.a.session.resolves_fetches is resolves


def test_a_resolve_fetch_waits_for_a_serve_window_then_writes_what_is_held() -> None:
    pair = SessionPair()
    for key in (K1, K2):
        pair.b.parent.put(key)
    load = resolve_fetch(pair, [K1, K2])
    [fetch] = sent(pair.a, Fetch)
    assert fetch.resolve
    assert fetch.round_seq == 0
    assert pair.b.plane.pending == {}  # nothing pinned outside a serve window
    assert pair.b.session.statistics().producer.rounds == 1
    pair.serve()
    [write] = pair.b.plane.pending.values()
    assert write.remote_slots == (10, 11)
    pair.b.plane.complete_all()
    pair.pump()
    assert done(pair) == [(0, True, None)]
    assert sent(pair.b, LookupResponse) == []  # its round's reply answers it
    assert pair.a.loads[load].success
    for i, key in enumerate((K1, K2)):
        assert pair.a.region.block(10 + i) == pair.b.parent.expected(key)
    finish(pair)


def test_a_key_the_producer_does_not_hold_fails_the_round_and_unpins_the_rest() -> None:
    pair = SessionPair()
    pair.b.parent.put(K1)  # K2 was evicted since the router saw it
    load = resolve_fetch(pair, [K1, K2])
    serve_and_write(pair)
    [(round_seq, success, reason)] = done(pair)
    assert (round_seq, success) == (0, False)
    assert reason is not None
    assert "1 keys were not pinned" in reason
    assert not pair.a.loads[load].success
    finish(pair)


def test_a_key_still_being_written_is_asked_again_until_it_lands() -> None:
    pair = SessionPair()
    pair.b.parent.put(K1)
    pair.b.parent.put(K2)
    pair.b.parent.pending.add(K2)  # its store into the producer's tier is in flight
    load = resolve_fetch(pair, [K1, K2])
    pair.serve()
    pair.b.plane.complete_all()  # K1's write lands; the round waits for K2
    pair.pump()
    assert done(pair) == []
    pair.b.parent.pending.discard(K2)
    serve_and_write(pair)
    assert done(pair) == [(0, True, None)]
    assert pair.a.loads[load].success
    finish(pair)


def test_a_key_pending_past_the_lookup_timeout_fails_the_round() -> None:
    pair = SessionPair(settings=SessionSettings(lookup_pending_timeout_s=1.0))
    pair.b.parent.put(K1)
    pair.b.parent.pending.add(K1)
    load = resolve_fetch(pair, [K1])
    pair.serve()
    pair.clock.advance(1.0)
    pair.serve()
    pair.pump()
    assert [(r, ok) for r, ok, _ in done(pair)] == [(0, False)]
    assert not pair.a.loads[load].success
    finish(pair)


def test_an_abort_before_the_serve_window_ends_the_implicit_lookup_too() -> None:
    pair = SessionPair()
    pair.b.parent.put(K1)
    resolve_fetch(pair, [K1])
    inject(pair, pair.b, AbortFetch(kv_request_id=KV, round_seq=0))
    pair.pump()
    pair.serve()  # the lookup of an aborted round pins nothing
    pair.pump()
    assert pair.b.plane.pending == {}
    finish(pair)


def test_the_terminal_fetch_keeps_a_resolving_round_and_it_still_completes() -> None:
    pair = SessionPair()
    pair.b.parent.put(K1)
    load = resolve_fetch(pair, [K1])
    inject(pair, pair.b, Fetch(kv_request_id=KV, keys=(), block_indexes=(), round_seq=1))
    serve_and_write(pair)
    assert done(pair) == [(0, True, None)]
    assert pair.a.loads[load].success
    finish(pair)


def test_keys_confirmed_by_probes_are_fetched_without_resolve() -> None:
    pair = SessionPair()
    pair.b.parent.put(K1)
    assert pair.a.session.register_probe(KV, K1, pair.clock.now) is None
    pair.a.session.flush_lookups()
    pair.deliver()
    pair.serve()
    pair.pump()
    resolve_fetch(pair, [K1])
    [fetch] = sent(pair.a, Fetch)
    assert not fetch.resolve  # a plain fetch: vLLM's and older producers take it


def test_a_session_closing_mid_resolve_hands_back_the_lookup_and_fails_the_load() -> None:
    pair = SessionPair()
    pair.b.parent.put(K1)
    pair.b.parent.pending.add(K1)
    load = resolve_fetch(pair, [K1])
    pair.serve()  # the implicit lookup's serve request is open on the parent now
    assert pair.b.parent.open_requests != {}
    pair.b.session.close("test")
    pair.pump()
    assert pair.b.parent.open_requests == {}  # handed back with the session's ending
    assert not pair.a.loads[load].success


def test_resolve_fetches_are_charged_against_the_peers_budget() -> None:
    """A resolve fetch holds a lookup's state as well as a fetch's; both are charged,
    so one that fits as a plain fetch can be over budget as a resolve fetch."""
    keys = tuple(f"key-{i:04d}".encode() for i in range(40))
    slots = tuple(range(40))
    outcomes = []
    for resolve in (False, True):
        pair = SessionPair(settings=SessionSettings(max_peer_bytes=PLAIN_FITS))
        pair.a.plane.expect_writes("b", slots)
        inject(pair, pair.b, Fetch(kv_request_id=KV, keys=keys, block_indexes=slots,
                                   round_seq=0, resolve=resolve))  # fmt: skip
        pair.poll()
        outcomes.append(None if pair.b.closed is None else pair.b.closed.kind)
    assert outcomes == [None, CloseKind.OVER_BUDGET]
