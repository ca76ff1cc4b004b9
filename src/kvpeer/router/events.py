"""Decoding of vLLM's KV event stream into the router's own typed events.

vLLM (0.32) publishes one msgpack ``KVEventBatch`` per scheduler step that changed the
KV cache: an array ``[ts, events, data_parallel_rank?]`` whose events are maps tagged by
``"type"``: ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``. The GPU prefix cache
publishes them with ``medium="GPU"``; the offloading connector's CPU primary tier with
``medium="CPU"`` -- and only with ``self_describing_kv_events`` do its stores carry
token ids, the parent hash and the block size (otherwise one placeholder hash with no
tokens, which nobody outside that process can place in a prefix).

We decode with our own msgspec structs that check every field they know (wrong types,
oversized lists are rejected with a named reason) and translate each batch into the
router's events (:mod:`~kvpeer.router.kvevents`): :class:`BlocksStored` /
:class:`BlocksRemoved` / :class:`AllCleared`. A newer vLLM adds
fields (0.33: ``BlockStored.lookahead_token_ids``); those are tolerated and counted by
name (:attr:`BatchDecoded.unknown_fields`), never read. Invariants:

1. :func:`decode_batch` never raises on any input: it returns :class:`BatchRejected` with
   a reason from :data:`REJECT_REASONS`.
2. A batch is rejected whole when any event in it is malformed (a partial batch would
   silently lose a removal: the feed treats a rejected batch like a lost one).
3. Events the router cannot use are *skipped* with a reason, not rejected: placeholder
   stores, blocks keyed by extra keys (LoRA, multimodal, cache salt) the router cannot
   see in a prompt, KV-cache groups other than group 0, and stores of secondary tiers
   (``ownership`` set), which are not the CPU primary region kvpeer peers pull from.
4. Block hashes stay opaque (``bytes`` or ``int``): they are salted per engine process,
   so the index maps them onto token content rather than recomputing them.
5. A store's token ids stay msgpack until checked and packed (``_packed_tokens``: every
   store's, skipped ones too), and the per-event work after msgspec (joining, checking,
   skipping, ordering) runs in ``kvpeer.router._intake.translate`` when the extension is
   built; :func:`_translate` is its reference, compared event for event on random
   batches (``tests/router/test_index_native.py``). At 256 engines, 432,000 wire events
   a second, the Python loop and the Python int of every token id were a third of the
   intake (``docs/scale.md``, session 21).
6. Fields the wire structs do not know (an event's map keys, items after the batch's
   third) never reject a batch: the strict decoder refuses it, the same structs without
   ``forbid_unknown_fields`` decode it (every known field checked as strictly), and the
   batch is counted under the first unknown name the strict decoder met (one count per
   batch: listing every key of every event cost 4x the decode, 263 us for a 128-event
   batch). Only such batches pay the second decode (+25 %); a field kvpeer relies on that
   changed its type still rejects the batch.
"""

from __future__ import annotations

import re
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Annotated, Any, Final

import msgspec

from kvpeer.router.kvevents import (
    AllCleared,
    BlockHash,
    BlocksRemoved,
    BlocksStored,
    BlocksUnkeyable,
    KVEvent,
)

_native_intake: ModuleType | None
try:  # the run of stores joined in C, when built (setup.py; index.py's loops likewise)
    from kvpeer.router import _intake as _native_intake
except ImportError:  # pragma: no cover - a machine without a C compiler
    _native_intake = None

__all__ = [
    "MAX_PAYLOAD_BYTES",
    "REJECT_REASONS",
    "SKIP_REASONS",
    "BatchDecoded",
    "BatchRejected",
    "decode_batch",
]

