"""Verifiable synthetic blocks, so any peer can test a link without an engine.

Block ``i`` has key ``sha256(b"kvpeer-synthetic:%d" % i).digest() + bytes(4)``
(KV-cache group 0) and its bytes are little-endian uint64 words, word ``k``
equal to ``(i << 32) + k``.
"""

from __future__ import annotations

import hashlib
import struct

__all__ = ["synthetic_block", "synthetic_index", "synthetic_key"]


def synthetic_key(index: int) -> bytes:
    return hashlib.sha256(b"kvpeer-synthetic:%d" % index).digest() + bytes(4)


def synthetic_block(index: int, block_len: int) -> bytes:
    if block_len % 8:
        raise ValueError(
            f"synthetic blocks need a block_len that is a multiple of 8, got {block_len}"
        )
    words = block_len // 8
    base = index << 32
    return struct.pack(f"<{words}Q", *range(base, base + words))


def synthetic_index(block: bytes | memoryview) -> int | None:
    """The index a synthetic block encodes, or None if the bytes are not one."""
    if len(block) < 8 or len(block) % 8:
        return None
    first = struct.unpack_from("<Q", block, 0)[0]
    index = first >> 32
    if first & 0xFFFFFFFF or block != synthetic_block(index, len(block)):
        return None
    return int(index)
