"""Property-based tests of the codec: round trips, total decoding, bounded allocation.

Decoding is total: whatever bytes a peer sends, ``Codec.decode`` returns a message
(or an UnknownMessage) or raises ProtocolError, and it never allocates memory in
proportion to a length the frame merely claims.
"""

from __future__ import annotations

import struct
import tracemalloc
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpeer.errors import ProtocolError
from kvpeer.protocol import (
    KNOWN_TYPES,
    AbortAck,
    AbortFetch,
    AckExtension,
    Codec,
    Connect,
    ConnectAck,
    ConnectExtension,
    Disconnect,
    Fetch,
    Lookup,
    LookupResponse,
    Message,
    Ping,
    Pong,
    Prefetch,
    PrefetchRefused,
    TransferDone,
    TransportChoice,
    UnknownMessage,
)

CODEC = Codec()
INT_LIMIT = 2**63
PROPERTY_SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

# --- strategies for valid messages (every bound of docs/protocol.md section 5) -----------

wire_ints = st.integers(min_value=0, max_value=INT_LIMIT - 1)
positive_ints = st.integers(min_value=1, max_value=INT_LIMIT - 1)
keys = st.binary(min_size=1, max_size=256)
key_lists = st.lists(keys, max_size=12).map(tuple)
names = st.text(min_size=1, max_size=512)
reasons = st.text(max_size=512)
fingerprints = st.text(max_size=128)
transport_names = st.text(min_size=1, max_size=32)
transport_values = st.one_of(
    st.text(max_size=64), st.integers(min_value=-INT_LIMIT, max_value=INT_LIMIT - 1)
)
transport_offers = st.dictionaries(transport_names, transport_values, max_size=4)
versions = st.tuples(st.integers(0, 2**16 - 1), st.integers(0, 2**16 - 1))

connect_extensions = st.builds(
    ConnectExtension,
    version=versions,
    boot_id=st.binary(min_size=16, max_size=16),
    transports=st.dictionaries(transport_names, transport_offers, max_size=3),
)
ack_extensions = st.builds(
    AckExtension,
    version=versions,
    transport=st.none() | st.builds(TransportChoice, name=transport_names, params=transport_offers),
)


@st.composite
def lookup_responses(draw: st.DrawFn) -> LookupResponse:
    """A lookup_resp with one hit per key."""
    pairs = draw(st.lists(st.tuples(keys, st.booleans()), max_size=12))
    return LookupResponse(
        kv_request_id=draw(names),
        keys=tuple(k for k, _ in pairs),
        hits=tuple(h for _, h in pairs),
        round_seq=draw(st.none() | wire_ints),
    )


@st.composite
def fetches(draw: st.DrawFn) -> Fetch:
    """A fetch with one slot per key (possibly the empty, terminal fetch)."""
    pairs = draw(st.lists(st.tuples(keys, wire_ints), max_size=12))
    return Fetch(
        kv_request_id=draw(names),
        keys=tuple(k for k, _ in pairs),
        block_indexes=tuple(i for _, i in pairs),
        round_seq=draw(wire_ints),
        prefill_done=draw(st.booleans()),
    )


MESSAGE_STRATEGIES: dict[str, st.SearchStrategy[Message]] = {
    "connect": st.builds(
        Connect,
        peer_id=names,
        agent_metadata=st.binary(max_size=256),
        base_addr=wire_ints,
        num_blocks=positive_ints,
        block_len=positive_ints,
        hash_seed=names,
        config_fingerprint=fingerprints,
        kvpeer=st.none() | connect_extensions,
    ),
    "connect_ack": st.builds(ConnectAck, peer_id=names, kvpeer=st.none() | ack_extensions),
    "disconnect": st.builds(Disconnect, reason=reasons),
    "lookup": st.builds(Lookup, kv_request_id=names, keys=key_lists, round_seq=wire_ints),
    "lookup_resp": lookup_responses(),
    "fetch": fetches(),
    "transfer_done": st.builds(
        TransferDone,
        kv_request_id=names,
        success=st.booleans(),
        round_seq=wire_ints,
        blocks=st.none() | wire_ints,
        reason=st.none() | reasons,
    ),
    "abort_fetch": st.builds(AbortFetch, kv_request_id=names, round_seq=wire_ints),
    "abort_ack": st.builds(AbortAck, kv_request_id=names, round_seq=wire_ints),
    "ping": st.builds(Ping),
    "pong": st.builds(Pong),
    "prefetch": st.builds(
        Prefetch, kv_request_id=names, source=names,
        tokens=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64).map(tuple),
    ),
    "prefetch_refused": st.builds(PrefetchRefused, kv_request_id=names, reason=reasons),
}


