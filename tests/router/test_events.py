"""The router's reading of vLLM's KV event stream: decoding, sequencing, the subscriber.

Frames are built by encoding vLLM's own event classes, which is the real wire format.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import random
import socket
from collections.abc import Awaitable
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvpeer.router import events as events_module
from kvpeer.router.events import BatchDecoded, BatchRejected, decode_batch
from kvpeer.router.feed import (
    MAX_UNKNOWN_NAMES,
    OTHER_UNKNOWN,
    REPLAY_END_SEQ,
    EventFeed,
    FeedItem,
    FeedLimits,
    FeedOutput,
    StreamReset,
    StreamSynced,
    encode_replay_request,
)
from kvpeer.router.index import MEDIUM_CPU, MEDIUM_GPU, PrefixIndex
from kvpeer.router.kvevents import AllCleared, BlocksRemoved, BlocksStored, BlocksUnkeyable
from kvpeer.router.subscriber import EventSubscriber
from tests.router.conftest import until

kv_events = pytest.importorskip("vllm.distributed.kv_events")


@pytest.fixture(params=["C", "Python"])
def loops(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Decode with the C checks and joins (kvpeer.router._intake) or the Python ones."""
    if request.param == "Python":
        monkeypatch.setattr(events_module, "_native_intake", None)
    elif events_module._native_intake is None:
        pytest.skip("kvpeer.router._intake is not built")
    return str(request.param)

BS = 4
H1, H2, H3 = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32


def stored(
    hashes: list[Any], parent: Any, tokens: list[int], medium: str = "GPU", **extra: Any
) -> Any:
    fields: dict[str, Any] = {
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BS,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
    }
    fields.update(extra)
    return kv_events.BlockStored(**fields)


def removed(hashes: list[Any], medium: str = "GPU", **extra: Any) -> Any:
    return kv_events.BlockRemoved(block_hashes=hashes, medium=medium, **extra)


def batch(*events: Any, rank: int | None = None) -> bytes:
    value = kv_events.KVEventBatch(ts=1.0, events=list(events), data_parallel_rank=rank)
    return msgspec.msgpack.encode(value)


def frame(seq: int, payload: bytes) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), payload]


def replay_frame(seq: int, payload: bytes) -> list[bytes]:
    return [b"", b"", seq.to_bytes(8, "big"), payload]


REPLAY_END = [b"", b"", REPLAY_END_SEQ.to_bytes(8, "big"), b""]


def items(*outs: FeedOutput) -> tuple[FeedItem, ...]:
    """What a run of calls produced, in order (a replayed batch that follows on is applied
    as it arrives; one past a hole, when the hole is filled or the replay ends)."""
    return tuple(item for out in outs for item in out.items)


def decoded(payload: bytes) -> BatchDecoded:
    result = decode_batch(payload)
    assert isinstance(result, BatchDecoded), result
    return result


# --- decoding -----------------------------------------------------------------------------


def test_gpu_store_remove_clear_decode_to_typed_events(loops: str) -> None:
    payload = batch(
        stored([H1, H2], None, list(range(8)), extra_keys=[None, None], group_idx=0),
        removed([H1], group_idx=0),
        kv_events.AllBlocksCleared(),
        rank=0,
    )
    result = decoded(payload)
    assert result.data_parallel_rank == 0
    assert result.events == (
        BlocksStored.of_ids(MEDIUM_GPU, (H1, H2), None, tuple(range(8)), BS),
        BlocksRemoved(MEDIUM_GPU, (H1,)),
        AllCleared(),
    )


def test_int_block_hashes_decode(loops: str) -> None:
    payload = batch(stored([2**64 - 1], 7, [1, 2, 3, 4]), removed([5]))
    assert decoded(payload).events == (
        BlocksStored.of_ids(MEDIUM_GPU, (2**64 - 1,), 7, (1, 2, 3, 4), BS),
        BlocksRemoved(MEDIUM_GPU, (5,)),
    )


def test_cpu_tier_self_describing_chunk_decodes(loops: str) -> None:
    event = stored(
        [H2, H3],
        H1,
        list(range(4, 12)),
        medium="CPU",
        group_idx=0,
        kv_cache_spec_kind="full_attention",
        kv_cache_spec_sliding_window=None,
    )
    assert decoded(batch(event)).events == (
        BlocksStored.of_ids(MEDIUM_CPU, (H2, H3), H1, tuple(range(4, 12)), BS),
    )


