"""A health flap is not a restart: the feed proves the same process, or it is a restart.

The sans-IO feed (``EventFeed.verify``), the health rule with a scripted witness, and the
whole router with a fake engine and a fake vLLM event publisher on real sockets.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio

from kvpeer.lab.engines.fakeengine import FakeEngine
from kvpeer.router.app import Router
from kvpeer.router.config import EngineEntry, from_mapping
from kvpeer.router.feed import (
    REPLAY_END_SEQ,
    Anchor,
    Continuity,
    EventFeed,
    FeedLimits,
    StreamReset,
    encode_replay_request,
)
from kvpeer.router.health import EngineHealth
from kvpeer.router.index import MEDIUM_GPU, PrefixIndex
from kvpeer.router.subscriber import EventSubscriber
from tests.router.conftest import run, until

BS = 4
RESTARTED = StreamReset("restart", restarted=True)
REPLAY_END = [b"", b"", REPLAY_END_SEQ.to_bytes(8, "big"), b""]


def block(n: int) -> bytes:
    return hashlib.sha256(b"%d" % n).digest()


def tokens(n: int) -> list[int]:
    return [1000 + 4 * n + i for i in range(BS)]


def batch(n: int, ts: float = 1.0) -> bytes:
    """vLLM's wire form of a batch storing block ``n`` (chained to block ``n - 1``);
    ``ts`` is the publisher's wall clock, which makes two processes' batches differ."""
    stored = {"type": "BlockStored", "block_hashes": [block(n)],
              "parent_block_hash": block(n - 1) if n else None, "token_ids": tokens(n),
              "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None}
    return msgspec.msgpack.encode([ts, [stored], None])


def live(seq: int, payload: bytes) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), payload]


def replayed(seq: int, payload: bytes) -> list[bytes]:
    return [b"", b"", seq.to_bytes(8, "big"), payload]


def following(n: int) -> tuple[EventFeed, Anchor]:
    """A feed that applied batches 0..n-1 of one process, and its anchor."""
    feed = EventFeed(can_replay=True)
    for seq in range(n):
        feed.on_live(live(seq, batch(seq)), 0.0)
    anchor = feed.anchor()
    assert anchor is not None
    assert anchor.seq == n - 1
    return feed, anchor


# --- the feed (sans-IO) --------------------------------------------------------------------


def test_the_same_process_replays_the_anchor_batch_and_the_gap_is_applied() -> None:
    feed, anchor = following(3)
    feed.on_live(live(3, batch(3)), 0.0)  # the engine lived on while its check failed
    out = feed.verify(anchor, 0.0)
    assert out.replay_from == 2
    assert out.continuity is None
    assert feed.on_replay(replayed(2, batch(2)), 0.0).continuity is Continuity.SAME
    outs = [feed.on_replay(replayed(seq, batch(seq)), 0.0) for seq in (3, 4)]  # 4: the gap
    outs.append(feed.on_replay(REPLAY_END, 0.0))
    got = [i for out in outs for i in out.items]
    assert not any(isinstance(i, StreamReset) for i in got)
    assert [i.block_hashes for i in got] == [(block(4),)]  # type: ignore[union-attr]
    stats = feed.statistics()
    assert stats.synced
    assert stats.next_seq == 5
    assert stats.resets == 0
    assert stats.verified == (("same", 1),)


def test_other_bytes_at_the_anchor_seq_are_a_new_process() -> None:
    feed, anchor = following(3)
    feed.verify(anchor, 0.0)
    out = feed.on_replay(replayed(2, batch(2, ts=2.0)), 0.0)
    assert out.continuity is Continuity.NEW
    assert out.items == (RESTARTED,)
    assert feed.anchor() is None
    assert feed.statistics().restarts == 1
    feed.on_replay(replayed(3, batch(3, ts=2.0)), 0.0)  # the rest of that answer: dropped
    assert ("replay_unexpected", 1) in feed.statistics().dropped


def test_a_new_process_that_counted_past_the_old_position_is_caught() -> None:
    """``seq`` alone takes this for lost events: the new process's frames continue past
    where the old one stopped. The anchor, taken before the engine went down, does not."""
    feed, anchor = following(3)
    new = [batch(seq, ts=9.0) for seq in range(6)]
    assert feed.on_live(live(5, new[5]), 0.0).replay_from == 3  # a "gap"
    feed.on_replay(replayed(3, new[3]), 0.0)
    feed.on_replay(replayed(4, new[4]), 0.0)
    feed.on_replay(REPLAY_END, 0.0)
    assert feed.statistics().restarts == 0  # fooled so far
    feed.verify(anchor, 0.0)
    out = feed.on_replay(replayed(2, new[2]), 0.0)
    assert out.continuity is Continuity.NEW
    assert out.items == (RESTARTED,)


def test_nothing_from_the_anchor_on_is_a_new_process() -> None:
    feed, anchor = following(3)
    feed.verify(anchor, 0.0)
    out = feed.on_replay(REPLAY_END, 0.0)
    assert out.continuity is Continuity.NEW
    assert out.items == (RESTARTED,)


def test_seq_going_back_during_the_proof_is_a_new_process() -> None:
    feed, anchor = following(3)
    feed.verify(anchor, 0.0)
    out = feed.on_live(live(0, batch(0, ts=5.0)), 0.0)
    assert out.continuity is Continuity.NEW
    assert out.items[0] == RESTARTED


def test_a_restart_the_feed_saw_since_the_anchor_is_a_new_process() -> None:
    feed, anchor = following(3)
    feed.on_live(live(0, batch(0, ts=5.0)), 0.0)  # seq went back while it was down
    feed.on_live(live(1, batch(1, ts=5.0)), 0.0)
    feed.on_live(live(2, batch(2, ts=5.0)), 0.0)
    out = feed.verify(anchor, 0.0)
    assert out.continuity is Continuity.NEW
    assert out.replay_from is None


def test_what_proves_nothing_is_unknown() -> None:
    no_replay = EventFeed(can_replay=False)
    no_replay.on_live(live(0, batch(0)), 0.0)
    assert no_replay.verify(no_replay.anchor(), 0.0).continuity is Continuity.UNKNOWN

    feed, anchor = following(3)
    assert feed.verify(None, 0.0).continuity is Continuity.UNKNOWN  # nothing applied
    assert feed.on_live(live(7, batch(7)), 0.0).replay_from == 3  # a gap replay runs
    assert feed.verify(anchor, 0.0).continuity is Continuity.UNKNOWN


def test_a_buffer_that_no_longer_reaches_the_anchor_is_unknown_then_a_gap() -> None:
    feed, anchor = following(3)
    feed.verify(anchor, 0.0)
    out = feed.on_replay(replayed(5, batch(5)), 0.0)  # 2..4 rolled out of the buffer
    assert out.continuity is Continuity.UNKNOWN
    assert out.items[0] == StreamReset("gap", restarted=False)
    assert feed.on_replay(REPLAY_END, 0.0).replay_from is None


def test_a_proof_that_times_out_is_unknown() -> None:
    feed = EventFeed(can_replay=True, limits=FeedLimits(replay_timeout_s=1.0))
    for seq in range(2):
        feed.on_live(live(seq, batch(seq)), 0.0)
    assert feed.verify(feed.anchor(), 10.0).replay_from == 1
    assert feed.poll(10.5).continuity is None
    assert feed.poll(11.0).continuity is Continuity.UNKNOWN


# --- the health rule with a scripted witness ------------------------------------------------


class Witness:
    def __init__(self, answer: Callable[[str], Awaitable[Continuity]]) -> None:
        self.answer = answer
        self.down: list[str] = []
        self.asked: list[tuple[str, bool]] = []  # (name, was it routable when asked)
        self.health: EngineHealth | None = None

    async def came_up(self, name: str) -> None:
        return None

    def went_down(self, name: str) -> None:
        self.down.append(name)

    async def same_process(self, name: str) -> Continuity:
        assert self.health is not None
        self.asked.append((name, self.health.healthy(name)))
        return await self.answer(name)


async def returns(answer: Callable[[str], Awaitable[Continuity]]) -> tuple[Witness, list[str],
                                                                       list[str], EngineHealth]:
    """An engine checked up, down, up again, with ``answer`` as the witness's verdict."""
    engine = FakeEngine("a")
    await engine.start()
    entries = [EngineEntry(spec) for spec in from_mapping({"mode": "shared", "engine": [
        {"name": "a", "url": engine.url, "peer": "127.0.0.1:5710"}]}).specs]
    witness = Witness(answer)
    restarts: list[str] = []
    flaps: list[str] = []
    health = EngineHealth(entries, restarts.append, interval_s=60, timeout_s=0.5,
                          restart_failures=1, witnesses={"scripted": witness},
                          on_flap=flaps.append)
    witness.health = health
    try:
        async with aiohttp.ClientSession() as session:
            await health.check_once(session)
            engine.behaviour.health_status = 503
            await health.check_once(session)
            assert not health.healthy("a")
            assert witness.down == ["a"]
            engine.behaviour.health_status = 200
            await health.check_once(session)
            assert health.healthy("a")
    finally:
        await engine.stop()
    return witness, restarts, flaps, health


