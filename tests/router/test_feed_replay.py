"""A replay that takes long or loses frames still delivers the whole history.

vLLM's replay endpoint sends its whole answer at once and drops what exceeds ZMQ's send
high-water mark (1,000 messages): the feed asks again from the first ``seq`` missing.
An answer is over when it goes quiet for ``replay_timeout_s``, not that long after it
was asked for; a budget and a bounded number of re-asks, each only after progress,
bound what a hostile or broken endpoint can make the feed do.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvpeer.router import subscriber as subscriber_module
from kvpeer.router.feed import (
    REPLAY_END_SEQ,
    EventFeed,
    FeedItem,
    FeedLimits,
    FeedOutput,
    StreamReset,
    StreamSynced,
)
from kvpeer.router.index import MEDIUM_GPU, PrefixIndex
from kvpeer.router.kvevents import BlocksStored
from kvpeer.router.subscriber import REPLAY_RCVHWM, EventSubscriber
from tests.router.conftest import run, until
from tests.router.test_flap import Publisher

BS = 4
END = [b"", b"", REPLAY_END_SEQ.to_bytes(8, "big"), b""]
GAP = StreamReset("gap", restarted=False)


def block(n: int) -> bytes:
    return hashlib.sha256(b"%d" % n).digest()


def tokens(n: int) -> list[int]:
    return [BS * n + i for i in range(BS)]


def payload(n: int) -> bytes:
    """vLLM's wire form of a batch storing block ``n`` as a prompt of its own."""
    stored = {
        "type": "BlockStored",
        "block_hashes": [block(n)],
        "parent_block_hash": None,
        "token_ids": tokens(n),
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    return msgspec.msgpack.encode([1.0, [stored], None])


def live(seq: int) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), payload(seq)]


def replayed(seq: int) -> list[bytes]:
    return [b"", b"", seq.to_bytes(8, "big"), payload(seq)]


def answer(
    feed: EventFeed, seqs: Sequence[int], now: float = 0.0, end: bool = True
) -> list[FeedOutput]:
    outs = [feed.on_replay(replayed(seq), now) for seq in seqs]
    return [*outs, feed.on_replay(END, now)] if end else outs


def stored(outs: Sequence[FeedOutput]) -> list[int]:
    """The blocks the outputs store, in order, by number."""
    numbers = {block(n): n for n in range(64)}
    return [
        numbers.get(i.block_hashes[0], -1)  # type: ignore[arg-type]
        for out in outs
        for i in out.items
        if isinstance(i, BlocksStored)
    ]


def items(outs: Sequence[FeedOutput]) -> list[FeedItem]:
    return [i for out in outs for i in out.items]


def stored_items(n: int) -> tuple[FeedItem, ...]:
    return (BlocksStored.of_ids(MEDIUM_GPU, (block(n),), None, tuple(tokens(n)), BS),)


def feed(**limits: Any) -> EventFeed:
    return EventFeed(can_replay=True, limits=FeedLimits(**limits))


# --- the feed (sans-IO) --------------------------------------------------------------------


def test_an_answer_that_keeps_flowing_outlasts_the_idle_timeout() -> None:
    f = feed(replay_timeout_s=5.0)
    assert f.start(0.0).replay_from == 0
    outs = []
    for seq in range(20):  # one frame every 4 s: 76 s in all
        assert f.poll(4.0 * seq).items == ()
        outs.append(f.on_replay(replayed(seq), 4.0 * seq))
        assert f.next_deadline() == 4.0 * seq + 5.0
    assert f.poll(4.0 * 19 + 4.9) == FeedOutput()
    outs.append(f.on_replay(END, 80.0))
    assert stored(outs) == list(range(20))
    stats = f.statistics()
    assert (stats.replays_completed, stats.replays_incomplete, stats.replays_reasked) == (1, 0, 0)
    assert stats.synced


