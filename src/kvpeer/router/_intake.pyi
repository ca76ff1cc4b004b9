"""Types of the C extension kvpeer.router._intake (src/kvpeer/router/_intake.c)."""

from typing import Any

from kvpeer.router.indexloops import Masks
from kvpeer.router.kvevents import BlockHash

class Holders:
    def get(self, key: bytes, default: int = 0, /) -> int: ...
    def set_bit(self, key: bytes, index: int, /) -> None: ...
    def clear_bit(self, key: bytes, index: int, /) -> None: ...
    def items(self) -> list[tuple[bytes, int]]: ...
    def __len__(self) -> int: ...

class Core:
    """The index's containers and its per-block loops (kvpeer.router.indexcore)."""

    _hashes: list[dict[BlockHash, bytes]]
    _retired: list[dict[BlockHash, bytes]]
    _present: list[dict[str, dict[bytes, int]]]
    _speculative: list[dict[tuple[str, bytes], float]]
    _holders: dict[str, Masks]  # medium -> Holders
    _speculating: dict[tuple[str, bytes], int]
    _refcounted: frozenset[str]
    _prefix: bytes
    _max_retired: int
    def __init__(
        self, refcounted: frozenset[str], max_retired: int, unkeyed_prefix: bytes
    ) -> None: ...
    def _stored(
        self,
        engine: int,
        medium: str,
        parent: bytes,
        block_hashes: tuple[BlockHash, ...],
        tokens: bytes,
        width: int,
        /,
    ) -> tuple[int, bool]: ...
    def _removed(self, engine: int, medium: str, block_hashes: tuple[BlockHash, ...], /) -> int: ...

def stores_of(
    run: list[Any], tokens: list[bytes], /
) -> list[tuple[Any, tuple[BlockHash, ...], bytes]]: ...
def chain(parent: bytes, tokens: bytes, /) -> bytes: ...
def chain_keys(parent: bytes, tokens: bytes, width: int, /) -> tuple[bytes, ...]: ...
def translate(
    events: list[Any], classes: tuple[type, ...], max_tokens: int, /
) -> tuple[list[Any], dict[str, int], tuple[str, str] | None]: ...
def msgpack_tokens(raw: Any, max_count: int, /) -> bytes: ...