def test_a_proven_flap_keeps_the_engine_and_it_stays_down_until_proven() -> None:
    async def same(name: str) -> Continuity:
        return Continuity.SAME

    witness, restarts, flaps, health = run(returns(same))
    assert witness.asked == [("a", False)]
    assert (restarts, flaps) == ([], ["a"])
    assert (health.statistics().restarts, health.statistics().flaps) == (0, 1)


def test_strictly_no_proof_an_error_or_a_silent_witness_is_a_restart() -> None:
    """With ``restart_failures = 1`` (the strict judgment) one failed check without proof
    of the same process is a restart; a proof of another process always is."""
    async def different(name: str) -> Continuity:
        return Continuity.NEW

    async def unknown(name: str) -> Continuity:
        return Continuity.UNKNOWN

    async def broken(name: str) -> Continuity:
        raise RuntimeError("witness bug")

    async def silent(name: str) -> Continuity:
        await asyncio.Event().wait()  # never answers: the check's timeout decides
        return Continuity.SAME

    for answer in (different, unknown, broken, silent):
        _, restarts, flaps, health = run(returns(answer))
        assert (restarts, flaps) == (["a"], []), answer.__name__
        assert (health.statistics().restarts, health.statistics().flaps) == (1, 0)


# --- the router, a fake engine and a fake vLLM event publisher -------------------------------