@pytest.mark.parametrize(
    ("event", "reason"),
    [
        (stored([H1], None, [], medium="CPU", block_size=0), "placeholder"),
        (stored([H1], None, [1, 2, 3, 4], lora_id=3, lora_name="a"), "lora"),
        (stored([H1], None, [1, 2, 3, 4], extra_keys=[("salt",)]), "extra_keys"),
        (stored([H1], None, [1, 2, 3, 4], group_idx=1), "other_group"),
        (stored([H1], None, [1, 2, 3, 4], medium="CPU", ownership="kvcr"), "secondary_tier"),
        (removed([H1], group_idx=2), "other_group"),
    ],
)
def test_events_the_router_cannot_key_are_skipped_by_reason(
    event: Any, reason: str, loops: str
) -> None:
    result = decoded(batch(event, removed([H2])))
    assert result.skipped == ((reason, 1),)
    # Blocks under extra keys are named, so the index skips the CPU tier's stores of
    # them, which carry no extra keys (index invariant 6); they come first.
    named = (BlocksUnkeyable((H1,)),) if reason in ("lora", "extra_keys") else ()
    assert result.events == (*named, BlocksRemoved(MEDIUM_GPU, (H2,)))


def encode_raw(value: Any) -> bytes:
    return msgspec.msgpack.encode(value)


# --- what a newer vLLM publishes (issue 38) ----------------------------------------------

def test_unknown_trailing_fields_are_tolerated_and_counted(loops: str) -> None:
    """vLLM 0.33 added ``BlockStored.lookahead_token_ids`` (EAGLE / MTP lookahead hashing,
    on in 0.34's OffloadingConnector): a batch carrying it, or any field or batch item a
    later vLLM appends, decodes as before, and is counted under the field's name."""
    payload = encode_raw([
        1.0,
        [{**GOOD_STORED, "lookahead_token_ids": [[5, 6]]},
         {"type": "BlockRemoved", "block_hashes": [H2], "medium": "GPU", "future": {"a": 1}},
         {**GOOD_STORED, "block_hashes": [H3], "parent_block_hash": H1,
          "lookahead_token_ids": [[7, 8]]}],
        0,
        "a fourth item",
    ])
    result = decoded(payload)
    assert result.events == (
        BlocksStored.of_ids(MEDIUM_GPU, (H1,), None, (1, 2, 3, 4), BS),
        BlocksRemoved(MEDIUM_GPU, (H2,)),
        BlocksStored.of_ids(MEDIUM_GPU, (H3,), H1, (1, 2, 3, 4), BS),
    )
    # counted once a batch, by the first the decoder met
    assert result.unknown_fields == (("BlockStored.lookahead_token_ids", 1),)
    assert result.data_parallel_rank == 0
    removal = encode_raw([1.0, [{"type": "BlockRemoved", "block_hashes": [H2],
                                 "medium": "GPU", "future": 1}]])  # fmt: skip
    assert decoded(removal).unknown_fields == (("BlockRemoved.future", 1),)
    trailing = encode_raw([1.0, [GOOD_STORED], 0, "a fourth item", "a fifth"])
    assert decoded(trailing).unknown_fields == (("KVEventBatch[3]", 1),)
    # a batch of only known fields reports none
    assert decoded(encode_raw([1.0, [GOOD_STORED]])).unknown_fields == ()


def test_vllms_own_lookahead_store_decodes(loops: str) -> None:
    """The struct of the vLLM under test, with lookahead tokens where it has them (0.33+)."""
    if "lookahead_token_ids" not in kv_events.BlockStored.__struct_fields__:
        pytest.skip("this vLLM (0.32) publishes no lookahead_token_ids")
    event = stored([H1], None, [1, 2, 3, 4], medium="CPU", group_idx=0,
                   lookahead_token_ids=[[9, 9]])
    result = decoded(batch(event, rank=0))
    assert result.events == (BlocksStored.of_ids(MEDIUM_CPU, (H1,), None, (1, 2, 3, 4), BS),)
    assert result.unknown_fields == (("BlockStored.lookahead_token_ids", 1),)


def test_a_feed_counts_unknown_fields() -> None:
    feed = EventFeed(can_replay=False)
    payload = encode_raw([1.0, [{**GOOD_STORED, "lookahead_token_ids": [[5]]}]])
    feed.on_live(frame(0, payload), 0.0)
    feed.on_live(frame(1, payload), 0.0)
    assert feed.statistics().unknown_fields == (("BlockStored.lookahead_token_ids", 2),)


