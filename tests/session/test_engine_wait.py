"""A busy engine is not waited for past ``engine_wait_s`` (producer invariant 10).

Node ``a`` is the consumer, ``b`` the producer, whose engine's steps are modelled by
:class:`kvpeer.node.enginewait.EngineWindows` with the pair's clock: ``step`` opens a
serve window on ``b`` (the engine's scheduler ran), ``stepping`` says whether it has
requests open.
"""

from __future__ import annotations

import pytest

from kvpeer.node.enginewait import EngineWindows
from kvpeer.protocol import Fetch, Lookup, LookupResponse, TransferDone
from kvpeer.session import SessionSettings
from kvpeer.testing import SessionPair
from kvpeer.testing.steps import inject, sent
from kvpeer.types import Key

KV = "req-1"
K1, K2 = b"key-1", b"key-2"
WAIT = 0.25


class Engine:
    """``b``'s engine: requests open or not, and windows when it steps."""

    def __init__(self, wait: float | None = WAIT) -> None:
        self.open = False
        self.windows = EngineWindows(wait, lambda: self.open)


def pair_with(engine: Engine, lookup_pending_timeout_s: float = 5.0) -> SessionPair:
    settings = SessionSettings(lookup_pending_timeout_s=lookup_pending_timeout_s)
    return SessionPair(engine_b=engine.windows, settings=settings)


def step(pair: SessionPair, engine: Engine) -> None:
    """``b``'s engine steps: its serve window runs (the tier notes it first)."""
    engine.windows.window(pair.clock.now)
    pair.b.session.serve(pair.b.parent, pair.clock.now)
    pair.pump()


def probe(pair: SessionPair, keys: list[Key]) -> None:
    for key in keys:
        assert pair.a.session.register_probe(KV, key, pair.clock.now) is None
    pair.a.session.flush_lookups()
    pair.deliver()


def resolve_fetch(pair: SessionPair, keys: list[Key]) -> int:
    job_id = pair.next_job_id()
    pair.a.session.request_blocks(job_id, KV, keys, list(range(10, 10 + len(keys))),
                                  pair.clock.now, resolve=True)  # fmt: skip
    pair.pump()
    return job_id


def answers(pair: SessionPair) -> list[tuple[bool, ...]]:
    return [m.hits for m in sent(pair.b, LookupResponse)]


def settle(pair: SessionPair, engine: Engine) -> None:
    """The consumer's request ends and the engine steps once: nothing is left."""
    pair.a.session.finish_consumer(KV, pair.clock.now)
    pair.pump()
    step(pair, engine)
    parent = pair.b.parent
    assert (parent.open_jobs, parent.open_requests, parent.pinned_slots()) == ({}, {}, 0)
    stats = pair.b.session.statistics().producer
    assert (stats.requests, stats.lookups_queued, stats.store_jobs_open) == (0, 0, 0)


# -- the rule, by hand -------------------------------------------------------------------


def test_the_rule_by_hand() -> None:
    engine = Engine()
    rule = engine.windows
    assert rule.answer_by(10.0) == 10.0 + WAIT  # idle, never stepped: wait from arrival
    engine.open = True
    rule.opened(11.0, first=True)  # the first request wakes it: a step from 11.0
    assert rule.answer_by(11.1) == 11.0 + WAIT  # arrived mid-step: until the step is WAIT old
    assert rule.answer_by(11.5) == 11.5  # the step is older than WAIT: at once
    rule.opened(11.6, first=False)  # a second request does not restart the step
    assert rule.answer_by(11.5) == 11.5
    rule.window(12.0)
    assert rule.answer_by(12.1) == 12.0 + WAIT
    engine.open = False  # idle again: the engine steps as soon as the tier has work
    assert rule.answer_by(13.0) == 13.0 + WAIT
    assert EngineWindows(None, lambda: True).answer_by(1.0) is None
    assert EngineWindows(0.0, lambda: False).answer_by(1.0) == 1.0


# -- lookups -----------------------------------------------------------------------------


def test_a_lookup_mid_way_through_a_long_step_is_answered_without_the_engine() -> None:
    engine = Engine()
    pair = pair_with(engine)
    pair.b.parent.put(K1)
    engine.open = True
    step(pair, engine)  # the engine starts a long step
    pair.clock.advance(0.1)
    probe(pair, [K1])
    pair.advance(WAIT - 0.1 - 0.01)
    pair.poll()
    assert answers(pair) == []  # a short step would have ended by now: still waiting
    pair.advance(0.02)
    pair.pump()
    assert answers(pair) == [(False,)]  # the engine holds it, but it is mid-step
    stats = pair.b.session.statistics().producer
    assert stats.timeouts["engine_wait"] == 1
    assert pair.b.parent.open_requests == {}  # the parent was never asked
    assert pair.a.session.register_probe(KV, K1, pair.clock.now) is False  # a MISS
    settle(pair, engine)


def test_a_lookup_reaching_a_step_older_than_the_wait_is_answered_at_once() -> None:
    engine = Engine()
    pair = pair_with(engine)
    pair.b.parent.put(K1)
    engine.open = True
    step(pair, engine)
    pair.advance(1.0)  # a long prefill step, 1 s old
    probe(pair, [K1])
    pair.pump()
    assert answers(pair) == [(False,)]
    settle(pair, engine)