def decodes_totally(data: bytes) -> None:
    """Decoding ``data`` gives a message / UnknownMessage or raises ProtocolError only."""
    try:
        decoded = CODEC.decode(data)
    except ProtocolError:
        return
    assert isinstance(decoded, UnknownMessage) or decoded.__struct_config__.tag in KNOWN_TYPES


class TestRoundTrip:
    """Every valid message of every type survives encode → decode."""

    def test_strategies_cover_every_message_type(self) -> None:
        """A new message type must get a strategy here."""
        assert set(MESSAGE_STRATEGIES) == KNOWN_TYPES

    @pytest.mark.parametrize("type_name", sorted(MESSAGE_STRATEGIES))
    def test_round_trip(self, type_name: str) -> None:
        """decode(encode(m)) == m, with the same type."""

        @PROPERTY_SETTINGS
        @given(MESSAGE_STRATEGIES[type_name])
        def check(message: Message) -> None:
            decoded = CODEC.decode(CODEC.encode(message))
            assert type(decoded) is type(message)
            assert decoded == message

        check()

    @PROPERTY_SETTINGS
    @given(st.one_of(*MESSAGE_STRATEGIES.values()))
    def test_encoded_frame_is_a_plain_msgpack_map(self, message: Message) -> None:
        """What we send is a map with a str ``type``, readable by vLLM's plain decode."""
        on_wire = msgspec.msgpack.decode(CODEC.encode(message))
        assert isinstance(on_wire, dict)
        assert on_wire["type"] == message.__struct_config__.tag
        assert None not in on_wire.values()  # unset extensions are omitted, not nil


class TestDecodingIsTotal:
    """No input makes decode raise anything but ProtocolError."""

    @settings(max_examples=400, deadline=None)
    @given(st.binary(max_size=512))
    def test_arbitrary_bytes(self, data: bytes) -> None:
        """Random bytes never escape as a foreign exception."""
        decodes_totally(data)

    @PROPERTY_SETTINGS
    @given(st.one_of(*MESSAGE_STRATEGIES.values()), st.data())
    def test_mutated_valid_frames(self, message: Message, data: st.DataObject) -> None:
        """Valid frames with bytes flipped, cut or inserted never escape either."""
        frame = bytearray(CODEC.encode(message))
        for _ in range(data.draw(st.integers(1, 4))):
            position = data.draw(st.integers(0, len(frame) - 1))
            action = data.draw(st.sampled_from(["flip", "cut", "insert"]))
            if action == "flip":
                frame[position] = data.draw(st.integers(0, 255))
            elif action == "cut":
                del frame[position:]
                if not frame:
                    break
            else:
                frame[position:position] = data.draw(st.binary(min_size=1, max_size=8))
        decodes_totally(bytes(frame))


msgpack_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-INT_LIMIT, max_value=2**64 - 1),
    st.floats(allow_nan=True),
    st.text(max_size=32),
    st.binary(max_size=32),
)
msgpack_values = st.recursive(
    msgpack_scalars,
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=16), children, max_size=5)
    ),
    max_leaves=25,
)
FIELD_NAMES = sorted(
    {
        "type",
        "peer_id",
        "agent_metadata",
        "base_addr",
        "num_blocks",
        "block_len",
        "config_fingerprint",
        "hash_seed",
        "kv_request_id",
        "keys",
        "hits",
        "block_indexes",
        "round_seq",
        "success",
        "reason",
        "blocks",
        "kvpeer",
    }
)
# Maps that look like messages: a known (or unknown) type and real field names with
# arbitrary values, so the typed decoder gets past the tag and into the fields.
message_like_maps = st.builds(
    lambda type_name, fields: {**fields, "type": type_name},
    st.sampled_from(sorted(KNOWN_TYPES)) | st.text(max_size=70) | msgpack_scalars,
    st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=8), msgpack_values),
)


class TestDecodingArbitraryMsgpack:
    """Any msgpack value, encoded as vLLM would, decodes or raises ProtocolError."""

    @PROPERTY_SETTINGS
    @given(msgpack_values)
    def test_arbitrary_values(self, value: Any) -> None:
        """Nested None/bool/int/float/str/bytes/lists/dicts."""
        decodes_totally(msgspec.msgpack.encode(value))

    @pytest.mark.slow  # 300 fuzzed maps
    @settings(max_examples=300, deadline=None)
    @given(message_like_maps)
    def test_message_like_maps(self, value: dict[Any, Any]) -> None:
        """Maps with real field names and arbitrary values."""
        decodes_totally(msgspec.msgpack.encode(value))