MAX_PAYLOAD_BYTES: Final = 16 << 20  # one step's batch; far above what a step emits
MAX_EVENTS_PER_BATCH: Final = 65_536
MAX_HASHES_PER_EVENT: Final = 16_384
MAX_TOKENS_PER_EVENT: Final = 1 << 20
MAX_HASH_BYTES: Final = 64  # sha256 is 32; leave room, but not for an attacker's megabyte
MAX_BLOCK_SIZE: Final = 1 << 16
MAX_TOKEN_ID: Final = (1 << 32) - 1
MAX_INT_HASH: Final = (1 << 64) - 1
MAX_SHORT_STR: Final = 256
MAX_EXTRA_ITEMS: Final = 64

REJECT_REASONS: Final = (
    "payload_too_large",
    "undecodable",  # not msgpack at all
    "invalid_schema",  # msgpack, but not the shape vLLM emits (types, fields, bounds)
    "token_count_mismatch",  # len(token_ids) != len(block_hashes) * block_size
    "hash_out_of_range",  # a label only: msgpack cannot carry an int hash above 2**64 - 1
    "empty_store",
    "too_deep",
)
SKIP_REASONS: Final = (
    "placeholder",  # an offloaded store without self-describing payload
    "extra_keys",  # hash depends on LoRA / multimodal / cache salt: not token-keyable
    "lora",
    "other_group",  # KV-cache group other than 0
    "secondary_tier",  # ownership set: a secondary tier's store, not the CPU primary
    "state_checkpoint",  # a recurrent (Mamba) group's store: a state, not token blocks
)
#: The KV-cache group kinds whose stores are states, not token blocks (vLLM's
#: ``KVCacheSpecKind.MAMBA``; the C intake compares the same string).
RECURRENT_KINDS: Final = frozenset({"mamba"})

# --- wire shapes (vLLM 0.32), private -------------------------------------------------

_Hash = Annotated[bytes, msgspec.Meta(max_length=MAX_HASH_BYTES)] | Annotated[
    int, msgspec.Meta(ge=0)
]  # <= MAX_INT_HASH without a check: msgpack has no integer above 2**64 - 1
_Str = Annotated[str, msgspec.Meta(max_length=MAX_SHORT_STR)]
_Token = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]
# vLLM publishes extra keys untagged: bare LoRA names, cache salts and prompt-embeds
# digests (str or bytes), and (mm_identifier, offset) pairs. msgpack cannot tell the
# router's unions str from bytes apart, and their content only matters as "not None"
# (such blocks are skipped), so the items stay opaque; nesting depth is guarded by
# msgspec (RecursionError, caught in decode_batch).
_ExtraKeys = Annotated[
    list[Annotated[tuple[Any, ...], msgspec.Meta(max_length=MAX_EXTRA_ITEMS)] | None],
    msgspec.Meta(max_length=MAX_HASHES_PER_EVENT),
]
# A tuple, not a list: the collector untracks a tuple of bytes or ints, where every list
# of 228,000 removals a second stayed tracked and set off its collections.
_Hashes = Annotated[tuple[_Hash, ...], msgspec.Meta(max_length=MAX_HASHES_PER_EVENT)]


# gc=False: msgpack cannot express a reference cycle, so the collector need not track the
# 400,000 wire events a second of a 256-engine fleet (nor be set off by them).
class _WireStored(
    msgspec.Struct, tag="BlockStored", forbid_unknown_fields=True, frozen=True, gc=False
):
    block_hashes: _Hashes
    parent_block_hash: _Hash | None
    # Kept as its msgpack bytes and checked and packed by _packed_tokens (in C when built):
    # decoded, each token id became a Python int that the index packed again, a third of
    # msgspec's decoding time at 256 engines (docs/scale.md, session 21).
    token_ids: msgspec.Raw
    block_size: Annotated[int, msgspec.Meta(ge=0, le=MAX_BLOCK_SIZE)]
    lora_id: int | None
    medium: _Str | None
    lora_name: _Str | None
    extra_keys: _ExtraKeys | None = None
    group_idx: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)] | None = None
    kv_cache_spec_kind: _Str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: _Str | None = None
    ownership: _Str | None = None
    session_id: _Str | None = None


