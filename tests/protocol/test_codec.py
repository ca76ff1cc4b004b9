"""The codec and the wire messages: vLLM 0.32 interop, strict typing, limits, errors.

Frames "shaped like vLLM's" are plain dicts encoded with ``msgspec.msgpack.encode``,
exactly what vLLM's p2p tier puts on the wire; our frames are read back the way vLLM
reads them, with plain ``msgspec.msgpack.decode``.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec
import pytest

from kvpeer.errors import KVPeerError, ProtocolError
from kvpeer.protocol import (
    PROTOCOL_VERSION,
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
    TransferDone,
    TransportChoice,
    UnknownMessage,
)

CODEC = Codec()
MAX_ITEMS = 65_536
INT_LIMIT = 2**63
KEY_A = b"\x01" * 32 + b"\x00\x00\x00\x00"
KEY_B = b"\x02" * 32 + b"\x00\x00\x00\x01"
BOOT_ID = bytes(range(16))


def frame(fields: dict[str, Any]) -> bytes:
    """A frame as vLLM's p2p tier builds it: a plain dict through msgspec."""
    return msgspec.msgpack.encode(fields)


def decode(fields: dict[str, Any]) -> Message | UnknownMessage:
    """Decode the vLLM-shaped frame of ``fields`` with our codec."""
    return CODEC.decode(frame(fields))


def rejects(fields: dict[str, Any] | bytes, *fragments: str) -> ProtocolError:
    """Assert decoding fails with a ProtocolError whose message holds ``fragments``."""
    data = fields if isinstance(fields, bytes) else frame(fields)
    with pytest.raises(ProtocolError) as info:
        CODEC.decode(data)
    for fragment in fragments:
        assert fragment in str(info.value)
    return info.value


# A valid vLLM-shaped dict of every base message type, used as a base for mutations.
VLLM_CONNECT: dict[str, Any] = dict(
    type="connect",
    peer_id="10.0.0.1:5710",
    agent_metadata=b"nixl-agent-blob",
    base_addr=140_000_000_000,
    num_blocks=1024,
    block_len=65_536,
    config_fingerprint="0123456789abcdef",
    hash_seed="vllm-none-hash",
)
VLLM_CONNECT_ACK: dict[str, Any] = dict(type="connect_ack", peer_id="10.0.0.2:5710")
VLLM_DISCONNECT: dict[str, Any] = dict(type="disconnect")
VLLM_LOOKUP: dict[str, Any] = dict(
    type="lookup", kv_request_id="req-1", keys=[KEY_A, KEY_B], round_seq=3
)
VLLM_LOOKUP_RESP: dict[str, Any] = dict(
    type="lookup_resp", kv_request_id="req-1", keys=[KEY_A, KEY_B], hits=[True, False]
)
VLLM_FETCH: dict[str, Any] = dict(
    type="fetch", kv_request_id="req-1", keys=[KEY_A, KEY_B], block_indexes=[7, 0], round_seq=3
)
VLLM_TERMINAL_FETCH: dict[str, Any] = dict(
    type="fetch", kv_request_id="req-1", keys=[], block_indexes=[], round_seq=4
)
VLLM_TRANSFER_DONE: dict[str, Any] = dict(
    type="transfer_done", kv_request_id="req-1", success=True, round_seq=3
)
VLLM_ABORT_FETCH: dict[str, Any] = dict(type="abort_fetch", kv_request_id="req-1", round_seq=3)
VLLM_ABORT_ACK: dict[str, Any] = dict(type="abort_ack", kv_request_id="req-1", round_seq=3)