# --- length headers that lie ----------------------------------------------------------

CLAIMED = 2**31


def s(text: str) -> bytes:
    """A msgpack str."""
    return msgspec.msgpack.encode(text)


def map_of(*pairs: tuple[str, bytes]) -> bytes:
    """A msgpack map (fixmap header) of already-encoded values."""
    return bytes([0x80 | len(pairs)]) + b"".join(s(k) + v for k, v in pairs)


ARRAY32 = b"\xdd" + struct.pack(">I", CLAIMED)
BIN32 = b"\xc6" + struct.pack(">I", CLAIMED)
STR32 = b"\xdb" + struct.pack(">I", CLAIMED)
MAP32 = b"\xdf" + struct.pack(">I", CLAIMED)
KEY = msgspec.msgpack.encode(b"k")
ZERO = msgspec.msgpack.encode(0)

LYING_FRAMES: dict[str, bytes] = {
    "map32 top level": MAP32 + s("type") + s("lookup"),
    "array32 top level": ARRAY32 + ZERO,
    "str32 type": map_of(("type", STR32 + b"look")),
    "array32 lookup keys": map_of(
        ("type", s("lookup")), ("kv_request_id", s("r")), ("keys", ARRAY32 + KEY)
    ),
    "bin32 lookup key": map_of(
        ("type", s("lookup")), ("kv_request_id", s("r")), ("keys", b"\x91" + BIN32 + b"k")
    ),
    "str32 kv_request_id": map_of(("type", s("abort_ack")), ("kv_request_id", STR32 + b"r")),
    "array32 hits": map_of(
        ("type", s("lookup_resp")),
        ("kv_request_id", s("r")),
        ("keys", b"\x91" + KEY),
        ("hits", ARRAY32 + b"\xc3"),
    ),
    "array32 block_indexes": map_of(
        ("type", s("fetch")),
        ("kv_request_id", s("r")),
        ("keys", b"\x91" + KEY),
        ("block_indexes", ARRAY32 + ZERO),
    ),
    "bin32 agent_metadata": map_of(
        ("type", s("connect")), ("peer_id", s("p")), ("agent_metadata", BIN32 + b"m")
    ),
    "str32 peer_id": map_of(("type", s("connect_ack")), ("peer_id", STR32 + b"p")),
    "map32 kvpeer transports": map_of(
        ("type", s("connect")),
        ("kvpeer", map_of(("version", b"\x92\x01\x00"), ("transports", MAP32 + s("shm")))),
    ),
    "array32 ignored field of known type": map_of(
        ("type", s("abort_ack")), ("junk", ARRAY32 + ZERO)
    ),
    "map32 ignored field of known type": map_of(("type", s("abort_ack")), ("junk", MAP32 + ZERO)),
    "bin32 ignored field of unknown type": map_of(("type", s("future")), ("junk", BIN32 + b"x")),
    "str32 ignored field of unknown type": map_of(("type", s("future")), ("junk", STR32 + b"x")),
    "array32 ignored field of unknown type": map_of(
        ("type", s("future")), ("junk", ARRAY32 + ZERO)
    ),
    "map32 ignored field of unknown type": map_of(("type", s("future")), ("junk", MAP32 + ZERO)),
}


def peak_traced_bytes(action: Callable[[], object]) -> int:
    """Peak memory traced by tracemalloc while ``action`` runs."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before, _ = tracemalloc.get_traced_memory()
        action()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak - before


class TestBoundedAllocation:
    """A header claiming ~2**31 items/bytes over a tiny body allocates nothing big."""

    def test_lying_frames_are_tiny(self) -> None:
        """The test frames themselves are small, so any big allocation is the decoder's."""
        assert all(len(f) < 128 for f in LYING_FRAMES.values())

    @pytest.mark.parametrize("name", sorted(LYING_FRAMES))
    def test_lying_header_rejected_in_bounded_memory(self, name: str) -> None:
        """ProtocolError, and peak traced memory stays under 1 MiB."""
        frame = LYING_FRAMES[name]
        raised: list[ProtocolError] = []

        def attempt() -> None:
            try:
                CODEC.decode(frame)
            except ProtocolError as error:
                raised.append(error)

        peak = peak_traced_bytes(attempt)
        assert raised, f"{name}: decoded without error"
        assert peak < 1024 * 1024, f"{name}: peak {peak} bytes"