def test_an_engine_naming_endless_new_fields_is_counted_in_bounded_memory() -> None:
    """The names are an engine's bytes and become metric labels: a bounded few are kept,
    the rest counted under one name."""
    feed = EventFeed(can_replay=False)
    for seq in range(MAX_UNKNOWN_NAMES + 40):
        payload = encode_raw([1.0, [{**GOOD_STORED, f"field_{seq}": 1}]])
        feed.on_live(frame(seq, payload), 0.0)
    names = dict(feed.statistics().unknown_fields)
    assert len(names) == MAX_UNKNOWN_NAMES + 1
    assert names[OTHER_UNKNOWN] == 40
    assert sum(names.values()) == MAX_UNKNOWN_NAMES + 40


def test_state_checkpoints_of_a_recurrent_group_are_skipped(loops: str) -> None:
    """vLLM 0.34's hybrid (Mamba / linear-attention) models publish a state checkpoint as
    one hash, its parent and no tokens, ``kv_cache_spec_kind="mamba"``: skipped by its
    group's kind (whatever its group index), not a reason to reject the batch, and the
    attention group's stores in the same batch are learned."""
    payload = batch(
        stored([H1, H2], None, list(range(8)), medium="CPU", group_idx=0,
               kv_cache_spec_kind="full_attention"),
        stored([H3], H2, [], medium="CPU", group_idx=1, kv_cache_spec_kind="mamba"),
        stored([H3], H2, [], medium="CPU", group_idx=0, kv_cache_spec_kind="mamba"),
    )
    result = decoded(payload)
    assert result.skipped == (("state_checkpoint", 2),)
    assert result.events == (
        BlocksStored.of_ids(MEDIUM_CPU, (H1, H2), None, tuple(range(8)), BS),
    )
    # its tokens, were there any, are still checked, and an attention group's token-less
    # store is still malformed
    bad = encode_raw([1.0, [{**GOOD_STORED, "kv_cache_spec_kind": "mamba", "token_ids": [-1]}]])
    assert decode_batch(bad) == BatchRejected(
        "invalid_schema", "event 0: token_ids: token id 0 is negative"
    )
    attention = batch(stored([H3], H2, [], medium="CPU", kv_cache_spec_kind="full_attention"))
    rejected = decode_batch(attention)
    assert isinstance(rejected, BatchRejected)
    assert rejected.reason == "token_count_mismatch"


GOOD_STORED = {
    "type": "BlockStored",
    "block_hashes": [H1],
    "parent_block_hash": None,
    "token_ids": [1, 2, 3, 4],
    "block_size": 4,
    "lora_id": None,
    "medium": "GPU",
    "lora_name": None,
}


def deeply_nested() -> bytes:
    """A store whose extra_keys nest two million arrays deep: must not recurse out."""
    marker = "nest-here"
    flat = encode_raw([1.0, [{**GOOD_STORED, "extra_keys": [[marker]]}]])
    return flat.replace(encode_raw(marker), b"\x91" * 2_000_000 + b"\xc0")


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"\xc1garbage", "undecodable"),
        (encode_raw({"not": "a batch"}), "invalid_schema"),
        # a field a newer vLLM added is tolerated; one kvpeer knows is checked all the same
        (encode_raw([1.0, [{**GOOD_STORED, "surprise": 1, "block_size": "4"}]]),
         "invalid_schema"),
        (encode_raw([1.0, [{**GOOD_STORED, "surprise": 1, "token_ids": [1, 2, 3]}]]),
         "token_count_mismatch"),
        (encode_raw([1.0, [{**GOOD_STORED, "type": "BlockExploded"}]]), "invalid_schema"),
        (encode_raw([1.0, [{**GOOD_STORED, "block_hashes": [b"x" * 65]}]]), "invalid_schema"),
        (encode_raw([1.0, [{**GOOD_STORED, "token_ids": [-1, 2, 3, 4]}]]), "invalid_schema"),
        (encode_raw([1.0, [{**GOOD_STORED, "token_ids": [1, 2, 3, 1 << 32]}]]), "invalid_schema"),
        (encode_raw([1.0, [{**GOOD_STORED, "token_ids": [1, 2.0, 3, 4]}]]), "invalid_schema"),
        (encode_raw([1.0, [{**GOOD_STORED, "token_ids": {"1": 2}}]]), "invalid_schema"),
        (encode_raw([1.0, [{**GOOD_STORED, "token_ids": None}]]), "invalid_schema"),
        # a store the router skips is checked all the same: the batch is malformed whole
        (encode_raw([1.0, [{**GOOD_STORED, "lora_id": 3, "token_ids": [1, 2, 3, -4]}]]),
         "invalid_schema"),
        (encode_raw([1.0, [{**GOOD_STORED, "token_ids": [1, 2, 3]}]]), "token_count_mismatch"),
        (encode_raw([1.0, [{**GOOD_STORED, "block_hashes": []}]]), "empty_store"),
        (encode_raw([1.0, [GOOD_STORED], -1, "extra"]), "invalid_schema"),
        (b"\x00" * (16 << 20 | 1), "payload_too_large"),
        (deeply_nested(), "too_deep"),
    ],
)
def test_malformed_payloads_are_rejected_with_a_reason(
    payload: bytes, reason: str, loops: str
) -> None:
    result = decode_batch(payload)
    assert isinstance(result, BatchRejected)
    assert result.reason == reason


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_decode_never_raises_on_arbitrary_bytes(payload: bytes) -> None:
    assert isinstance(decode_batch(payload), BatchDecoded | BatchRejected)