# The same messages as our structs (base fields only).
BASE_MESSAGES: list[tuple[Message, dict[str, Any]]] = [
    (
        Connect(
            peer_id="10.0.0.1:5710",
            agent_metadata=b"nixl-agent-blob",
            base_addr=140_000_000_000,
            num_blocks=1024,
            block_len=65_536,
            hash_seed="vllm-none-hash",
            config_fingerprint="0123456789abcdef",
        ),
        VLLM_CONNECT,
    ),
    (ConnectAck(peer_id="10.0.0.2:5710"), VLLM_CONNECT_ACK),
    (Disconnect(), VLLM_DISCONNECT),
    (Lookup(kv_request_id="req-1", keys=(KEY_A, KEY_B), round_seq=3), VLLM_LOOKUP),
    (
        LookupResponse(kv_request_id="req-1", keys=(KEY_A, KEY_B), hits=(True, False)),
        VLLM_LOOKUP_RESP,
    ),
    (
        Fetch(kv_request_id="req-1", keys=(KEY_A, KEY_B), block_indexes=(7, 0), round_seq=3),
        VLLM_FETCH,
    ),
    (Fetch(kv_request_id="req-1", keys=(), block_indexes=(), round_seq=4), VLLM_TERMINAL_FETCH),
    (TransferDone(kv_request_id="req-1", success=True, round_seq=3), VLLM_TRANSFER_DONE),
    (AbortFetch(kv_request_id="req-1", round_seq=3), VLLM_ABORT_FETCH),
    (AbortAck(kv_request_id="req-1", round_seq=3), VLLM_ABORT_ACK),
]
BASE_IDS = ["connect", "connect_ack", "disconnect", "lookup", "lookup_resp", "fetch"]
BASE_IDS += ["fetch-terminal", "transfer_done", "abort_fetch", "abort_ack"]

EXTENDED_CONNECT = Connect(
    peer_id="[::1]:5710",
    agent_metadata=b"",
    base_addr=0,
    num_blocks=8,
    block_len=4096,
    hash_seed="seed",
    config_fingerprint="fp",
    kvpeer=ConnectExtension(
        version=PROTOCOL_VERSION,
        boot_id=BOOT_ID,
        transports={
            "shm": {"segment": "/kvpeer-a", "host": "host-id-1"},
            "tcp": {"port": 5711, "offset": -1},
        },
    ),
)
EXTENDED_MESSAGES: list[Message] = [
    EXTENDED_CONNECT,
    ConnectAck(
        peer_id="[::1]:5711",
        kvpeer=AckExtension(
            version=(1, 2), transport=TransportChoice(name="shm", params={"segment": "/s"})
        ),
    ),
    ConnectAck(peer_id="[::1]:5711", kvpeer=AckExtension(version=(1, 0))),
    Disconnect(reason="block_len mismatch"),
    LookupResponse(kv_request_id="r", keys=(KEY_A,), hits=(True,), round_seq=INT_LIMIT - 1),
    TransferDone(kv_request_id="r", success=False, round_seq=0, blocks=0, reason="aborted"),
    TransferDone(kv_request_id="r", success=True, round_seq=1, blocks=2),
]


class TestRoundTrip:
    """Every message type, with and without extensions, survives encode → decode."""

    @pytest.mark.parametrize("message", [m for m, _ in BASE_MESSAGES], ids=BASE_IDS)
    def test_base_message_round_trips(self, message: Message) -> None:
        """decode(encode(m)) is an equal message of the same type."""
        decoded = CODEC.decode(CODEC.encode(message))
        assert type(decoded) is type(message)
        assert decoded == message

    @pytest.mark.parametrize("message", EXTENDED_MESSAGES)
    def test_extended_message_round_trips(self, message: Message) -> None:
        """Extension fields survive the round trip unchanged."""
        decoded = CODEC.decode(CODEC.encode(message))
        assert type(decoded) is type(message)
        assert decoded == message

    def test_decode_accepts_bytearray_and_memoryview(self) -> None:
        """Frames arrive as bytes, bytearray or memoryview (zmq copy=False)."""
        message = BASE_MESSAGES[3][0]
        data = CODEC.encode(message)
        assert CODEC.decode(bytearray(data)) == message
        assert CODEC.decode(memoryview(data)) == message


