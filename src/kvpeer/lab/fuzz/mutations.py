"""Field-level mutations of a wire message: wrong types, wrong sizes, missing and extra keys.

A message is a plain ``dict`` (its msgpack map, ``"type"`` included); :func:`mutate`
breaks one thing about it and returns the mutation's label and the frame. Sizes at
and just past every bound of :mod:`kvpeer.protocol.limits` come from :class:`Bulk`,
which builds each large value once per generator.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Callable
from typing import Final

from kvpeer.lab.fuzz import wire
from kvpeer.protocol import limits as L

__all__ = ["SCHEMAS", "UNKNOWN_TYPES", "Bulk", "Field", "mutate"]

Payload = dict[str, object]


class Field(enum.Enum):
    """What a field holds on the wire, for choosing what breaks it."""

    NAME = "name"  # str, 1..MAX_NAME_CHARS
    REASON = "reason"  # str, 0..MAX_NAME_CHARS
    FINGERPRINT = "fingerprint"  # str, 0..MAX_FINGERPRINT_CHARS
    METADATA = "metadata"  # bin, 0..MAX_AGENT_METADATA_BYTES
    UINT = "uint"  # int, 0 <= n < 2^63
    PINT = "pint"  # int, 0 < n < 2^63
    BOOL = "bool"
    KEYS = "keys"  # [bin 1..MAX_KEY_BYTES], at most MAX_ITEMS
    UINTS = "uints"  # [uint], at most MAX_ITEMS
    BOOLS = "bools"  # [bool], at most MAX_ITEMS
    CONNECT_EXT = "connect_ext"  # the kvpeer map of connect
    ACK_EXT = "ack_ext"  # the kvpeer map of connect_ack


#: Every message type and its fields (base and extension), docs/protocol.md section 2.
SCHEMAS: Final[dict[str, dict[str, Field]]] = {
    "connect": {
        "peer_id": Field.NAME,
        "agent_metadata": Field.METADATA,
        "base_addr": Field.UINT,
        "num_blocks": Field.PINT,
        "block_len": Field.PINT,
        "hash_seed": Field.NAME,
        "config_fingerprint": Field.FINGERPRINT,
        "kvpeer": Field.CONNECT_EXT,
    },
    "connect_ack": {"peer_id": Field.NAME, "kvpeer": Field.ACK_EXT},
    "disconnect": {"reason": Field.REASON},
    "lookup": {"kv_request_id": Field.NAME, "keys": Field.KEYS, "round_seq": Field.UINT},
    "lookup_resp": {
        "kv_request_id": Field.NAME,
        "keys": Field.KEYS,
        "hits": Field.BOOLS,
        "round_seq": Field.UINT,
    },
    "fetch": {
        "kv_request_id": Field.NAME,
        "keys": Field.KEYS,
        "block_indexes": Field.UINTS,
        "round_seq": Field.UINT,
        "prefill_done": Field.BOOL,
        "resolve": Field.BOOL,
    },
    "transfer_done": {
        "kv_request_id": Field.NAME,
        "success": Field.BOOL,
        "round_seq": Field.UINT,
        "blocks": Field.UINT,
        "reason": Field.REASON,
    },
    "abort_fetch": {"kv_request_id": Field.NAME, "round_seq": Field.UINT},
    "abort_ack": {"kv_request_id": Field.NAME, "round_seq": Field.UINT},
    "ping": {},
    "pong": {},
}

_STRINGS = (Field.NAME, Field.REASON, Field.FINGERPRINT)
_INTS = (Field.UINT, Field.PINT)
_LISTS = (Field.KEYS, Field.UINTS, Field.BOOLS)
_EXTS = (Field.CONNECT_EXT, Field.ACK_EXT)

#: Values of the wrong type for each kind of field (msgpack can carry all of them).
_WRONG: Final[dict[str, tuple[object, ...]]] = {
    "str": (0, 7, 1.5, None, True, b"bytes-not-str", ["x"], {"x": 1}),
    "bin": ("str-not-bytes", 1, None, False, [1, 2], {"a": b""}, 2.5),
    "int": ("1", 1.0, None, b"\x01", [1], {"v": 1}, float("nan"), float("inf")),
    "bool": (1, 0, "true", None, b"\x01", [True]),
    "list": ("k", b"k", 5, None, {"0": b"k"}, [None], [1.5], [["nested"]], ["str-item"], [{}]),
    "ext": (1, "x", [], None, b"ext", True, {"version": "1.0"}, {"unexpected": 1}),
}

#: Message types the node does not know, and broken ``type`` values.
UNKNOWN_TYPES: Final = ("from_the_future", "CONNECT", "connect ", "lookup\x00", "beat", "x" * 64)
_BAD_TYPES: Final[tuple[tuple[str, object], ...]] = (
    ("type:int", 3),
    ("type:bytes", b"connect"),
    ("type:empty", ""),
    ("type:too-long", "t" * (L.MAX_TYPE_CHARS + 1)),
    ("type:nil", None),
    ("type:list", ["connect"]),
    ("type:unknown", "from_the_future"),
    ("type:case", "Fetch"),
)


def _wrong_pool(field: Field) -> tuple[object, ...]:
    if field in _STRINGS:
        return _WRONG["str"]
    if field is Field.METADATA:
        return _WRONG["bin"]
    if field in _INTS:
        return _WRONG["int"]
    if field is Field.BOOL:
        return _WRONG["bool"]
    if field in _LISTS:
        return _WRONG["list"]
    return _WRONG["ext"]


class Bulk:
    """Large values at and just past the protocol's bounds, built once and reused."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._cache: dict[str, object] = {}

    def get(self, name: str) -> object:
        value = self._cache.get(name)
        if value is None:
            value = self._cache[name] = self._build(name)
        return value

    def _build(self, name: str) -> object:
        rng = self._rng
        match name:
            case "keys-at":  # MAX_ITEMS short keys (distinct)
                return [i.to_bytes(3, "big") for i in range(L.MAX_ITEMS)]
            case "keys-over":
                return [i.to_bytes(3, "big") for i in range(L.MAX_ITEMS + 1)]
            case "uints-at":
                return list(range(L.MAX_ITEMS))
            case "uints-over":
                return list(range(L.MAX_ITEMS + 1))
            case "bools-at":
                return [True] * L.MAX_ITEMS
            case "bools-over":
                return [False] * (L.MAX_ITEMS + 1)
            case "metadata-at":
                return rng.randbytes(1024) * (L.MAX_AGENT_METADATA_BYTES // 1024)
            case "metadata-1m":
                return rng.randbytes(1 << 20)
            case "metadata-over":
                return bytes(L.MAX_AGENT_METADATA_BYTES + 1)
        raise KeyError(name)


def _size_value(field: Field, over: bool, bulk: Bulk, rng: random.Random) -> object:
    extra = 1 if over else 0
    if field in (Field.NAME, Field.REASON):
        return "n" * (L.MAX_NAME_CHARS + extra)
    if field is Field.FINGERPRINT:
        return "f" * (L.MAX_FINGERPRINT_CHARS + extra)
    if field is Field.METADATA:
        return bulk.get("metadata-over" if over else "metadata-at")
    if field is Field.KEYS:
        if rng.random() < 0.5:  # one key at / past its own bound instead of the count
            return [rng.randbytes(L.MAX_KEY_BYTES + extra)]
        return bulk.get("keys-over" if over else "keys-at")
    if field is Field.UINTS:
        return bulk.get("uints-over" if over else "uints-at")
    if field is Field.BOOLS:
        return bulk.get("bools-over" if over else "bools-at")
    if field in _INTS:
        return L.INT_LIMIT if over else L.INT_LIMIT - 1
    return "s" * 5000  # bools and extensions: a long string will do


def _empty_value(field: Field) -> object:
    if field in _STRINGS:
        return ""
    if field is Field.METADATA:
        return b""
    if field in _INTS:
        return 0
    if field is Field.BOOL:
        return False
    if field is Field.KEYS:
        return [b""]  # one empty key; an empty list is often legal
    if field in _LISTS:
        return []
    return {}


Mutation = Callable[[str, Payload, random.Random, Bulk], tuple[str, bytes] | None]


def _pick(
    fields: dict[str, Field], rng: random.Random, kinds: tuple[Field, ...] = ()
) -> str | None:
    names = [n for n, f in fields.items() if not kinds or f in kinds]
    return rng.choice(names) if names else None


def _with(payload: Payload, name: str, value: object) -> bytes:
    return wire.encode({**payload, name: value})


def _missing(
    kind: str, payload: Payload, rng: random.Random, bulk: Bulk
) -> tuple[str, bytes] | None:
    name = _pick(SCHEMAS[kind], rng)
    if name is None:
        return None
    return f"missing:{name}", wire.encode({k: v for k, v in payload.items() if k != name})


def _wrong_type(
    kind: str, payload: Payload, rng: random.Random, bulk: Bulk
) -> tuple[str, bytes] | None:
    name = _pick(SCHEMAS[kind], rng)
    if name is None:
        return None
    return f"wrong-type:{name}", _with(payload, name, rng.choice(_wrong_pool(SCHEMAS[kind][name])))


def _bool_for_int(
    kind: str, payload: Payload, rng: random.Random, bulk: Bulk
) -> tuple[str, bytes] | None:
    name = _pick(SCHEMAS[kind], rng, (*_INTS, Field.UINTS))
    if name is None:
        return None
    value: object = [True, False] if SCHEMAS[kind][name] is Field.UINTS else rng.random() < 0.5
    return f"bool-for-int:{name}", _with(payload, name, value)


def _negative(
    kind: str, payload: Payload, rng: random.Random, bulk: Bulk
) -> tuple[str, bytes] | None:
    name = _pick(SCHEMAS[kind], rng, (*_INTS, Field.UINTS))
    if name is None:
        return None
    number = rng.choice((-1, -(2**31), -(2**63)))
    value: object = [number] if SCHEMAS[kind][name] is Field.UINTS else number
    return f"negative:{name}", _with(payload, name, value)


def _huge(kind: str, payload: Payload, rng: random.Random, bulk: Bulk) -> tuple[str, bytes] | None:
    name = _pick(SCHEMAS[kind], rng, (*_INTS, Field.UINTS))
    if name is None:
        return None
    number = rng.choice((2**63 - 1, 2**63, 2**64 - 1, 2**32, 2**31))
    value: object = [number] if SCHEMAS[kind][name] is Field.UINTS else number
    return f"huge:{name}", _with(payload, name, value)


def _float_for_int(
    kind: str, payload: Payload, rng: random.Random, bulk: Bulk
) -> tuple[str, bytes] | None:
    name = _pick(SCHEMAS[kind], rng, _INTS)
    if name is None:
        return None
    return f"float-for-int:{name}", _with(payload, name, rng.choice((0.0, 1.0, -0.5, 1e300)))


def _size(over: bool) -> Mutation:
    def mutation(
        kind: str, payload: Payload, rng: random.Random, bulk: Bulk
    ) -> tuple[str, bytes] | None:
        name = _pick(SCHEMAS[kind], rng, (*_STRINGS, Field.METADATA, *_LISTS, *_INTS))
        if name is None:
            return None
        label = "over-limit" if over else "at-limit"
        if SCHEMAS[kind][name] is Field.METADATA and rng.random() < 0.9:
            # 16 MiB frames are costly to send a million times over: mostly 1 MiB.
            return f"large:{name}", _with(payload, name, bulk.get("metadata-1m"))
        return f"{label}:{name}", _with(
            payload, name, _size_value(SCHEMAS[kind][name], over, bulk, rng)
        )

    return mutation


def _empty(kind: str, payload: Payload, rng: random.Random, bulk: Bulk) -> tuple[str, bytes] | None:
    name = _pick(SCHEMAS[kind], rng)
    if name is None:
        return None
    return f"empty:{name}", _with(payload, name, _empty_value(SCHEMAS[kind][name]))


def _extra_key(
    kind: str, payload: Payload, rng: random.Random, bulk: Bulk
) -> tuple[str, bytes] | None:
    key = rng.choice(("extra", "kvpeer2", "x" * 300, "padding", "__class__", "reason"))
    value = rng.choice((1, "v", b"\x00" * 64, [1, 2, 3], {"nested": {"deeper": [None]}}, None))
    return "extra-key", wire.encode({**payload, key: value})


def _many_extra_keys(
    kind: str, payload: Payload, rng: random.Random, bulk: Bulk
) -> tuple[str, bytes] | None:
    extra = {f"k{i}": i for i in range(rng.choice((1000, 20_000)))}
    return "extra-keys-many", wire.encode({**payload, **extra})


def _duplicate_key(
    kind: str, payload: Payload, rng: random.Random, bulk: Bulk
) -> tuple[str, bytes] | None:
    name = rng.choice([*SCHEMAS[kind], "type"])
    pairs = list(payload.items())
    second = rng.choice(_wrong_pool(SCHEMAS[kind][name])) if name in SCHEMAS[kind] else "lookup"
    if rng.random() < 0.5:
        pairs.append((name, second))
    else:
        pairs.insert(0, (name, second))
    return f"duplicate-key:{name}", wire.map_of_pairs(pairs)


def _non_str_key(
    kind: str, payload: Payload, rng: random.Random, bulk: Bulk
) -> tuple[str, bytes] | None:
    pairs: list[tuple[object, object]] = list(payload.items())
    pairs.append((rng.choice((1, b"bin-key", 2.5, None)), "value"))
    return "non-str-key", wire.map_of_pairs(pairs)


def _bad_type(
    kind: str, payload: Payload, rng: random.Random, bulk: Bulk
) -> tuple[str, bytes] | None:
    if rng.random() < 0.2:
        return "type:missing", wire.encode({k: v for k, v in payload.items() if k != "type"})
    label, value = rng.choice(_BAD_TYPES)
    return label, wire.encode({**payload, "type": value})


def _nested(
    kind: str, payload: Payload, rng: random.Random, bulk: Bulk
) -> tuple[str, bytes] | None:
    name = _pick(SCHEMAS[kind], rng)
    if name is None:
        return None
    value: object = None
    for _ in range(rng.choice((50, 500))):
        value = [value]
    return f"nested:{name}", _with(payload, name, value)


def _length_mismatch(
    kind: str, payload: Payload, rng: random.Random, bulk: Bulk
) -> tuple[str, bytes] | None:
    other = {"fetch": "block_indexes", "lookup_resp": "hits"}.get(kind)
    if other is None:
        return None
    items = payload.get(other)
    if not isinstance(items, list):
        return None
    changed = [*items, items[0] if items else 0] if rng.random() < 0.5 else items[:-1]
    if changed == items:
        changed = [*items, 0]
    return f"length-mismatch:{other}", _with(payload, other, changed)


_MUTATIONS: Final[tuple[tuple[Mutation, float], ...]] = (
    (_missing, 3.0),
    (_wrong_type, 5.0),
    (_bool_for_int, 2.0),
    (_negative, 1.5),
    (_huge, 1.5),
    (_float_for_int, 1.0),
    (_size(False), 0.4),
    (_size(True), 0.6),
    (_empty, 1.5),
    (_extra_key, 2.0),
    (_many_extra_keys, 0.05),
    (_duplicate_key, 2.0),
    (_non_str_key, 0.7),
    (_bad_type, 2.0),
    (_nested, 0.3),
    (_length_mismatch, 1.5),
)
_FUNCTIONS = tuple(m for m, _ in _MUTATIONS)
_WEIGHTS = tuple(w for _, w in _MUTATIONS)


def mutate(kind: str, payload: Payload, rng: random.Random, bulk: Bulk) -> tuple[str, bytes]:
    """Break one thing about ``payload`` (a ``kind`` message); (label, frame)."""
    for _ in range(8):
        (mutation,) = rng.choices(_FUNCTIONS, _WEIGHTS)
        result = mutation(kind, payload, rng, bulk)
        if result is not None:
            return result
    return _wrong_type(kind, payload, rng, bulk) or ("type:missing", wire.encode({}))
