"""Types of the C extension kvpeer.router._intake (src/kvpeer/router/_intake.c)."""

from collections.abc import Callable
from typing import Any

from kvpeer.router.events import BlockHash

class Holders:
    def get(self, key: bytes, default: int = 0, /) -> int: ...
    def set_bit(self, key: bytes, index: int, /) -> None: ...
    def clear_bit(self, key: bytes, index: int, /) -> None: ...
    def items(self) -> list[tuple[bytes, int]]: ...
    def __len__(self) -> int: ...

def removed(
    hashes: dict[BlockHash, bytes],
    retired: dict[BlockHash, bytes],
    present: dict[bytes, int],
    holders: Holders,
    others: list[dict[bytes, int]],
    index: int,
    refcounted: bool,
    max_retired: int,
    block_hashes: tuple[BlockHash, ...],
    unkeyed_prefix: bytes,
    /,
) -> int: ...
def stored(
    hashes: dict[BlockHash, bytes],
    retired: dict[BlockHash, bytes],
    present: dict[bytes, int],
    holders: Holders,
    speculative: dict[tuple[str, bytes], float],
    medium: str,
    bit: int,
    index: int,
    refcounted: bool,
    parent: bytes,
    block_hashes: tuple[BlockHash, ...],
    tokens: bytes,
    width: int,
    unkeyed_prefix: bytes,
    chain: Callable[[bytes, bytes], bytes],
    unkeyed_of: Callable[[BlockHash], bytes],
    unspeculated: Callable[[tuple[str, bytes], int], None],
    /,
) -> tuple[int, bool]: ...
def stores_of(
    run: list[Any], tokens: list[bytes], /
) -> list[tuple[Any, tuple[BlockHash, ...], bytes]]: ...
def chain(parent: bytes, tokens: bytes, /) -> bytes: ...
def chain_keys(parent: bytes, tokens: bytes, width: int, /) -> tuple[bytes, ...]: ...
def translate(
    events: list[Any], classes: tuple[type, ...], max_tokens: int, /
) -> tuple[list[Any], dict[str, int], tuple[str, str] | None]: ...
def msgpack_tokens(raw: Any, max_count: int, /) -> bytes: ...