class Publisher:
    """A fake ``ZmqEventPublisher``: PUB (XPUB, to see the subscription) and ROUTER."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.pub = ctx.socket(zmq.XPUB)
        self.replay = ctx.socket(zmq.ROUTER)
        for sock in (self.pub, self.replay):
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind("tcp://127.0.0.1:*")

    def endpoints(self) -> dict[str, str]:
        return {"kv_events": self.pub.getsockopt_string(zmq.LAST_ENDPOINT),
                "kv_events_replay": self.replay.getsockopt_string(zmq.LAST_ENDPOINT)}

    async def replay_request(self) -> tuple[bytes, int]:
        ident, empty, start = await asyncio.wait_for(self.replay.recv_multipart(), 10)
        assert empty == b""
        return ident, int.from_bytes(start, "big")

    async def answer(self, ident: bytes, frames: list[tuple[int, bytes]]) -> None:
        for seq, payload in frames:
            await self.replay.send_multipart([ident, *replayed(seq, payload)])
        await self.replay.send_multipart([ident, *REPLAY_END])

    def close(self) -> None:
        self.pub.close()
        self.replay.close()


Body = Callable[[Router, FakeEngine, Publisher, FakeEngine], Awaitable[None]]


async def router_scenario(body: Body, health_timeout_s: float = 2.0,
                          restart_failures: int = 3, start_time: bool = True) -> None:
    """Engine ``a`` with an event feed (three blocks learned), ``b`` without one;
    ``start_time``: whether the engines' ``/metrics`` tell their start time."""
    ctx = zmq.asyncio.Context()
    publisher = Publisher(ctx)
    engine, other = FakeEngine("a"), FakeEngine("b")
    for fake in (engine, other):
        fake.behaviour.start_time = start_time
        await fake.start()
    config = from_mapping({
        "mode": "shared", "listen": "127.0.0.1:0", "health_interval_s": 0.05,
        "health_timeout_s": health_timeout_s, "health_restart_failures": restart_failures,
        "engine": [{"name": "a", "url": engine.url, "peer": "127.0.0.1:5710",
                    **publisher.endpoints()},
                   {"name": "b", "url": other.url, "peer": "127.0.0.2:5710"}]})
    router = Router(config)
    await router.start()
    try:
        ident, start = await publisher.replay_request()  # the history, on subscribing
        assert start == 0
        await publisher.answer(ident, [])
        assert (await asyncio.wait_for(publisher.pub.recv(), 10))[0] == 1  # subscribed
        for seq in range(3):
            await publisher.pub.send_multipart(live(seq, batch(seq)))
        await until(lambda: held(router) == 3 * BS, "the first three blocks")
        await body(router, engine, publisher, other)
    finally:
        await router.stop()
        await engine.stop()
        await other.stop()
        publisher.close()
        ctx.term()


