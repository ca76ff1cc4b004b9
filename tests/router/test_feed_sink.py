"""The feed's sink: items reach the index as they are produced, so a replayed history is
applied batch by batch instead of being held decoded in full (a 10,000-batch replay of a
real engine's history made ``kvpeer soak``'s routers jump by tens of MiB)."""

from __future__ import annotations

import gc
import hashlib

import msgspec

from kvpeer.router.feed import REPLAY_END_SEQ, EventFeed, FeedItem, FeedOutput
from kvpeer.router.kvevents import BlocksStored

BS = 4
REPLAY_END = [b"", b"", REPLAY_END_SEQ.to_bytes(8, "big"), b""]


def payload(seq: int) -> bytes:
    """One batch storing one block, chained to the previous batch's block."""
    parent = hashlib.sha256(b"%d" % (seq - 1)).digest() if seq else None
    stored = {"type": "BlockStored", "block_hashes": [hashlib.sha256(b"%d" % seq).digest()],
              "parent_block_hash": parent, "token_ids": [seq % 500 + 1000 + i for i in range(BS)],
              "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None}
    return msgspec.msgpack.encode([1.0, [stored], None])


def replay(feed: EventFeed, frames: int) -> list[FeedOutput]:
    outs = [feed.start(0.0)]
    assert outs[0].replay_from == 0
    outs += [feed.on_replay([b"", b"", seq.to_bytes(8, "big"), payload(seq)], 0.0)
             for seq in range(frames)]
    outs.append(feed.on_replay(REPLAY_END, 0.0))
    outs.append(feed.on_live([b"", frames.to_bytes(8, "big"), payload(frames)], 0.0))
    return outs


def test_a_sink_gets_what_the_output_would_have_carried_in_order() -> None:
    plain = EventFeed(can_replay=True)
    expected = [item for out in replay(plain, 40) for item in out.items]
    got: list[FeedItem] = []
    sunk = EventFeed(can_replay=True, sink=got.append)
    outs = replay(sunk, 40)
    assert got == expected
    assert len([i for i in got if isinstance(i, BlocksStored)]) == 41
    assert all(out.items == () for out in outs)
    assert [out.replay_from for out in outs] == [o.replay_from for o in replay(
        EventFeed(can_replay=True), 40)]
    assert sunk.statistics().synced


def test_a_replayed_history_is_applied_one_batch_at_a_time() -> None:
    """Count the decoded stores alive whenever one reaches the sink: one (in flight),
    not the whole history."""
    alive: list[int] = []
    calls = 0

    def sink(item: FeedItem) -> None:
        nonlocal calls
        calls += 1
        if isinstance(item, BlocksStored) and calls % 25 == 1:
            alive.append(sum(isinstance(o, BlocksStored) for o in gc.get_objects()))

    replay(EventFeed(can_replay=True, sink=sink), 300)
    assert calls >= 301
    assert len(alive) >= 10
    assert max(alive) <= 2