class _WireRemoved(
    msgspec.Struct, tag="BlockRemoved", forbid_unknown_fields=True, frozen=True, gc=False
):
    block_hashes: _Hashes
    medium: _Str | None
    group_idx: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)] | None = None
    locality: _Str | None = None
    ownership: _Str | None = None


class _WireCleared(
    msgspec.Struct, tag="AllBlocksCleared", forbid_unknown_fields=True, frozen=True
):
    pass


class _WireBatch(msgspec.Struct, array_like=True, forbid_unknown_fields=True, frozen=True):
    ts: float
    events: Annotated[
        list[_WireStored | _WireRemoved | _WireCleared],
        msgspec.Meta(max_length=MAX_EVENTS_PER_BATCH),
    ]
    data_parallel_rank: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)] | None = None


# The same shapes without forbid_unknown_fields (invariant 6): every field declared above
# is inherited and checked alike; a field a newer vLLM added is skipped unread.
class _LenientStored(
    _WireStored, tag="BlockStored", forbid_unknown_fields=False, frozen=True, gc=False
):
    pass


class _LenientRemoved(
    _WireRemoved, tag="BlockRemoved", forbid_unknown_fields=False, frozen=True, gc=False
):
    pass


class _LenientCleared(
    _WireCleared, tag="AllBlocksCleared", forbid_unknown_fields=False, frozen=True
):
    pass


class _LenientBatch(msgspec.Struct, array_like=True, frozen=True):
    ts: float
    events: Annotated[
        list[_LenientStored | _LenientRemoved | _LenientCleared],
        msgspec.Meta(max_length=MAX_EVENTS_PER_BATCH),
    ]
    data_parallel_rank: Annotated[int, msgspec.Meta(ge=0, le=1 << 16)] | None = None


_WireEvent = _WireStored | _WireRemoved | _WireCleared


#: Skipped stores whose blocks are named to the index (:class:`BlocksUnkeyable`).
UNKEYABLE_REASONS: Final = frozenset({"extra_keys", "lora"})

# msgspec decoders are immutable and thread-safe once built: sharing one is not state.
_DECODER: Final = msgspec.msgpack.Decoder(_WireBatch)
_LENIENT: Final = msgspec.msgpack.Decoder(_LenientBatch)

# --- what decoding returns -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BatchDecoded:
    ts: float
    data_parallel_rank: int | None
    events: tuple[KVEvent, ...]
    skipped: tuple[tuple[str, int], ...]  # (reason, count) of events left out
    # (("BlockStored.lookahead_token_ids", 1),): the first field this decoder does not
    # know, tolerated unread (invariant 6); "KVEventBatch[3]": items after the third
    unknown_fields: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True, slots=True)
class BatchRejected:
    reason: str  # one of REJECT_REASONS
    detail: str  # for a log line; bounded


# What kvpeer.router._intake.translate checks the wire events against and builds.
_CLASSES: Final = (
    _WireStored, _WireRemoved, _WireCleared, BlocksStored, BlocksRemoved, AllCleared,
    BlocksUnkeyable,
)
_LENIENT_CLASSES: Final = (_LenientStored, _LenientRemoved, _LenientCleared, *_CLASSES[3:])