class TestVllmWireShape:
    """Base-only messages are exactly the msgpack maps vLLM 0.32 sends."""

    @pytest.mark.parametrize(("message", "expected"), BASE_MESSAGES, ids=BASE_IDS)
    def test_base_message_is_vllm_map(self, message: Message, expected: dict[str, Any]) -> None:
        """Same keys, same values, same msgpack types; unset extensions are absent."""
        on_wire = msgspec.msgpack.decode(CODEC.encode(message))
        assert on_wire == expected
        assert {k: type(v) for k, v in on_wire.items()} == {k: type(v) for k, v in expected.items()}

    def test_connect_with_empty_fingerprint_still_sends_the_key(self) -> None:
        """vLLM always sends ``config_fingerprint`` (empty when it has none); so do we.

        Nodes always fill the field from their config (default ``""``); only a
        peer that leaves the key out decodes to None.
        """
        message = Connect(
            peer_id="10.0.0.1:5710",
            agent_metadata=b"",
            base_addr=0,
            num_blocks=1,
            block_len=1,
            hash_seed="s",
            config_fingerprint="",
        )
        assert msgspec.msgpack.decode(CODEC.encode(message)) == {
            "type": "connect",
            "peer_id": "10.0.0.1:5710",
            "agent_metadata": b"",
            "base_addr": 0,
            "num_blocks": 1,
            "block_len": 1,
            "config_fingerprint": "",
            "hash_seed": "s",
        }

    def test_extensions_add_keys_and_leave_base_fields_alone(self) -> None:
        """A kvpeer-extended message is the vLLM map plus only the extension keys."""
        done = TransferDone(kv_request_id="req-1", success=True, round_seq=3, blocks=2, reason="")
        assert msgspec.msgpack.decode(CODEC.encode(done)) == {
            **VLLM_TRANSFER_DONE,
            "blocks": 2,
            "reason": "",
        }
        resp = LookupResponse(kv_request_id="req-1", keys=(KEY_A, KEY_B), hits=(True, False))
        with_round = msgspec.structs.replace(resp, round_seq=5)
        assert msgspec.msgpack.decode(CODEC.encode(with_round)) == {
            **VLLM_LOOKUP_RESP,
            "round_seq": 5,
        }


class TestVllmFramesDecode:
    """Frames built the way vLLM builds them decode into our structs."""

    @pytest.mark.parametrize(("expected", "fields"), BASE_MESSAGES, ids=BASE_IDS)
    def test_vllm_frame_decodes(self, expected: Message, fields: dict[str, Any]) -> None:
        """Every base message vLLM sends is understood."""
        assert decode(fields) == expected

    @pytest.mark.parametrize(("expected", "fields"), BASE_MESSAGES, ids=BASE_IDS)
    def test_unknown_keys_are_ignored(self, expected: Message, fields: dict[str, Any]) -> None:
        """Keys we do not know (a newer vLLM, another fork) are skipped, whatever their value."""
        extra = {
            "future_field": [1, {"nested": b"x"}, None],
            "epoch": b"\x00" * 16,
            "ratio": 0.5,
        }
        assert decode({**extra, **fields, "zz_last": {"a": [True]}}) == expected

    def test_connect_without_fingerprint_decodes_as_absent(self) -> None:
        """``config_fingerprint`` is optional on the wire; absent decodes to None."""
        fields = {k: v for k, v in VLLM_CONNECT.items() if k != "config_fingerprint"}
        decoded = decode(fields)
        assert isinstance(decoded, Connect)
        assert decoded.config_fingerprint is None
        assert decoded.kvpeer is None


# Every integer field of the base protocol, with a message to carry it.
INT_FIELDS = [(base, "round_seq") for base in (VLLM_LOOKUP, VLLM_FETCH, VLLM_TRANSFER_DONE)]
INT_FIELDS += [(VLLM_ABORT_FETCH, "round_seq"), (VLLM_ABORT_ACK, "round_seq")]
INT_FIELDS += [(VLLM_CONNECT, field) for field in ("base_addr", "num_blocks", "block_len")]