_hash_st = st.sampled_from([H1, H2, H3, 7, 8, 2**63])
_token_st = st.integers(0, 2**32 - 1) | st.sampled_from(
    [-1, 2**32, 2**64 - 1, -(2**63), 1.0, None, "1", b"\x01", [1], True]
)
_event_st = st.one_of(
    st.builds(
        lambda hashes, parent, tokens, size, medium: stored(
            hashes, parent, tokens[: BS * len(hashes) + size], medium
        ),
        st.lists(_hash_st, min_size=1, max_size=3),
        st.none() | _hash_st,
        st.lists(st.integers(0, 2**32 - 1), min_size=13, max_size=13)
        | st.lists(_token_st, min_size=13, max_size=13),
        st.sampled_from([0, 0, 0, -1, 1]),  # tokens for every block, one short, one over
        st.sampled_from(["GPU", "CPU"]),
    ),
    st.builds(removed, st.lists(_hash_st, min_size=1, max_size=3), st.sampled_from(["GPU", "CPU"])),
    st.just(kv_events.AllBlocksCleared()),
)
_edit_st = st.tuples(
    st.sampled_from(["set", "insert", "delete", "cut"]), st.integers(0, 10**6), st.integers(0, 255)
)


def _mutated(payload: bytes, edits: list[tuple[str, int, int]]) -> bytes:
    data = bytearray(payload)
    for op, at, value in edits:
        if not data:
            break
        where = at % len(data)
        if op == "set":
            data[where] = value
        elif op == "insert":
            data.insert(where, value)
        elif op == "delete":
            del data[where]
        else:
            del data[where:]
    return bytes(data)


@pytest.mark.skipif(events_module._native_intake is None, reason="_intake is not built")
@settings(max_examples=1500, deadline=None)
@given(st.lists(_event_st, min_size=1, max_size=6), st.lists(_edit_st, max_size=3))
@example([kv_events.AllBlocksCleared()], [("set", 25937, 127), ("set", 26113, 241)])  # ts NaN
def test_a_damaged_batch_decodes_alike_in_c_and_in_python(
    events: list[Any], edits: list[tuple[str, int, int]]
) -> None:
    """Batches as vLLM encodes them, with token ids that are not (negative, too large,
    floats, nil, strings, lists; one too few or too many), damaged byte by byte (a byte
    changed, inserted or deleted, the rest cut): the C intake (token parser,
    translation) decides as the Python one does, the same events or the same reason
    and detail, and neither raises."""
    payload = _mutated(batch(*events), edits)
    in_c = decode_batch(payload)
    native, events_module._native_intake = events_module._native_intake, None
    try:
        in_python = decode_batch(payload)
    finally:
        events_module._native_intake = native
    if (
        isinstance(in_c, BatchDecoded)
        and isinstance(in_python, BatchDecoded)
        and math.isnan(in_c.ts)
        and math.isnan(in_python.ts)
    ):  # a damaged timestamp read as NaN by both: NaN != NaN
        in_c, in_python = dataclasses.replace(in_c, ts=0.0), dataclasses.replace(in_python, ts=0.0)
    assert in_c == in_python