def decode_batch(payload: bytes | memoryview) -> BatchDecoded | BatchRejected:
    """Decode one published payload. Never raises (invariant 1)."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        return BatchRejected("payload_too_large", f"{len(payload)} bytes")
    classes: tuple[type, ...] = _CLASSES
    unknown: tuple[tuple[str, int], ...] = ()
    try:
        wire: _WireBatch | _LenientBatch = _DECODER.decode(payload)
    except msgspec.ValidationError as exc:
        try:  # invariant 6: fields a newer vLLM added, or a real fault
            wire = _LENIENT.decode(payload)
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
            return BatchRejected("invalid_schema", str(exc)[:200])
        unknown = ((_unknown_name(str(exc), wire), 1),)
        classes = _LENIENT_CLASSES
    except msgspec.DecodeError as exc:
        return BatchRejected("undecodable", str(exc)[:200])
    except RecursionError:  # msgspec's own depth guard: nesting no vLLM event has
        return BatchRejected("too_deep", "nesting")
    if _native_intake is not None:  # the same loop in C (_translate is its reference)
        events, skipped, rejected = _native_intake.translate(
            wire.events, classes, MAX_TOKENS_PER_EVENT
        )
        if rejected is not None:
            return BatchRejected(*rejected)
    else:
        translated = _translate(wire.events, classes[1], classes[2])
        if isinstance(translated, BatchRejected):
            return translated
        events, skipped = translated
    return BatchDecoded(
        ts=wire.ts,
        data_parallel_rank=wire.data_parallel_rank,
        events=tuple(events),
        skipped=tuple(sorted(skipped.items())),
        unknown_fields=unknown,
    )


_UNKNOWN_FIELD: Final = re.compile(r"unknown field `(.{0,256}?)` - at `\$\[1\]\[(\d+)\]`")


def _unknown_name(error: str, wire: _LenientBatch) -> str:
    """``Event.field`` for the unknown field the strict decoder named in ``error`` (the
    event's type read from the lenient decode), ``KVEventBatch[3]`` for items after
    the batch's third, or ``unknown`` if msgspec's words ever change."""
    found = _UNKNOWN_FIELD.search(error)
    if found is not None and int(found.group(2)) < len(wire.events):
        event = wire.events[int(found.group(2))]
        return f"{type(event).__struct_config__.tag}.{found.group(1)}"
    if error.startswith("Expected `array` of at most length 3"):
        return "KVEventBatch[3]"
    return "unknown"


def _translate(
    wire_events: Sequence[_WireEvent],
    removed_type: type = _WireRemoved,
    cleared_type: type = _WireCleared,
) -> tuple[list[KVEvent], dict[str, int]] | BatchRejected:
    """A batch's wire events as the router's (unkeyable blocks first) and the events
    skipped by reason, or why the batch is malformed (``removed_type``, ``cleared_type``:
    the classes the decoder built, strict or lenient)."""
    events: list[KVEvent] = []
    unkeyable: list[KVEvent] = []
    skipped: dict[str, int] = {}
    # A step's removals come one block per event (vLLM's block pool): consecutive ones of
    # one medium become one BlocksRemoved, applied block by block in the same order, so
    # the intake costs a Python object per run instead of per block. Consecutive valid
    # stores (a run) are ordered parents first and joined into chains (_stores_of).
    removed: list[BlockHash] = []
    removed_medium = ""
    run: list[_WireStored] = []
    run_tokens: list[bytes] = []  # each store's tokens, packed
    for index, item in enumerate(wire_events):
        if type(item) is removed_type:
            assert isinstance(item, _WireRemoved)
            if item.group_idx or item.ownership is not None:  # _skip_reason's, inlined
                skip = _skip_reason(item.group_idx, item.ownership)
                assert skip is not None
                skipped[skip] = skipped.get(skip, 0) + 1
            elif item.block_hashes:
                if run:
                    events.extend(_stores_of(run, run_tokens))
                    run, run_tokens = [], []
                medium = item.medium or "GPU"
                if medium != removed_medium and removed:
                    events.append(BlocksRemoved(removed_medium, tuple(removed)))
                    removed = []
                removed_medium = medium
                removed.extend(item.block_hashes)
            continue
        if removed:
            events.append(BlocksRemoved(removed_medium, tuple(removed)))
            removed = []
        if type(item) is cleared_type:
            if run:
                events.extend(_stores_of(run, run_tokens))
                run, run_tokens = [], []
            events.append(AllCleared())
            continue
        assert isinstance(item, _WireStored)
        outcome = _store_check(item)
        if type(outcome) is bytes:
            run.append(item)
            run_tokens.append(outcome)
        elif isinstance(outcome, BatchRejected):
            return BatchRejected(outcome.reason, f"event {index}: {outcome.detail}")
        else:
            assert isinstance(outcome, str)
            skipped[outcome] = skipped.get(outcome, 0) + 1
            if outcome in UNKEYABLE_REASONS:
                unkeyable.append(BlocksUnkeyable(tuple(item.block_hashes), item.medium or "GPU"))
    if removed:
        events.append(BlocksRemoved(removed_medium, tuple(removed)))
    if run:
        events.extend(_stores_of(run, run_tokens))
    # Unkeyable blocks first: a step's CPU-tier store of such a block may come before
    # the store that says it is salted.
    return [*unkeyable, *events], skipped


def _stores_of(run: list[_WireStored], tokens: list[bytes]) -> list[BlocksStored]:
    """A run of consecutive valid stores as the index applies them (``tokens``: each
    store's packed tokens): parents first, and each store that continues the one before
    it (same medium and block size, its parent that store's last block) joined into it.

    vLLM's offloading tracker emits a step's stores in any order ("events are
    self-contained") -- a recorded CPU-tier batch stores block 3 before block 2 -- and
    the index can only place a block whose parent it has placed; stores and removals
    keep their relative order (invariant 2 of the feed depends on it). The CPU tier
    also announces every block in a store of its own, so a 64-block prompt offloaded
    in one step is 64 events: joined, the index applies them block by block in the
    same order, paying its per-event costs once per chain instead of once per block.
    """
    if _native_intake is not None:
        return [_store(head, hashes, packed) for head, hashes, packed in
                _native_intake.stores_of(run, tokens)]
    order = _topological(run) if len(run) > 1 else [0]
    out: list[BlocksStored] = []
    head = run[order[0]]
    hashes, packed = list(head.block_hashes), [tokens[order[0]]]
    for at in order[1:]:
        item = run[at]
        if (
            item.parent_block_hash is not None
            and item.parent_block_hash == hashes[-1]
            and item.medium == head.medium
            and item.block_size == head.block_size
        ):
            hashes.extend(item.block_hashes)
            packed.append(tokens[at])
            continue
        out.append(_store(head, tuple(hashes), b"".join(packed)))
        head = item
        hashes, packed = list(item.block_hashes), [tokens[at]]
    out.append(_store(head, tuple(hashes), b"".join(packed)))
    return out


def _store(head: _WireStored, hashes: tuple[BlockHash, ...], tokens: bytes) -> BlocksStored:
    return BlocksStored(
        medium=head.medium or "GPU",
        block_hashes=hashes,
        parent_hash=head.parent_block_hash,
        tokens=tokens,
        block_size=head.block_size,
    )


def _topological(run: list[_WireStored]) -> list[int]:
    """The run's positions, each store after the store of its parent block."""
    owner = {h: i for i, item in enumerate(run) for h in item.block_hashes}
    placed = [False] * len(run)
    order: list[int] = []
    for first in range(len(run)):
        chain: list[int] = []
        i: int | None = first
        while i is not None and not placed[i]:
            placed[i] = True  # marked on the way up: a hostile cycle ends here
            chain.append(i)
            parent = run[i].parent_block_hash
            i = owner.get(parent) if parent is not None else None
        order.extend(reversed(chain))
    return order


def _skip_reason(group_idx: int | None, ownership: str | None) -> str | None:
    if group_idx not in (None, 0):
        return "other_group"
    if ownership is not None:
        return "secondary_tier"
    return None


def _store_check(item: _WireStored) -> BatchRejected | str | bytes:
    """A valid store's packed tokens, else a reason to skip it or why the whole batch is
    malformed (every store's tokens are checked, skipped or not: invariant 2)."""
    try:
        tokens = _packed_tokens(item.token_ids)
    except ValueError as exc:
        return BatchRejected("invalid_schema", f"token_ids: {str(exc)[:150]}")
    if not tokens and item.block_size == 0:
        return "placeholder"  # checked first: placeholders are not malformed
    if not item.block_hashes:
        return BatchRejected("empty_store", "no block hashes")
    if item.kv_cache_spec_kind in RECURRENT_KINDS:  # by group: a state, any tokens
        return "state_checkpoint"
    if item.block_size == 0 or len(tokens) != 4 * len(item.block_hashes) * item.block_size:
        return BatchRejected(
            "token_count_mismatch",
            f"{len(tokens) // 4} tokens, {len(item.block_hashes)} blocks of "
            f"{item.block_size}",
        )
    if item.group_idx or item.ownership is not None:
        skip = _skip_reason(item.group_idx, item.ownership)
        assert skip is not None
        return skip
    if item.lora_name is not None or item.lora_id is not None:
        return "lora"
    if item.extra_keys is not None and _any_not_none(item.extra_keys):
        return "extra_keys"
    return tokens


_TOKENS: Final = msgspec.msgpack.Decoder(
    Annotated[list[_Token], msgspec.Meta(max_length=MAX_TOKENS_PER_EVENT)]
)


def _packed_tokens(raw: msgspec.Raw) -> bytes:
    """A store's ``token_ids`` (its msgpack, kept raw by the decoder) packed as
    ``array("I")`` packs them; ValueError names what is wrong (not an array, an item
    not an integer in ``[0, 2**32)``, more than ``MAX_TOKENS_PER_EVENT``)."""
    if _native_intake is not None:
        packed: bytes = _native_intake.msgpack_tokens(raw, MAX_TOKENS_PER_EVENT)
        return packed
    try:
        return array("I", _TOKENS.decode(raw)).tobytes()
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        data = bytes(memoryview(raw))
        fault = _token_fault(data, MAX_TOKENS_PER_EVENT) if len(data) <= FAULT_NAMED_BYTES else None
        raise ValueError(fault or str(exc)) from None


#: Token ids up to this size that msgspec refused are scanned again in Python to name the
#: fault as the C parser does (a few ms at most); larger ones keep msgspec's words, so an
#: engine cannot make a router without the extension spend 0.3 s on each bad batch.
FAULT_NAMED_BYTES = 65_536


def _token_fault(data: bytes, max_count: int) -> str | None:
    """What is wrong with a store's token ids, in the words of the C parser
    (``_intake.msgpack_tokens``), checked in its order, so a batch is rejected with the
    same detail with or without the extension; None if nothing is. Only for ids msgspec
    has refused: the good path stays msgspec's."""
    end, p, count = len(data), 1, -1
    head = data[0] if data else None
    if head is not None and head & 0xF0 == 0x90:
        count = head & 0x0F
    elif head in (0xDC, 0xDD) and end - p >= (width := 2 if head == 0xDC else 4):
        count, p = int.from_bytes(data[p : p + width], "big"), p + width
    if count < 0:
        return "expected an array of token ids"
    if count > max_count or count > end - p:  # each item takes a byte at least
        return f"{count} token ids: more than " + (
            "allowed" if count > max_count else "the payload holds"
        )
    for i in range(count):
        if p == end:
            return f"token id {i} is cut short"
        tag, p = data[p], p + 1
        value, width, signed = tag, 0, False
        if tag >= 0xE0:
            return f"token id {i} is negative"
        if 0xCC <= tag <= 0xD3:
            width, signed = 1 << ((tag - 0xCC) % 4), tag >= 0xD0
        elif tag > 0x7F:
            return f"token id {i} is not an integer (msgpack 0x{tag:02x})"
        if width:
            if end - p < width:
                return f"token id {i} is cut short"
            value, p = int.from_bytes(data[p : p + width], "big"), p + width
            if signed and value >> (8 * width - 1):
                return f"token id {i} is negative"
        if value >= 1 << 32:
            return f"token id {i} is above 2**32 - 1"
    return None if p == end else "bytes after the token ids"


def _any_not_none(values: Iterable[object]) -> bool:
    return any(v is not None for v in values)