class TestIntegersAreExact:
    """A bool is never an int, and every wire integer is 0 <= n < 2**63."""

    @pytest.mark.parametrize(("base", "field"), INT_FIELDS)
    @pytest.mark.parametrize("flag", [True, False])
    def test_bool_rejected_for_int_field(
        self, base: dict[str, Any], field: str, flag: bool
    ) -> None:
        """``True``/``False`` where an int is expected is a protocol error naming the field."""
        rejects({**base, field: flag}, f"$.{field}", "bool")

    @pytest.mark.parametrize("flag", [True, False])
    def test_bool_rejected_in_block_indexes(self, flag: bool) -> None:
        """Each block index is an exact int."""
        rejects({**VLLM_FETCH, "block_indexes": [7, flag]}, "$.block_indexes[1]", "bool")

    def test_int_rejected_for_bool_fields(self) -> None:
        """``success`` and ``hits`` are bools, not truthy ints (vLLM checks hits too)."""
        rejects({**VLLM_TRANSFER_DONE, "success": 1}, "$.success")
        rejects({**VLLM_TRANSFER_DONE, "success": 0}, "$.success")
        rejects({**VLLM_LOOKUP_RESP, "hits": [1, 0]}, "$.hits[0]")

    @pytest.mark.parametrize(("base", "field"), INT_FIELDS)
    @pytest.mark.parametrize("value", [-1, -(2**63), INT_LIMIT, 2**64 - 1])
    def test_out_of_range_int_rejected(self, base: dict[str, Any], field: str, value: int) -> None:
        """Negative values and values >= 2**63 are rejected, naming the field."""
        rejects({**base, field: value}, f"$.{field}")

    @pytest.mark.parametrize("value", [-1, INT_LIMIT])
    def test_out_of_range_block_index_rejected(self, value: int) -> None:
        """Block indexes obey the same bounds."""
        rejects({**VLLM_FETCH, "block_indexes": [0, value]}, "$.block_indexes[1]")

    @pytest.mark.parametrize("field", ["num_blocks", "block_len"])
    def test_zero_rejected_where_positive_required(self, field: str) -> None:
        """A region has at least one block of at least one byte."""
        rejects({**VLLM_CONNECT, field: 0}, f"$.{field}")

    def test_largest_wire_int_accepted(self) -> None:
        """2**63 - 1 is the largest legal value everywhere."""
        top = INT_LIMIT - 1
        fetch = decode({**VLLM_FETCH, "block_indexes": [top, 0], "round_seq": top})
        assert isinstance(fetch, Fetch)
        assert fetch.block_indexes == (top, 0)
        assert fetch.round_seq == top
        connect = decode({**VLLM_CONNECT, "base_addr": top, "num_blocks": top})
        assert isinstance(connect, Connect)
        assert (connect.base_addr, connect.num_blocks) == (top, top)

    def test_float_rejected_for_int_field(self) -> None:
        """``3.0`` is not an int on the wire."""
        rejects({**VLLM_LOOKUP, "round_seq": 3.0}, "$.round_seq")


class TestKeys:
    """Keys are msgpack bin of 1..256 bytes."""

    @pytest.mark.parametrize("base", [VLLM_LOOKUP, VLLM_LOOKUP_RESP, VLLM_FETCH])
    @pytest.mark.parametrize("size", [0, 257])
    def test_key_size_out_of_bounds_rejected(self, base: dict[str, Any], size: int) -> None:
        """An empty key or a key over 256 bytes is rejected, naming its position."""
        rejects({**base, "keys": [KEY_A, b"k" * size]}, "$.keys[1]")

    @pytest.mark.parametrize("size", [1, 256])
    def test_key_size_at_bounds_accepted(self, size: int) -> None:
        """1 and 256 bytes are both legal."""
        decoded = decode({**VLLM_LOOKUP, "keys": [b"k" * size]})
        assert isinstance(decoded, Lookup)
        assert decoded.keys == (b"k" * size,)

    @pytest.mark.parametrize("base", [VLLM_LOOKUP, VLLM_LOOKUP_RESP, VLLM_FETCH])
    def test_str_key_rejected(self, base: dict[str, Any]) -> None:
        """A key sent as msgpack str instead of bin is rejected."""
        rejects({**base, "keys": ["deadbeef", KEY_B]}, "$.keys[0]", "str")

    def test_int_key_rejected(self) -> None:
        """An int where a key belongs is rejected (vLLM would call ``bytes(int)``)."""
        rejects({**VLLM_FETCH, "keys": [2**40, KEY_B]}, "$.keys[0]")

    def test_keys_must_be_a_list(self) -> None:
        """``keys`` is an array, not a bare bin."""
        rejects({**VLLM_LOOKUP, "keys": KEY_A}, "$.keys")