def test_a_large_bad_token_array_keeps_msgspecs_words_without_c(loops: str) -> None:
    """Past FAULT_NAMED_BYTES the Python path does not scan a refused array again (a
    million ids cost 0.3 s in Python, 0.04 s in msgspec): the same reason, msgspec's
    detail. Below it, the C parser's words either way."""
    small = decode_batch(batch(stored([H1], None, [1, 2, 3, -1])))
    assert isinstance(small, BatchRejected)
    assert small.detail == "event 0: token_ids: token id 3 is negative"
    blocks = events_module.FAULT_NAMED_BYTES // (3 * BS) + 1  # ids of 3 bytes (uint16)
    ids = [*range(300, 300 + blocks * BS - 1), -1]
    large = decode_batch(batch(stored([H1] * blocks, None, ids)))
    assert isinstance(large, BatchRejected)
    assert large.reason == "invalid_schema"
    if loops == "C":
        assert large.detail.endswith(f"token id {len(ids) - 1} is negative")
    else:
        assert "Expected `int` >= 0" in large.detail


# --- sequencing (sans-IO feed) -------------------------------------------------------------

P0 = batch(stored([H1], None, [1, 2, 3, 4]))
P1 = batch(stored([H2], H1, [5, 6, 7, 8]))
P2 = batch(removed([H1]))
P3 = batch(kv_events.AllBlocksCleared())
RESTARTED = StreamReset("restart", restarted=True)


def test_in_order_stream_syncs_then_yields_events() -> None:
    feed = EventFeed(can_replay=False)
    first = feed.on_live(frame(0, P0), now=0.0)
    assert first.items[0] == StreamSynced()
    assert first.items[1:] == (BlocksStored.of_ids(MEDIUM_GPU, (H1,), None, (1, 2, 3, 4), BS),)
    assert feed.on_live(frame(1, P1), 0.0).items == decoded(P1).events
    assert feed.on_live(frame(2, P3), 0.0).items == (AllCleared(),)
    assert feed.statistics().batches_applied == 3


def test_gap_requests_replay_and_applies_in_order_after_it() -> None:
    feed = EventFeed(can_replay=True)
    feed.on_live(frame(0, P0), 0.0)
    out = feed.on_live(frame(3, P3), 0.0)  # 1 and 2 were lost
    assert out == FeedOutput(replay_from=1)
    assert feed.on_live(frame(4, P0), 0.0).items == ()  # buffered while replaying
    outs = [feed.on_replay(replay_frame(seq, p), 0.0) for seq, p in ((1, P1), (2, P2), (3, P3))]
    done = feed.on_replay(REPLAY_END, 0.0)  # 3 was also buffered live
    assert done.replay_from is None
    assert items(*outs, done) == (
        *decoded(P1).events,
        *decoded(P2).events,
        *decoded(P3).events,
        *decoded(P0).events,
    )
    assert feed.statistics().next_seq == 5
    assert feed.on_live(frame(5, P1), 0.0).items == decoded(P1).events


def test_unreplayable_gap_forgets_before_continuing() -> None:
    feed = EventFeed(can_replay=False)
    feed.on_live(frame(0, P0), 0.0)
    out = feed.on_live(frame(2, P1), 0.0)
    assert out.items == (StreamReset("gap", restarted=False), StreamSynced(), *decoded(P1).events)
    assert feed.statistics().gaps == 1


def test_replay_that_misses_the_lost_batches_forgets() -> None:
    feed = EventFeed(can_replay=True)
    feed.on_live(frame(0, P0), 0.0)
    assert feed.on_live(frame(5, P1), 0.0).replay_from == 1
    first = feed.on_replay(replay_frame(4, P2), 0.0)  # the publisher's buffer starts at 4
    out = feed.on_replay(REPLAY_END, 0.0)
    assert items(first, out) == (
        StreamReset("gap", restarted=False),
        *decoded(P2).events,
        StreamSynced(),  # learned again at the replay's end
        *decoded(P1).events,
    )
    assert feed.statistics().replays_reasked == 0  # nothing more to ask for