def held(router: Router, blocks: int = 3) -> int:
    assert router.index is not None
    keys = router.index.keys([t for n in range(blocks) for t in tokens(n)])
    return router.index.longest_prefix("a", keys, MEDIUM_GPU, 0.0)


async def sent(replay_endpoint: str, batches: int, timeout: float = 10.0) -> None:
    """Wait until a vLLM publisher has sent ``batches`` batches, asking its replay endpoint
    as any client would. Its ``publish`` only queues a batch for the publisher's thread,
    which serves replays from what it has sent: a subscriber asking sooner (a loaded CI
    machine) gets part of the history, and the rest went out before it had subscribed."""
    context = zmq.asyncio.Context()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        while True:
            dealer = context.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(replay_endpoint)
            await dealer.send_multipart(encode_replay_request(0))
            got = 0
            while True:
                left = deadline - loop.time()
                assert left > 0, f"the publisher did not send {batches} batches in {timeout} s"
                parts = await asyncio.wait_for(dealer.recv_multipart(), left)
                if parts == REPLAY_END:
                    break
                got += 1
            dealer.close(linger=0)
            if got >= batches:
                return
            await asyncio.sleep(0.005)
    finally:
        context.destroy(linger=0)


async def flap_down(router: Router, engine: FakeEngine, name: str = "a") -> None:
    # Up first: with a short health timeout on a loaded machine, the router's first check
    # of an engine can time out, and an engine never seen up cannot flap (CI saw it: the
    # proof under test was never asked for).
    await router.health.wait_for(lambda h: h.healthy(name), 10)
    engine.behaviour.health_status = 503
    await router.health.wait_for(lambda h: not h.healthy(name), 10)
    engine.behaviour.health_status = 200


def counts(router: Router) -> tuple[float, float]:
    def value(name: str) -> float:
        return float(router.registry.get_sample_value(name) or 0.0)

    return (value("kvpeer_router_engine_flaps_total"),
            value("kvpeer_router_engine_restarts_total"))