class TestParallelLists:
    """``hits`` and ``block_indexes`` pair one-to-one with ``keys``."""

    @pytest.mark.parametrize("hits", [[True], [True, False, True], []])
    def test_keys_hits_length_mismatch_rejected(self, hits: list[bool]) -> None:
        """lookup_resp with a different number of hits than keys is rejected."""
        rejects({**VLLM_LOOKUP_RESP, "hits": hits}, "keys", "hits")

    @pytest.mark.parametrize("indexes", [[1], [1, 2, 3], []])
    def test_keys_block_indexes_length_mismatch_rejected(self, indexes: list[int]) -> None:
        """fetch with a different number of indexes than keys is rejected."""
        rejects({**VLLM_FETCH, "block_indexes": indexes}, "keys", "block_indexes")


LIST_FIELDS = [(VLLM_LOOKUP, "keys"), (VLLM_LOOKUP_RESP, "keys"), (VLLM_LOOKUP_RESP, "hits")]
LIST_FIELDS += [(VLLM_FETCH, "keys"), (VLLM_FETCH, "block_indexes")]


def full_lists(base: dict[str, Any]) -> dict[str, list[Any]]:
    """Every list field of ``base`` filled to exactly the 65,536-item limit."""
    items = {"keys": b"k", "hits": True, "block_indexes": 1}
    return {name: [item] * MAX_ITEMS for name, item in items.items() if name in base}


class TestListLimits:
    """No list on the wire holds more than 65,536 items."""

    @pytest.mark.parametrize("base", [VLLM_LOOKUP, VLLM_LOOKUP_RESP, VLLM_FETCH])
    def test_lists_at_limit_accepted(self, base: dict[str, Any]) -> None:
        """Exactly 65,536 items is legal."""
        decoded = decode({**base, **full_lists(base)})
        assert isinstance(decoded, Lookup | LookupResponse | Fetch)
        assert len(decoded.keys) == MAX_ITEMS

    @pytest.mark.parametrize(("base", "field"), LIST_FIELDS)
    def test_list_over_limit_rejected(self, base: dict[str, Any], field: str) -> None:
        """65,537 items in any list is rejected, naming that list."""
        fields = full_lists(base)
        fields[field] = [*fields[field], fields[field][0]]
        rejects({**base, **fields}, f"$.{field}")


NAME_FIELDS = [
    (base, "kv_request_id")
    for base in (VLLM_LOOKUP, VLLM_LOOKUP_RESP, VLLM_FETCH, VLLM_TRANSFER_DONE, VLLM_ABORT_ACK)
]
NAME_FIELDS += [(VLLM_ABORT_FETCH, "kv_request_id"), (VLLM_CONNECT, "hash_seed")]
NAME_FIELDS += [(VLLM_CONNECT, "peer_id"), (VLLM_CONNECT_ACK, "peer_id")]


class TestStringAndBlobLimits:
    """Names are 1..512 characters, fingerprints <= 128, agent metadata <= 16 MiB."""

    @pytest.mark.parametrize(("base", "field"), NAME_FIELDS)
    def test_name_length_bounds(self, base: dict[str, Any], field: str) -> None:
        """512 characters (even multi-byte ones) pass; 513 and the empty string do not."""
        decoded = decode({**base, field: "é" * 512})
        assert getattr(decoded, field) == "é" * 512
        rejects({**base, field: "x" * 513}, f"$.{field}")
        rejects({**base, field: ""}, f"$.{field}")

    @pytest.mark.parametrize("base", [VLLM_DISCONNECT, VLLM_TRANSFER_DONE])
    def test_reason_length_bounds(self, base: dict[str, Any]) -> None:
        """``reason`` may be empty and holds at most 512 characters."""
        for reason in ("", "r" * 512):
            decoded = decode({**base, "reason": reason})
            assert isinstance(decoded, Disconnect | TransferDone)
            assert decoded.reason == reason
        rejects({**base, "reason": "r" * 513}, "$.reason")

    def test_fingerprint_length_bounds(self) -> None:
        """The config fingerprint holds at most 128 characters."""
        decoded = decode({**VLLM_CONNECT, "config_fingerprint": "f" * 128})
        assert isinstance(decoded, Connect)
        assert decoded.config_fingerprint == "f" * 128
        rejects({**VLLM_CONNECT, "config_fingerprint": "f" * 129}, "$.config_fingerprint")

    def test_agent_metadata_size_bounds(self) -> None:
        """Agent metadata of 16 MiB passes; one byte more is rejected."""
        limit = 16 * 1024 * 1024
        decoded = decode({**VLLM_CONNECT, "agent_metadata": bytes(limit)})
        assert isinstance(decoded, Connect)
        assert len(decoded.agent_metadata) == limit
        rejects({**VLLM_CONNECT, "agent_metadata": bytes(limit + 1)}, "$.agent_metadata")

    def test_agent_metadata_as_str_rejected(self) -> None:
        """Agent metadata is bin, not str."""
        rejects({**VLLM_CONNECT, "agent_metadata": "blob"}, "$.agent_metadata")