def test_replay_timeout_applies_what_arrived() -> None:
    feed = EventFeed(can_replay=True, limits=FeedLimits(replay_timeout_s=2.0))
    feed.on_live(frame(0, P0), 0.0)
    feed.on_live(frame(2, P2), 10.0)
    assert feed.next_deadline() == 12.0
    assert feed.poll(11.9).items == ()
    out = feed.poll(12.0)
    assert out.items[0] == StreamReset("gap", restarted=False)
    assert feed.statistics().replays_incomplete == 1
    assert feed.next_deadline() is None


def test_seq_going_back_is_an_engine_restart() -> None:
    feed = EventFeed(can_replay=False)
    feed.on_live(frame(0, P0), 0.0)
    feed.on_live(frame(1, P1), 0.0)
    out = feed.on_live(frame(0, P2), 0.0)
    assert out.items == (RESTARTED, StreamSynced(), *decoded(P2).events)
    assert feed.statistics().restarts == 1


def test_first_frame_mid_stream_replays_history_from_zero() -> None:
    feed = EventFeed(can_replay=True)
    assert feed.on_live(frame(2, P2), 0.0) == FeedOutput(replay_from=0)
    outs = [feed.on_replay(replay_frame(0, P0), 0.0), feed.on_replay(replay_frame(1, P1), 0.0)]
    outs.append(feed.on_replay(REPLAY_END, 0.0))
    assert items(*outs) == (*decoded(P0).events, *decoded(P1).events, StreamSynced(),
                            *decoded(P2).events)


def test_start_replays_history_and_an_empty_history_is_learned() -> None:
    feed = EventFeed(can_replay=True)
    assert feed.start(0.0) == FeedOutput(replay_from=0)
    assert feed.on_replay(REPLAY_END, 0.0).items == (StreamSynced(),)
    assert feed.on_live(frame(0, P0), 0.0).items == decoded(P0).events
    assert feed.on_replay(REPLAY_END, 0.0) == FeedOutput()  # nobody asked: counted
    assert ("replay_unexpected", 1) in feed.statistics().dropped


def test_restart_while_replaying_abandons_the_replay() -> None:
    feed = EventFeed(can_replay=True)
    feed.on_live(frame(0, P0), 0.0)
    feed.on_live(frame(7, P1), 0.0)  # gap: replay from 1
    out = feed.on_live(frame(0, P2), 0.0)  # the engine started over
    assert out.items == (RESTARTED, StreamSynced(), *decoded(P2).events)
    assert not feed.statistics().replaying


def test_malformed_frames_are_counted_not_raised() -> None:
    feed = EventFeed(can_replay=False)
    feed.on_live(frame(0, P0), 0.0)
    assert feed.on_live([b"only-two", b"parts"], 0.0) == FeedOutput()
    assert feed.on_live([b"", b"\x00\x01", P1], 0.0) == FeedOutput()
    assert feed.on_live([b"", REPLAY_END_SEQ.to_bytes(8, "big"), P1], 0.0) == FeedOutput()
    out = feed.on_live(frame(1, b"\xc1not msgpack"), 0.0)
    assert out.items == (StreamReset("gap", restarted=False), StreamSynced())
    dropped = dict(feed.statistics().dropped)
    assert dropped == {"bad_frame_count": 1, "bad_seq": 2, "undecodable": 1}
    assert feed.on_live(frame(2, P1), 0.0).items == decoded(P1).events


def test_replay_buffers_are_bounded() -> None:
    feed = EventFeed(can_replay=True, limits=FeedLimits(max_buffered_frames=2))
    feed.on_live(frame(0, P0), 0.0)
    feed.on_live(frame(2, P2), 0.0)  # gap
    feed.on_live(frame(3, P3), 0.0)
    out = feed.on_live(frame(4, P1), 0.0)  # third buffered frame: give up on the replay
    assert out.items[0] == StreamReset("gap", restarted=False)
    assert ("live_over_limit", 1) in feed.statistics().dropped
    assert not feed.statistics().replaying


# --- the subscriber on real sockets --------------------------------------------------------


async def within(awaitable: Awaitable[Any], timeout: float = 10.0) -> Any:
    return await asyncio.wait_for(awaitable, timeout)


def test_subscriber_follows_publisher_replays_gap_and_sees_restart() -> None:
    asyncio.run(_subscriber_scenario())


