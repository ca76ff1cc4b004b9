"""Raw msgpack the typed codec would never produce: duplicate keys, cut frames, nesting.

Everything here is pure: bytes in, bytes out, randomness from the caller's
:class:`random.Random`.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Sequence

import msgspec

__all__ = ["bitflip", "deep_nesting", "encode", "map_of_pairs", "truncate"]

_ENCODER = msgspec.msgpack.Encoder()


def encode(value: object) -> bytes:
    """msgpack of ``value`` (maps, lists, str, bytes, ints in int64/uint64, floats)."""
    return _ENCODER.encode(value)


def map_header(count: int) -> bytes:
    if count < 16:
        return bytes([0x80 | count])
    if count < 1 << 16:
        return b"\xde" + struct.pack(">H", count)
    return b"\xdf" + struct.pack(">I", count)


def map_of_pairs(pairs: Sequence[tuple[object, object]]) -> bytes:
    """A msgpack map with exactly these entries in this order, duplicates kept."""
    return map_header(len(pairs)) + b"".join(encode(k) + encode(v) for k, v in pairs)


def truncate(frame: bytes, rng: random.Random) -> bytes:
    """``frame`` cut short somewhere inside (never empty, never whole)."""
    if len(frame) < 2:
        return frame[:0] + b"\x81"  # a map header promising an entry that never comes
    return frame[: rng.randrange(1, len(frame))]


def bitflip(frame: bytes, rng: random.Random, flips: int = 1) -> bytes:
    """``frame`` with ``flips`` random bits inverted."""
    data = bytearray(frame or b"\x80")
    for _ in range(flips):
        at = rng.randrange(len(data))
        data[at] ^= 1 << rng.randrange(8)
    return bytes(data)


def deep_nesting(depth: int, *, as_map: bool) -> bytes:
    """``depth`` nested one-element arrays (or maps ``{"type": ...}``) around a nil."""
    opener = map_header(1) + encode("type") if as_map else b"\x91"  # 0x91: [x]
    return opener * depth + b"\xc0"