def test_an_answer_that_goes_quiet_is_asked_again_from_where_it_stopped() -> None:
    """Its end marker was dropped with its tail: the quiet ends it, not a timeout."""
    f = feed(replay_timeout_s=5.0)
    f.start(0.0)
    outs = answer(f, range(10), end=False)
    assert f.poll(4.9) == FeedOutput()
    again = f.poll(5.0)
    assert again.replay_from == 10
    assert StreamSynced() not in items([*outs, again])  # learned only at the replay's end
    outs += [again, *answer(f, range(10, 15), now=6.0)]
    assert stored(outs) == list(range(15))
    assert items(outs)[-1] == StreamSynced()
    stats = f.statistics()
    assert (stats.replays_completed, stats.replays_reasked, stats.resets) == (1, 1, 0)
    assert stats.next_seq == 15


def test_a_hole_in_an_answer_is_asked_for_again_from_the_first_missing_seq() -> None:
    f = feed()
    f.start(0.0)
    outs = answer(f, [0, 1, 2, 6, 7])  # 3..5 dropped on the way
    assert outs[-1].replay_from == 3
    assert stored(outs) == [0, 1, 2]  # 6 and 7 are held until the hole is filled
    outs += answer(f, range(3, 8))  # a re-ask's answer repeats 6 and 7
    assert outs[-1].replay_from is None
    assert stored(outs) == list(range(8))
    stats = f.statistics()
    assert (stats.replays_completed, stats.replays_reasked, stats.resets) == (1, 1, 0)
    assert stats.dropped == ()


def test_an_answer_short_of_the_live_stream_is_asked_again() -> None:
    f = feed()
    assert f.on_live(live(12), 0.0).replay_from == 0  # mid-stream: learn the history
    outs = answer(f, range(6))
    assert outs[-1].replay_from == 6  # it ended, but 6..11 never came
    outs += answer(f, range(6, 12))
    assert stored(outs) == list(range(13))
    assert f.statistics().replays_completed == 1
    assert f.on_live(live(13), 0.0).items == stored_items(13)


def test_reasks_are_bounded_even_when_each_answer_advances() -> None:
    """An endpoint that moves the feed on by one batch per answer, leaving a hole each
    time, gets ``replay_reasks`` re-asks; then the hole is forgotten over."""
    f = feed(replay_reasks=3)
    f.on_live(live(0), 0.0)
    assert f.on_live(live(20), 0.0).replay_from == 1
    asked = [1]
    outs: list[FeedOutput] = []
    for _ in range(4):
        outs += answer(f, [asked[-1], 19])
        asked.append(outs[-1].replay_from)  # type: ignore[arg-type]
    assert asked == [1, 2, 3, 4, None]
    assert stored(outs) == [1, 2, 3, 4, 19, 20]
    assert GAP in items(outs)
    stats = f.statistics()
    assert (stats.replays_reasked, stats.replays_incomplete, stats.next_seq) == (3, 1, 21)
    assert stats.synced


def test_an_answer_that_does_not_advance_is_not_asked_again() -> None:
    f = feed()
    f.on_live(live(0), 0.0)
    assert f.on_live(live(5), 0.0).replay_from == 1
    outs = answer(f, [0])  # what was not asked for, then the end: no progress
    assert outs[-1].replay_from is None
    assert items(outs) == [GAP, StreamSynced(), *stored_items(5)]
    stats = f.statistics()
    assert (stats.replays_reasked, stats.replays_incomplete) == (0, 1)
    assert dict(stats.dropped) == {"replay_stale": 1}
    assert f.on_live(live(6), 0.0).items == stored_items(6)  # live events go on


def test_a_quiet_endpoint_is_not_asked_again() -> None:
    f = feed(replay_timeout_s=1.0)
    f.on_live(live(0), 0.0)
    f.on_live(live(3), 0.0)
    assert f.poll(1.0).replay_from is None
    assert not f.statistics().replaying