class TestFrameSize:
    """Frames over the codec's ``max_frame_bytes`` are rejected before decoding."""

    def test_frame_at_limit_accepted_one_byte_more_rejected(self) -> None:
        """The limit is inclusive and the error states the sizes."""
        data = frame(VLLM_ABORT_ACK)
        assert Codec(max_frame_bytes=len(data)).decode(data) == BASE_MESSAGES[-1][0]
        with pytest.raises(ProtocolError, match=rf"\b{len(data)} bytes exceeds {len(data) - 1}\b"):
            Codec(max_frame_bytes=len(data) - 1).decode(data)

    def test_oversized_garbage_reports_size_not_content(self) -> None:
        """The size check runs first: oversized garbage fails on size, not on parsing."""
        with pytest.raises(ProtocolError, match="exceeds 16"):
            Codec(max_frame_bytes=16).decode(b"\xc1" * 17)

    def test_default_limit_is_64_mib(self) -> None:
        """By default a frame one byte over 64 MiB is refused without parsing it."""
        with pytest.raises(ProtocolError, match="exceeds"):
            Codec().decode(bytes(64 * 1024 * 1024 + 1))


class TestUnknownAndMalformed:
    """Unknown types are values; everything malformed is a ProtocolError."""

    @pytest.mark.parametrize("name", ["heartbeat", "lookup_v2", "CONNECT", "x" * 64])
    def test_unknown_type_is_unknown_message(self, name: str) -> None:
        """A well-formed map of an unknown type decodes to UnknownMessage, extras ignored."""
        decoded = decode({"type": name, "peer_id": 5, "payload": [b"x", {"y": None}]})
        assert decoded == UnknownMessage(type=name)

    def test_overlong_unknown_type_rejected(self) -> None:
        """Even an unknown type name is bounded."""
        rejects({"type": "x" * 65}, "$.type")

    def test_missing_type_rejected(self) -> None:
        """A map without ``type`` is an error naming ``type``."""
        rejects({k: v for k, v in VLLM_LOOKUP.items() if k != "type"}, "`type`")

    @pytest.mark.parametrize("value", [5, None, True, b"lookup", ["lookup"], {"t": 1}])
    def test_non_string_type_rejected(self, value: object) -> None:
        """``type`` must be a str."""
        rejects({**VLLM_LOOKUP, "type": value}, "$.type")

    @pytest.mark.parametrize(
        "payload", [[], ["lookup"], 5, "lookup", b"lookup", None, True, 1.5], ids=repr
    )
    def test_non_map_payload_rejected(self, payload: object) -> None:
        """The payload is one msgpack map; anything else is an error."""
        rejects(msgspec.msgpack.encode(payload), "object")

    @pytest.mark.parametrize(
        ("base", "missing"),
        [
            (VLLM_CONNECT, "hash_seed"),
            (VLLM_CONNECT, "agent_metadata"),
            (VLLM_CONNECT_ACK, "peer_id"),
            (VLLM_LOOKUP, "round_seq"),
            (VLLM_LOOKUP_RESP, "hits"),
            (VLLM_FETCH, "block_indexes"),
            (VLLM_TRANSFER_DONE, "success"),
            (VLLM_ABORT_FETCH, "kv_request_id"),
        ],
    )
    def test_known_type_missing_field_rejected(self, base: dict[str, Any], missing: str) -> None:
        """A known type with a required field missing names that field (never Unknown)."""
        rejects({k: v for k, v in base.items() if k != missing}, f"`{missing}`")

    @pytest.mark.parametrize("cut", [1, 2, 5, 10])
    def test_truncated_frame_rejected(self, cut: int) -> None:
        """A frame cut short anywhere is an error."""
        data = frame(VLLM_FETCH)
        rejects(data[:-cut])

    @pytest.mark.parametrize(
        "data",
        [b"", b"\xc1", b"\xc1\xc1\xc1", b"\x81\xa4type", b"\x82\xa4type\xa6lookup", b"\xff" * 64],
        ids=repr,
    )
    def test_garbage_rejected(self, data: bytes) -> None:
        """Empty, reserved-opcode or structurally broken frames are errors."""
        rejects(data)

    def test_trailing_bytes_rejected(self) -> None:
        """One frame holds exactly one message."""
        rejects(frame(VLLM_ABORT_ACK) + b"\xc0")

    @pytest.mark.parametrize("type_name", ["lookup", "no_such_type"])
    def test_deeply_nested_unknown_field_rejected(self, type_name: str) -> None:
        """A hostile nesting depth in an ignored field is a ProtocolError, not a crash."""
        depth = 100_000
        data = b"\x82\xa4type" + msgspec.msgpack.encode(type_name) + b"\xa5extra"
        with pytest.raises(ProtocolError):
            CODEC.decode(data + b"\x91" * depth + b"\xc0")

    def test_error_is_kvpeer_error_translated_from_msgspec(self) -> None:
        """Foreign errors are translated at the codec, keeping the cause."""
        error = rejects({**VLLM_LOOKUP, "round_seq": -1}, "$.round_seq")
        assert type(error) is ProtocolError
        assert isinstance(error, KVPeerError)
        assert isinstance(error.__cause__, msgspec.MsgspecError)
        undecodable = rejects(b"\xc1")
        assert isinstance(undecodable.__cause__, msgspec.MsgspecError)

    def test_error_message_names_nested_field(self) -> None:
        """The path of a nested bad value is in the message."""
        fields = {**VLLM_CONNECT, "kvpeer": {"version": [1, 0], "boot_id": b"short"}}
        error = rejects(fields)
        assert re.search(r"\$\.kvpeer\.boot_id", str(error))