def test_a_step_that_ends_in_time_serves_the_lookup_as_before() -> None:
    engine = Engine()
    pair = pair_with(engine)
    pair.b.parent.put(K1)
    engine.open = True
    step(pair, engine)
    pair.clock.advance(0.05)
    probe(pair, [K1])
    pair.clock.advance(0.05)  # a decode step: 0.1 s
    step(pair, engine)
    assert answers(pair) == [(True,)]
    assert "engine_wait" not in pair.b.session.statistics().producer.timeouts
    settle(pair, engine)


def test_an_idle_engine_is_waited_for_from_the_lookups_arrival() -> None:
    engine = Engine()
    pair = pair_with(engine)
    pair.b.parent.put(K1)
    pair.advance(5.0)  # idle a long while: no step since
    probe(pair, [K1])
    pair.poll()
    assert answers(pair) == []
    pair.clock.advance(WAIT / 2)  # woken by the tier's pending work, it steps
    step(pair, engine)
    assert answers(pair) == [(True,)]
    settle(pair, engine)


def test_keys_pinned_by_an_earlier_window_stay_hits_and_its_serve_request_is_released() -> None:
    engine = Engine()
    pair = pair_with(engine)
    pair.b.parent.put(K1)
    pair.b.parent.put(K2)
    pair.b.parent.pending.add(K2)  # its store is still in flight: asked again next window
    engine.open = True
    step(pair, engine)
    probe(pair, [K1, K2])
    pair.clock.advance(0.01)
    step(pair, engine)  # K1 pinned, K2 pending; then a long step
    assert pair.b.parent.open_requests != {}
    pair.advance(WAIT)
    pair.pump()
    assert answers(pair) == [(True, False)]
    assert pair.b.parent.open_requests != {}  # finished in the next window, not outside one
    step(pair, engine)
    assert pair.b.parent.open_requests == {}
    # the hit is still fetchable: its pin outlived the busy answer
    job = pair.next_job_id()
    pair.a.session.request_blocks(job, KV, [K1], [10], pair.clock.now)
    pair.pump()
    pair.b.plane.complete_all()
    pair.pump()
    assert pair.a.loads[job].success
    settle(pair, engine)


def test_without_a_bound_a_lookup_waits_for_the_window() -> None:
    engine = Engine(wait=None)
    pair = pair_with(engine, lookup_pending_timeout_s=30.0)
    pair.b.parent.put(K1)
    engine.open = True
    step(pair, engine)
    probe(pair, [K1])
    pair.advance(10.0)
    pair.pump()
    assert answers(pair) == []
    step(pair, engine)
    assert answers(pair) == [(True,)]
    settle(pair, engine)


# -- resolve fetches ---------------------------------------------------------------------


def test_a_resolve_fetch_to_a_busy_engine_fails_its_round_at_once_and_pins_nothing() -> None:
    engine = Engine()
    pair = pair_with(engine)
    pair.b.parent.put(K1)
    pair.b.parent.put(K2)
    engine.open = True
    step(pair, engine)
    pair.advance(1.0)
    load = resolve_fetch(pair, [K1, K2])
    pair.pump()
    [reply] = sent(pair.b, TransferDone)
    assert not reply.success
    assert reply.reason is not None
    assert "not pinned" in reply.reason
    assert not pair.a.loads[load].success  # the consumer computes the blocks
    assert sent(pair.b, LookupResponse) == []  # its round's reply answered it
    assert pair.b.plane.pending == {}
    settle(pair, engine)


@pytest.mark.parametrize("late_step", [False, True])
def test_a_resolve_fetch_is_written_if_the_step_ends_in_time(late_step: bool) -> None:
    engine = Engine()
    pair = pair_with(engine)
    pair.b.parent.put(K1)
    engine.open = True
    step(pair, engine)
    load = resolve_fetch(pair, [K1])
    pair.advance(WAIT + 0.01 if late_step else WAIT - 0.01)
    step(pair, engine)
    pair.b.plane.complete_all()
    pair.pump()
    [reply] = sent(pair.b, TransferDone)
    assert reply.success is not late_step
    assert pair.a.loads[load].success is not late_step
    settle(pair, engine)


# -- what a peer can do with it ----------------------------------------------------------


def test_a_peer_cannot_use_busy_answers_to_pile_up_state() -> None:
    """A hostile peer sends many lookups and fetches to a busy producer: each one is
    answered once and what it held is released, so nothing accumulates; a fetch of a
    key answered MISS pins nothing and fails like any fetch of keys never pinned."""
    engine = Engine()
    pair = pair_with(engine)
    pair.b.parent.put(K1)
    engine.open = True
    step(pair, engine)
    pair.advance(1.0)
    for seq in range(50):
        inject(pair, pair.b, Lookup(kv_request_id=KV, keys=(K1, K2), round_seq=seq))
    pair.pump()
    assert len(answers(pair)) == 50
    assert all(hits == (False, False) for hits in answers(pair))
    stats = pair.b.session.statistics().producer
    assert stats.lookups_queued == 0
    assert stats.timeouts["engine_wait"] == 50
    inject(pair, pair.b, Fetch(kv_request_id=KV, keys=(K1,), block_indexes=(10,),
                               round_seq=49))  # fmt: skip
    pair.pump()
    [reply] = sent(pair.b, TransferDone)
    assert not reply.success
    assert pair.b.plane.pending == {}
    inject(pair, pair.b, Fetch(kv_request_id=KV, keys=(), block_indexes=(), round_seq=50))
    pair.pump()  # the peer's terminal fetch: its rounds are gone, as after window answers
    settle(pair, engine)