def test_a_trickle_that_never_ends_is_cut_at_the_budget() -> None:
    f = feed(replay_timeout_s=5.0, replay_budget_s=30.0)
    f.start(0.0)
    outs = [f.on_replay(replayed(seq), 4.0 * seq) for seq in range(8)]  # up to 28 s
    assert f.next_deadline() == 30.0
    assert f.poll(29.9) == FeedOutput()
    outs.append(f.poll(30.0))
    assert stored(outs) == list(range(8))
    assert outs[-1].items == (StreamSynced(),)  # what arrived is known from seq 0
    stats = f.statistics()
    assert (stats.replays_over_budget, stats.replays_incomplete) == (1, 1)
    assert f.on_replay(replayed(8), 31.0) == FeedOutput()
    assert ("replay_unexpected", 1) in f.statistics().dropped


def test_a_frame_past_the_budget_ends_the_replay_without_a_poll() -> None:
    f = feed(replay_timeout_s=5.0, replay_budget_s=10.0)
    f.start(0.0)
    f.on_replay(replayed(0), 4.0)
    f.on_replay(replayed(1), 8.0)
    assert f.on_replay(replayed(2), 12.0).items == (StreamSynced(),)
    assert f.statistics().replays_over_budget == 1
    assert f.statistics().next_seq == 2


def test_hostile_seqs_in_an_answer_are_applied_at_most_once_and_never_stale() -> None:
    """Backwards, repeated, out-of-range and huge ``seq`` values: nothing raises, nothing
    is applied twice, and what cannot be trusted is forgotten."""
    f = feed()
    f.on_live(live(0), 0.0)
    assert f.on_live(live(10), 0.0).replay_from == 1
    huge = 1 << 62
    outs = answer(f, [1, 2, 2, 0, 5, 5, 1], end=False)
    outs += [
        f.on_replay([b"", b"", seq, payload(9)], 0.0)
        for seq in (huge.to_bytes(8, "big"), (1 << 63).to_bytes(8, "big"), b"\x01")
    ]
    outs.append(f.on_replay(END, 0.0))
    assert outs[-1].replay_from == 3
    outs += answer(f, [3, 4])
    assert outs[-1].replay_from == 6  # 5 was held; the huge one and live 10 are not next
    outs += answer(f, [])  # no progress: give up, over the holes
    assert stored(outs) == [1, 2, 3, 4, 5, 9]
    assert GAP in items(outs)
    assert f.statistics().next_seq == huge + 1
    assert dict(f.statistics().dropped) == {"bad_seq": 2, "replay_stale": 1}
    restart = f.on_live(live(11), 0.0)  # the honest stream is far below: a new process
    assert restart.items[0] == StreamReset("restart", restarted=True)
    assert not f.statistics().synced


def test_frames_held_past_a_hole_are_bounded() -> None:
    f = feed(max_replay_frames=2)
    f.start(0.0)
    outs = answer(f, [0, 5, 6, 7], end=False)
    assert ("replay_over_limit", 1) in f.statistics().dropped
    assert stored(outs) == [0, 5, 6]
    assert not f.statistics().replaying