class TestFetchTerminal:
    """The empty fetch is the consumer's "request finished" signal."""

    def test_empty_fetch_is_terminal(self) -> None:
        """No keys → terminal."""
        decoded = decode(VLLM_TERMINAL_FETCH)
        assert isinstance(decoded, Fetch)
        assert decoded.is_terminal

    def test_non_empty_fetch_is_not_terminal(self) -> None:
        """Any key → a real fetch."""
        decoded = decode(VLLM_FETCH)
        assert isinstance(decoded, Fetch)
        assert not decoded.is_terminal


class TestKvpeerExtension:
    """The optional ``kvpeer`` maps of connect / connect_ack."""

    def test_connect_extension_on_the_wire(self) -> None:
        """The extension is one ``kvpeer`` map added to the vLLM connect map."""
        on_wire = msgspec.msgpack.decode(CODEC.encode(EXTENDED_CONNECT))
        assert on_wire.pop("kvpeer") == {
            "version": list(PROTOCOL_VERSION),
            "boot_id": BOOT_ID,
            "transports": {
                "shm": {"segment": "/kvpeer-a", "host": "host-id-1"},
                "tcp": {"port": 5711, "offset": -1},
            },
        }
        assert set(on_wire) == set(VLLM_CONNECT)

    def test_connect_extension_round_trips(self) -> None:
        """Version tuple, boot id and transport offers come back equal."""
        decoded = CODEC.decode(CODEC.encode(EXTENDED_CONNECT))
        assert isinstance(decoded, Connect)
        assert decoded.kvpeer is not None
        assert decoded.kvpeer.version == PROTOCOL_VERSION
        assert isinstance(decoded.kvpeer.version, tuple)
        assert decoded.kvpeer.boot_id == BOOT_ID
        assert decoded.kvpeer == EXTENDED_CONNECT.kvpeer

    def test_extension_without_transports_defaults_to_empty(self) -> None:
        """``transports`` is optional; a peer offering none gets NIXL/base behaviour."""
        decoded = decode({**VLLM_CONNECT, "kvpeer": {"version": [1, 0], "boot_id": BOOT_ID}})
        assert isinstance(decoded, Connect)
        assert decoded.kvpeer == ConnectExtension(version=(1, 0), boot_id=BOOT_ID)

    def test_session_numbers_are_optional_and_round_trip(self) -> None:
        """``session`` in connect and connect_ack (session.peer invariant 3): absent from
        vLLM and older kvpeer peers (None), an exact non-negative wire int when sent."""
        old_ack = decode({"type": "connect_ack", "peer_id": "p", "kvpeer": {"version": [1, 1]}})
        assert isinstance(old_ack, ConnectAck)
        assert old_ack.kvpeer == AckExtension(version=(1, 1))
        assert old_ack.kvpeer.session is None
        extension = EXTENDED_CONNECT.kvpeer
        assert extension is not None
        numbered = msgspec.structs.replace(
            EXTENDED_CONNECT, kvpeer=msgspec.structs.replace(extension, session=INT_LIMIT - 1)
        )
        assert CODEC.decode(CODEC.encode(numbered)) == numbered
        ack = ConnectAck(peer_id="p", kvpeer=AckExtension(version=(1, 1), session=7))
        assert CODEC.decode(CODEC.encode(ack)) == ack
        for bad in (-1, INT_LIMIT, True, "7"):
            hello = {"version": [1, 1], "boot_id": BOOT_ID, "session": bad}
            rejects({**VLLM_CONNECT, "kvpeer": hello}, "$.kvpeer.session")
            acked = {"version": [1, 1], "session": bad}
            rejects({"type": "connect_ack", "peer_id": "p", "kvpeer": acked}, "$.kvpeer.session")

    @pytest.mark.parametrize("size", [0, 15, 17, 32])
    def test_wrong_size_boot_id_rejected(self, size: int) -> None:
        """The boot id is exactly 16 bytes."""
        bad = ConnectExtension(version=PROTOCOL_VERSION, boot_id=bytes(size))
        data = CODEC.encode(msgspec.structs.replace(EXTENDED_CONNECT, kvpeer=bad))
        rejects(data, "$.kvpeer.boot_id")

    @pytest.mark.parametrize(
        "version", [[1], [1, 0, 0], [-1, 0], [2**16, 0], [True, 0], "1.0"], ids=repr
    )
    def test_bad_version_rejected(self, version: object) -> None:
        """The version is [major, minor] of small non-negative ints."""
        fields = {**VLLM_CONNECT, "kvpeer": {"version": version, "boot_id": BOOT_ID}}
        rejects(fields, "$.kvpeer.version")

    def test_too_many_transports_rejected(self) -> None:
        """At most 8 transport offers."""
        offers: dict[str, dict[str, str]] = {f"t{i}": {} for i in range(9)}
        extension = {"version": [1, 0], "boot_id": BOOT_ID, "transports": offers}
        rejects({**VLLM_CONNECT, "kvpeer": extension}, "$.kvpeer.transports")

    def test_transport_value_must_be_str_or_int(self) -> None:
        """Offer parameters are scalars; nested values are rejected."""
        offers = {"shm": {"segment": ["a"]}}
        extension = {"version": [1, 0], "boot_id": BOOT_ID, "transports": offers}
        rejects({**VLLM_CONNECT, "kvpeer": extension}, "$.kvpeer.transports")

    def test_ack_extension_on_the_wire(self) -> None:
        """connect_ack gains only a ``kvpeer`` map with version and chosen transport."""
        ack = ConnectAck(
            peer_id="10.0.0.2:5710",
            kvpeer=AckExtension(
                version=(1, 0), transport=TransportChoice(name="tcp", params={"port": 1})
            ),
        )
        assert msgspec.msgpack.decode(CODEC.encode(ack)) == {
            **VLLM_CONNECT_ACK,
            "kvpeer": {"version": [1, 0], "transport": {"name": "tcp", "params": {"port": 1}}},
        }