def test_router_a_flap_keeps_the_index_and_replays_only_the_gap() -> None:
    async def body(router: Router, engine: FakeEngine, publisher: Publisher,
                   b: FakeEngine) -> None:
        await flap_down(router, engine)
        ident, start = await publisher.replay_request()
        assert start == 2  # from the last batch applied before it went down, not from 0
        assert not router.health.healthy("a")  # down until proven
        await publisher.answer(ident, [(2, batch(2)), (3, batch(3))])  # 3: lost live
        await router.health.wait_for(lambda h: h.healthy("a"), 10)
        await until(lambda: held(router, 4) == 4 * BS, "the gap's block")
        assert router.index is not None
        assert router.index.learned("a")
        assert counts(router) == (1.0, 0.0)
        await publisher.pub.send_multipart(live(4, batch(4)))
        await until(lambda: held(router, 5) == 5 * BS, "the next live batch")
        stats = router.subscribers["a"].statistics()
        assert (stats.resets, stats.replays_requested) == (0, 2)  # start, then the gap

    run(router_scenario(body))


def test_router_a_restart_forgets_at_once_and_relearns_from_zero() -> None:
    async def body(router: Router, engine: FakeEngine, publisher: Publisher,
                   b: FakeEngine) -> None:
        await flap_down(router, engine)
        ident, start = await publisher.replay_request()
        assert start == 2
        # A new process that already published three batches: other bytes at seq 2.
        await publisher.answer(ident, [(seq, batch(seq, ts=7.0)) for seq in (2,)])
        await router.health.wait_for(lambda h: h.healthy("a"), 10)
        assert held(router) == 0  # forgotten before it was routable again
        assert counts(router) == (0.0, 1.0)
        await publisher.pub.send_multipart(live(3, batch(3, ts=7.0)))
        ident, start = await publisher.replay_request()
        assert start == 0  # the new process's history
        await publisher.answer(ident, [(seq, batch(seq, ts=7.0)) for seq in range(3)])
        await until(lambda: held(router, 4) == 4 * BS, "the new process's blocks")

    # The feed's replay is the proof under test: no start time to race it.
    run(router_scenario(body, start_time=False))


def test_the_rest_of_an_abandoned_answer_is_not_the_next_replays() -> None:
    """vLLM's replay answers carry no request id. The verify's answer is decided by its
    first frame (another process); its end marker, still on its way when the history is
    asked for, must not end that history's replay. Seen under load in CI: the end marker
    closed the history's replay, the history was dropped as unexpected, and the router
    held nothing of the restarted engine."""

    async def body(router: Router, engine: FakeEngine, publisher: Publisher,
                   b: FakeEngine) -> None:
        await flap_down(router, engine)
        verify, start = await publisher.replay_request()
        assert start == 2
        await publisher.replay.send_multipart([verify, *replayed(2, batch(2, ts=7.0))])
        await router.health.wait_for(lambda h: h.healthy("a"), 10)  # judged restarted
        await publisher.pub.send_multipart(live(3, batch(3, ts=7.0)))
        history, start = await publisher.replay_request()
        assert start == 0
        await publisher.replay.send_multipart([verify, *REPLAY_END])  # late, and stale
        await publisher.answer(history, [(seq, batch(seq, ts=7.0)) for seq in range(3)])
        await until(lambda: held(router, 4) == 4 * BS, "the new process's blocks")
        stats = router.subscribers["a"].statistics()
        assert stats.replays_completed == 2, stats  # the first history, then this one

    run(router_scenario(body, start_time=False))


def test_router_strictly_an_unanswered_proof_is_a_restart_within_the_health_timeout() -> None:
    async def body(router: Router, engine: FakeEngine, publisher: Publisher,
                   b: FakeEngine) -> None:
        await flap_down(router, engine)
        _, start = await publisher.replay_request()  # ...and never answered
        assert start == 2
        await router.health.wait_for(lambda h: h.healthy("a"), 10)
        assert held(router) == 0
        assert counts(router) == (0.0, 1.0)

    run(router_scenario(body, health_timeout_s=0.3, restart_failures=1, start_time=False))