async def _subscriber_scenario() -> None:
    ctx = zmq.asyncio.Context()
    # XPUB is PUB on the wire, and tells us when the subscription arrived.
    pub = ctx.socket(zmq.XPUB)
    router = ctx.socket(zmq.ROUTER)
    for sock in (pub, router):
        sock.setsockopt(zmq.LINGER, 0)
    pub.bind("tcp://127.0.0.1:*")
    router.bind("tcp://127.0.0.1:*")
    index = PrefixIndex(block_size=BS)
    sub = EventSubscriber(
        "e0",
        pub.getsockopt_string(zmq.LAST_ENDPOINT),
        index,
        replay_endpoint=router.getsockopt_string(zmq.LAST_ENDPOINT),
        context=ctx,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(sub.run(stop))
    try:
        # On start the subscriber asks for the history: the publisher has none yet.
        ident, empty, start = await within(router.recv_multipart())
        assert [empty, start] == encode_replay_request(0)
        await router.send_multipart([ident, *REPLAY_END])
        assert (await within(pub.recv()))[0] == 1  # subscribed

        prompt = [1, 2, 3, 4, 5, 6, 7, 8]
        keys = index.keys(prompt)
        await pub.send_multipart(frame(0, P0))
        await until(lambda: index.longest_prefix("e0", keys, MEDIUM_GPU, 0.0) == 4, "seq 0")

        # seq 1 is lost; seq 2 shows the gap; the subscriber asks to replay from 1.
        gap = batch(stored([H3], H2, [9, 10, 11, 12]))
        await pub.send_multipart(frame(2, gap))
        ident, _, start = await within(router.recv_multipart())
        assert int.from_bytes(start, "big") == 1
        await router.send_multipart([ident, *replay_frame(1, P1)])
        await router.send_multipart([ident, *replay_frame(2, gap)])
        await router.send_multipart([ident, *REPLAY_END])
        longer = index.keys([*prompt, 9, 10, 11, 12])
        await until(
            lambda: index.longest_prefix("e0", longer, MEDIUM_GPU, 0.0) == 12, "replayed"
        )
        assert sub.statistics().replays_completed == 2

        # The engine restarts: seq 0 again, holding something else.
        other = batch(stored([b"\x09" * 32], None, [40, 41, 42, 43]))
        await pub.send_multipart(frame(0, other))
        await until(lambda: sub.statistics().restarts == 1, "restart")
        assert index.longest_prefix("e0", longer, MEDIUM_GPU, 0.0) == 0
        assert index.longest_prefix("e0", index.keys([40, 41, 42, 43]), MEDIUM_GPU, 0.0) == 4
        assert index.learned("e0")
    finally:
        stop.set()
        await within(task)
        pub.close()
        router.close()
        ctx.term()


def test_start_after_live_batches_asks_only_for_what_follows_them() -> None:
    feed = EventFeed(can_replay=True)
    feed.on_live(frame(0, P0), 0.0)
    assert feed.start(0.0) == FeedOutput(replay_from=1)


SLOW_JOIN_S = 0.3  # how long the publisher is out of the subscriber's reach


def test_a_batch_published_while_the_subscription_is_on_its_way_is_learned() -> None:
    """The slow joiner: a PUB socket sends a batch only to the subscriptions it holds. A
    replay answered before the subscription reached the publisher, then a batch, then the
    subscription, then a quiet engine: the batch is in neither, and nothing later shows
    the gap. The subscriber asks for its history only once its SUB connection is up."""
    asyncio.run(_slow_join_scenario())


async def _slow_join_scenario() -> None:
    ctx = zmq.asyncio.Context()
    replay = ctx.socket(zmq.ROUTER)
    replay.setsockopt(zmq.LINGER, 0)
    replay.bind("tcp://127.0.0.1:*")
    with socket.socket() as probe:  # a port the PUB binds only later
        probe.bind(("127.0.0.1", 0))
        pub_endpoint = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    published = [(0, P0)]  # vLLM's replay buffer
    answered = asyncio.Event()

    async def serve_replays() -> None:  # vLLM's ZmqEventPublisher._service_replay
        while True:
            ident, empty, start = await replay.recv_multipart()
            assert not empty
            for seq, payload in list(published):
                if seq >= int.from_bytes(start, "big"):
                    await replay.send_multipart([ident, *replay_frame(seq, payload)])
            await replay.send_multipart([ident, *REPLAY_END])
            answered.set()

    index = PrefixIndex(block_size=BS)
    sub = EventSubscriber("e0", pub_endpoint, index,
                          replay_endpoint=replay.getsockopt_string(zmq.LAST_ENDPOINT),
                          context=ctx)
    stop = asyncio.Event()
    server = asyncio.create_task(serve_replays())
    task = asyncio.create_task(sub.run(stop))
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    try:
        # The engine stores its next batch while the subscription is still on its way:
        # right after a replay answer, if one came that early.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(answered.wait(), SLOW_JOIN_S)
        published.append((1, P1))  # no subscriber reached the PUB: sent to nobody
        pub.bind(pub_endpoint)
        assert (await within(pub.recv()))[0] == 1  # subscribed; the engine is quiet now
        keys = index.keys([1, 2, 3, 4, 5, 6, 7, 8])
        await until(lambda: index.longest_prefix("e0", keys, MEDIUM_GPU, 0.0) == 8,
                    "batch 1, published before the subscription arrived", timeout=5.0)
        assert sub.statistics().replays_completed == 1
    finally:
        stop.set()
        await within(task)
        server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await server
        pub.close()
        replay.close()
        ctx.term()


def test_stores_are_ordered_parents_first_within_a_run(loops: str) -> None:
    child = stored([H3], H2, [9, 10, 11, 12], medium="CPU")
    parent = stored([H2], H1, [5, 6, 7, 8], medium="CPU")
    root = stored([H1], None, [1, 2, 3, 4], medium="CPU")
    events = decoded(batch(child, parent, removed([H1]), root)).events
    # parent then child, joined into one chain; the removal stays between the runs
    assert events == (
        BlocksStored.of_ids("CPU", (H2, H3), H1, (5, 6, 7, 8, 9, 10, 11, 12), 4),
        BlocksRemoved("GPU", (H1,)),
        BlocksStored.of_ids("CPU", (H1,), None, (1, 2, 3, 4), 4),
    )


def test_a_prompt_stored_block_by_block_in_any_order_is_one_chain(loops: str) -> None:
    """vLLM's CPU tier announces each block in an event of its own, in any order: the
    index gets one store per chain, and holds what the blocks one by one would give."""
    rng = random.Random(5)
    hashes = [bytes([i]) * 8 for i in range(1, 17)]
    tokens = [list(range(4 * i, 4 * i + 4)) for i in range(16)]
    events = [stored([h], hashes[i - 1] if i else None, tokens[i], medium="CPU")
              for i, h in enumerate(hashes)]
    rng.shuffle(events)
    joined = decoded(batch(*events)).events
    assert joined == (
        BlocksStored.of_ids("CPU", tuple(hashes), None, tuple(t for ts in tokens for t in ts), 4),
    )
    one_by_one = PrefixIndex(4, native=False)
    together = PrefixIndex(4)
    for index in (one_by_one, together):
        index.apply("e0", StreamSynced())
    for i, h in enumerate(hashes):
        one_by_one.apply("e0", BlocksStored.of_ids("CPU", (h,), hashes[i - 1] if i else None,
                                                   tuple(tokens[i]), 4))
    for event in joined:
        together.apply("e0", event)
    prompt = together.keys([t for ts in tokens for t in ts])
    assert together.prefixes(prompt, "CPU", 0.0) == one_by_one.prefixes(prompt, "CPU", 0.0)
    assert together.prefixes(prompt, "CPU", 0.0) == {"e0": 64}


def test_only_a_store_continuing_the_last_block_of_the_same_medium_and_size_joins(
    loops: str,
) -> None:
    root = stored([H1, H2], None, list(range(8)), medium="CPU")
    after_middle = stored([H3], H1, [9, 9, 9, 9], medium="CPU")  # parent is not the last
    other_medium = stored([H3], H2, [9, 9, 9, 9], medium="GPU")
    other_size = stored([H3], H2, [9, 9, 9, 9, 9, 9, 9, 9], medium="CPU", block_size=8)
    for follower in (after_middle, other_medium, other_size):
        assert len(decoded(batch(root, follower)).events) == 2


def test_a_hostile_parent_cycle_terminates(loops: str) -> None:
    a = stored([H1], H2, [1, 2, 3, 4])
    b = stored([H2], H1, [5, 6, 7, 8])
    events = decoded(batch(a, b)).events
    assert sorted(h for e in events if isinstance(e, BlocksStored) for h in e.block_hashes) \
        == sorted([H1, H2])
