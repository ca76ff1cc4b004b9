"""Helpers of the shm plane's tests: pools backed by /dev/shm files, backends of this
process, and a producer/consumer :class:`Pair` in which the consumer granted the producer."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from kvpeer.host import BlockPool
from kvpeer.protocol import Connect
from kvpeer.session.ports import TransferEvent
from kvpeer.testing import make_hello
from kvpeer.testing.conformance import TIMEOUT_S
from kvpeer.transport.data.base import PrimaryRegion
from kvpeer.transport.data.shm import ShmBackend

__all__ = [
    "BLOCK",
    "Pair",
    "backend",
    "hello",
    "open_fds_to",
    "pair",
    "region_of",
    "shm_path",
    "wait_event",
]

BLOCK = 4096


def shm_path() -> str:
    return f"/dev/shm/kvpeer-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def region_of(pool: BlockPool) -> PrimaryRegion:
    return PrimaryRegion(pool.view, pool.num_blocks, pool.block_len, pool.shm_path)


def backend(
    pool: BlockPool,
    local_id: str,
    *,
    allowed_uids: frozenset[int] | None = None,
    same_process: bool = True,
) -> ShmBackend:
    """A backend of this process over ``pool`` (``same_process`` unless a test says not)."""
    return ShmBackend(
        region_of(pool),
        lambda: None,
        local_id=local_id,
        allowed_uids=allowed_uids,
        same_process=same_process,
    )


def hello(num_blocks: int, block_len: int = BLOCK) -> Connect:
    return make_hello("B", num_blocks=num_blocks, block_len=block_len, hash_seed="seed",
                      fingerprint=None, kvpeer=False)  # fmt: skip


def wait_event(backend: ShmBackend, peer: str, transfer_id: int) -> TransferEvent:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        for event in backend.poll(peer):
            assert event.transfer_id == transfer_id
            return event
        time.sleep(0.0005)
    pytest.fail(f"transfer {transfer_id} not reported in {TIMEOUT_S} s")


class Pair:
    """Producer A and consumer B (whose region A maps); B has granted A."""

    def __init__(self, num_blocks: int = 16, block_len: int = BLOCK) -> None:
        self.a_pool = BlockPool(num_blocks, block_len, shm_path=shm_path())
        self.b_pool = BlockPool(num_blocks, block_len, shm_path=shm_path())
        self.notified = threading.Event()
        self.a = ShmBackend(
            region_of(self.a_pool), self.notified.set, local_id="A", same_process=True
        )
        self.b = backend(self.b_pool, "B")
        self.b.grant("A")
        self.hello_b = hello(num_blocks, block_len)

    def close(self) -> None:
        self.a.close()
        self.b.close()
        self.a_pool.close()
        self.b_pool.close()


@pytest.fixture
def pair() -> Iterator[Pair]:
    pair = Pair()
    yield pair
    pair.close()


def open_fds_to(path: str) -> list[int]:
    """Our descriptors open on ``path``."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == path:
                found.append(int(name))
        except OSError:
            continue
    return found