def test_router_an_unanswered_proof_after_one_failure_is_a_flap_by_default() -> None:
    """Nothing proves either (no start time, the replay unanswered): one failed check is
    not enough to call it restarted (health rule 3e)."""
    async def body(router: Router, engine: FakeEngine, publisher: Publisher,
                   b: FakeEngine) -> None:
        await flap_down(router, engine)
        _, start = await publisher.replay_request()  # ...and never answered
        assert start == 2
        await router.health.wait_for(lambda h: h.healthy("a"), 10)
        assert held(router) == 3 * BS
        assert counts(router) == (1.0, 0.0)
        assert router.health.statistics().verdicts == (("none", 1),)

    run(router_scenario(body, health_timeout_s=0.3, start_time=False))


def test_router_an_engine_without_an_event_feed_is_told_by_its_start_time() -> None:
    async def body(router: Router, engine: FakeEngine, publisher: Publisher,
                   b: FakeEngine) -> None:
        assert "b" not in router.subscribers  # no kv_events: the feed proves nothing
        await flap_down(router, b, "b")
        await router.health.wait_for(lambda h: h.healthy("b"), 10)
        assert counts(router) == (1.0, 0.0)
        assert router.health.statistics().verdicts == (("witness_same", 1),)
        assert held(router) == 3 * BS  # a is untouched

    run(router_scenario(body))


def test_router_strictly_an_engine_without_an_event_feed_or_start_time_is_restarted() -> None:
    async def body(router: Router, engine: FakeEngine, publisher: Publisher,
                   b: FakeEngine) -> None:
        await flap_down(router, b, "b")
        await router.health.wait_for(lambda h: h.healthy("b"), 10)
        assert counts(router) == (0.0, 1.0)
        assert router.health.statistics().verdicts == (("failures", 1),)

    run(router_scenario(body, restart_failures=1, start_time=False))


# --- vLLM's own publisher ------------------------------------------------------------------


def test_vllms_publisher_replays_the_anchor_byte_for_byte_and_its_successor_does_not(
    tmp_path: Path,
) -> None:
    """The proof rests on vLLM's ``ZmqEventPublisher`` replaying the bytes it published:
    checked against the real class (in this process, on ipc sockets), not a fake."""
    kv = pytest.importorskip("vllm.distributed.kv_events")
    pub_ep, replay_ep = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"

    def publish(publisher: Any, n: int, ts: float) -> None:
        events = [kv.BlockStored(block_hashes=[block(n)],
                                 parent_block_hash=block(n - 1) if n else None,
                                 token_ids=tokens(n), block_size=BS, lora_id=None,
                                 medium="GPU", lora_name=None)]
        publisher.publish(kv.KVEventBatch(ts=ts, events=events))

    async def scenario() -> None:
        index = PrefixIndex(block_size=BS)
        subscriber = EventSubscriber("e0", pub_ep, index, replay_endpoint=replay_ep)
        first = kv.ZmqEventPublisher(0, endpoint=pub_ep, replay_endpoint=replay_ep)
        second = None
        for n in range(3):
            publish(first, n, ts=100.0 + n)
        await sent(replay_ep, 3)
        stop = asyncio.Event()
        task = asyncio.create_task(subscriber.run(stop))
        keys = index.keys([t for n in range(3) for t in tokens(n)])
        try:
            # On subscribing it asks for the history: the three batches, replayed.
            await until(lambda: index.longest_prefix("e0", keys, MEDIUM_GPU, 0.0) == 3 * BS,
                        "the replayed history")
            anchor = subscriber.anchor()
            assert anchor is not None
            assert anchor.seq == 2
            assert await asyncio.wait_for(subscriber.verify(anchor), 10) is Continuity.SAME
            assert subscriber.statistics().resets == 0
            await until(lambda: not subscriber.statistics().replaying, "the replay's end")

            first.shutdown()  # the engine process ends; another one binds the same endpoints
            second = kv.ZmqEventPublisher(0, endpoint=pub_ep, replay_endpoint=replay_ep)
            for n in range(5):
                publish(second, n, ts=200.0 + n)  # the same blocks, another process
            verdict = await asyncio.wait_for(subscriber.verify(anchor), 10)
            assert verdict is not Continuity.SAME
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)
            for publisher in (first, second):
                if publisher is not None:
                    publisher.shutdown()

    run(scenario())