def test_held_frames_are_bounded_in_bytes_and_released_as_they_are_applied() -> None:
    f = feed(max_buffered_bytes=2 * len(payload(0)))
    f.start(0.0)
    outs = answer(f, [0, 2, 3, 1, 5, 6], end=False)  # 2 and 3 held, then applied after 1
    assert f.statistics().replaying
    outs += answer(f, [7], end=False)
    assert ("replay_over_limit", 1) in f.statistics().dropped
    assert stored(outs) == [0, 1, 2, 3, 5, 6]


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        ({"replay_timeout_s": 0}, "replay_timeout_s must be a positive number of seconds, not 0"),
        ({"replay_timeout_s": float("nan")}, "not nan"),
        ({"replay_budget_s": float("inf")}, "replay_budget_s must be .* not inf"),
        ({"replay_budget_s": "60"}, "replay_budget_s must be .* not '60'"),
        (
            {"replay_timeout_s": 10.0, "replay_budget_s": 5.0},
            r"replay_budget_s \(5.0\) must be at least replay_timeout_s \(10.0\)",
        ),
        ({"replay_reasks": -1}, "replay_reasks must be an integer of at least 0, not -1"),
        ({"replay_reasks": True}, "replay_reasks must be .* not True"),
        ({"max_replay_frames": 0}, "max_replay_frames must be an integer of at least 1, not 0"),
        ({"max_buffered_bytes": 1.5}, "max_buffered_bytes must be .* not 1.5"),
    ],
)
def test_limits_are_checked_naming_the_bad_value(limits: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FeedLimits(**limits)


# --- the subscriber against fake replay endpoints --------------------------------------------


class Endpoint(Publisher):
    """A fake vLLM publisher whose answers the test writes, paced as it likes."""

    def subscriber(
        self, index: PrefixIndex, ctx: zmq.asyncio.Context, limits: FeedLimits
    ) -> EventSubscriber:
        return EventSubscriber(
            "e0",
            self.pub.getsockopt_string(zmq.LAST_ENDPOINT),
            index,
            replay_endpoint=self.replay.getsockopt_string(zmq.LAST_ENDPOINT),
            context=ctx,
            limits=limits,
        )

    async def trickle(
        self, ident: bytes, seqs: Sequence[int], *, pace_s: float = 0.0, end: bool = True
    ) -> None:
        for seq in seqs:
            await self.replay.send_multipart([ident, *replayed(seq)])
            if pace_s:
                await asyncio.sleep(pace_s)
        if end:
            await self.replay.send_multipart([ident, *END])


async def following(
    limits: FeedLimits, body: Callable[[Endpoint, EventSubscriber, PrefixIndex], Awaitable[None]]
) -> None:
    ctx = zmq.asyncio.Context()
    endpoint = Endpoint(ctx)
    index = PrefixIndex(block_size=BS)
    subscriber = endpoint.subscriber(index, ctx, limits)
    stop = asyncio.Event()
    task = asyncio.create_task(subscriber.run(stop))
    try:
        await body(endpoint, subscriber, index)
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        endpoint.close()
        ctx.term()


def holds(index: PrefixIndex, n: int) -> bool:
    return index.longest_prefix("e0", index.keys(tokens(n)), MEDIUM_GPU, 0.0) == BS


def test_a_replay_that_trickles_for_longer_than_the_timeout_arrives_whole() -> None:
    timeout_s = 1.0

    async def body(endpoint: Endpoint, subscriber: EventSubscriber, index: PrefixIndex) -> None:
        ident, start = await endpoint.replay_request()
        assert start == 0
        loop = asyncio.get_running_loop()
        began = loop.time()
        await endpoint.trickle(ident, range(30), pace_s=0.1)
        assert loop.time() - began > 2 * timeout_s
        await until(lambda: index.learned("e0"), "the replay's end", timeout=10.0)
        assert all(holds(index, n) for n in range(30))
        stats = subscriber.statistics()
        assert (stats.replays_completed, stats.replays_reasked) == (1, 0)
        assert stats.replays_incomplete == 0

    run(following(FeedLimits(replay_timeout_s=timeout_s), body))


def test_an_endpoint_that_never_advances_is_given_up_and_live_events_go_on() -> None:
    async def body(endpoint: Endpoint, subscriber: EventSubscriber, index: PrefixIndex) -> None:
        ident, start = await endpoint.replay_request()
        assert start == 0
        assert (await asyncio.wait_for(endpoint.pub.recv(), 10))[0] == 1  # subscribed
        await endpoint.pub.send_multipart(live(10))
        await until(lambda: subscriber.statistics().frames == 1, "live 10, held", 10.0)
        await endpoint.trickle(ident, range(3))  # it ends short of the live stream
        ident, start = await endpoint.replay_request()
        assert start == 3
        await endpoint.trickle(ident, range(3), end=False)  # the same again, then quiet
        await until(lambda: not subscriber.statistics().replaying, "giving up", 10.0)
        await endpoint.pub.send_multipart(live(11))
        await until(lambda: holds(index, 11), "live 11", 10.0)
        assert index.learned("e0")
        assert holds(index, 10)
        assert not holds(index, 0)  # forgotten over the hole 3..9
        stats = subscriber.statistics()
        assert (stats.replays_reasked, stats.replays_incomplete, stats.resets) == (1, 1, 1)
        assert dict(stats.dropped) == {"replay_stale": 3}
        assert not await endpoint.replay.poll(0)  # not asked a third time

    run(following(FeedLimits(replay_timeout_s=0.3), body))


# --- vLLM's own publisher --------------------------------------------------------------------

BATCHES = 10_000
BLOCKS_PER_BATCH = 32


@pytest.mark.slow  # vLLM's publisher thread takes ~10 s to send the 10,000 batches
def test_a_router_learns_10000_batches_of_32_blocks_from_vllms_own_publisher(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's ``ZmqEventPublisher`` in this process (no engine) holds 10,000 batches of
    32 stores each, far past its replay socket's send high-water mark; a subscriber
    started only then learns all 320,000 blocks -- with ZMQ's default receive
    high-water mark too (1,000), where only the re-asks fill what the answers dropped."""
    kv = pytest.importorskip("vllm.distributed.kv_events")
    pub_ep, replay_ep = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    publisher: Any = kv.ZmqEventPublisher(0, endpoint=pub_ep, replay_endpoint=replay_ep)
    blocks = BATCHES * BLOCKS_PER_BATCH
    try:
        for first in range(0, blocks, BLOCKS_PER_BATCH):
            events = [
                kv.BlockStored(
                    block_hashes=[block(n)],
                    parent_block_hash=block(n - 1) if n > first else None,
                    token_ids=tokens(n),
                    block_size=BS,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                )
                for n in range(first, first + BLOCKS_PER_BATCH)
            ]
            publisher.publish(kv.KVEventBatch(ts=1.0, events=events))
        publisher._event_queue.join()  # every batch sent, so in its replay buffer

        async def scenario(rcvhwm: int, limits: FeedLimits) -> None:
            monkeypatch.setattr(subscriber_module, "REPLAY_RCVHWM", rcvhwm)
            index = PrefixIndex(block_size=BS, max_blocks=blocks)
            subscriber = EventSubscriber(
                "e0", pub_ep, index, replay_endpoint=replay_ep, limits=limits
            )
            stop = asyncio.Event()
            began = time.monotonic()
            task = asyncio.create_task(subscriber.run(stop))
            try:
                await until(lambda: index.learned("e0"), "the replay's end", timeout=50.0)
                assert time.monotonic() - began < 40.0
                stats = subscriber.statistics()
                assert sum(n for _, _, n in index.statistics(0.0).blocks) == blocks
                assert (stats.replays_requested, stats.replays_completed) == (1, 1)
                assert (stats.batches_applied, stats.resets) == (BATCHES, 0)
                assert stats.replays_reasked <= limits.replay_reasks
                last = range(blocks - BLOCKS_PER_BATCH, blocks)
                keys = index.keys([t for n in last for t in tokens(n)])
                assert index.longest_prefix("e0", keys, MEDIUM_GPU, 0.0) == len(last) * BS
            finally:
                stop.set()
                await asyncio.wait_for(task, 10)

        run(scenario(REPLAY_RCVHWM, FeedLimits()), timeout=60.0)
        # Each answer then loses its tail and its end marker: each re-ask waits out an
        # idle timeout, shortened here.
        run(scenario(1_000, FeedLimits(replay_timeout_s=1.0)), timeout=60.0)
    finally:
        publisher.shutdown()
