"""The shm data plane: offers, same-host checks, copies, and safe unmapping."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from kvpeer.errors import DataPlaneError
from kvpeer.host import BlockPool
from kvpeer.protocol import Connect, TransportOffer
from kvpeer.session.ports import TransferEvent
from kvpeer.transport.data import shm
from kvpeer.transport.data.base import PrimaryRegion, WriteWindow
from kvpeer.transport.data.shm import INLINE_BYTES, PREFAULT_BYTES, ShmBackend, host_identity
from tests.transport.conformance import TIMEOUT_S

BLOCK = 4096


def shm_path() -> str:
    return f"/dev/shm/kvpeer-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def region_of(pool: BlockPool) -> PrimaryRegion:
    return PrimaryRegion(pool.view, pool.num_blocks, pool.block_len, pool.shm_path)


def hello(num_blocks: int, block_len: int = BLOCK) -> Connect:
    return Connect(
        peer_id="B",
        agent_metadata=b"",
        base_addr=0,
        num_blocks=num_blocks,
        block_len=block_len,
        hash_seed="seed",
    )


def wait_event(backend: ShmBackend, peer: str, transfer_id: int) -> TransferEvent:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        for event in backend.poll(peer):
            assert event.transfer_id == transfer_id
            return event
        time.sleep(0.0005)
    pytest.fail(f"transfer {transfer_id} not reported in {TIMEOUT_S} s")


class Pair:
    """Producer A (a backend over its pool) and consumer B (just a shared pool)."""

    def __init__(self, num_blocks: int = 16, block_len: int = BLOCK) -> None:
        self.a_pool = BlockPool(num_blocks, block_len, shm_path=shm_path())
        self.b_pool = BlockPool(num_blocks, block_len, shm_path=shm_path())
        self.notified = threading.Event()
        self.a = ShmBackend(region_of(self.a_pool), self.notified.set)
        self.b = ShmBackend(region_of(self.b_pool), lambda: None)
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


def test_needs_a_shared_file() -> None:
    pool = BlockPool(2, BLOCK)
    try:
        with pytest.raises(DataPlaneError, match="shared-memory file"):
            ShmBackend(region_of(pool), lambda: None)
    finally:
        pool.close()


def test_offer_names_file_host_and_size(pair: Pair) -> None:
    offer = pair.b.offer()
    assert offer["path"] == pair.b_pool.shm_path
    assert offer["host_id"] == host_identity()
    assert offer["size"] == 16 * BLOCK
    assert pair.a.usable_with(offer, pair.hello_b)


@pytest.mark.parametrize(
    "change",
    [
        {"host_id": "another-host"},
        {"path": "/dev/shm/kvpeer-test-no-such-file"},
        {"size": 8 * BLOCK},
        {"inode": 1},
    ],
    ids=["other-host", "missing-file", "wrong-size", "other-file"],
)
def test_not_usable_unless_same_host_and_file(pair: Pair, change: TransportOffer) -> None:
    offer = {**pair.b.offer(), **change}
    assert not pair.a.usable_with(offer, pair.hello_b)
    with pytest.raises(DataPlaneError, match="cannot map"):
        pair.a.add_peer("B", pair.hello_b, offer)


def test_not_usable_when_the_peer_region_differs(pair: Pair) -> None:
    assert not pair.a.usable_with(pair.b.offer(), hello(8))
    assert not pair.a.usable_with(None, pair.hello_b)


def test_copy_lands_notifies_and_counts(pair: Pair) -> None:
    """A small copy finishes inside write_blocks: the next poll sees it, no wake-up needed."""
    assert pair.a.add_peer("B", pair.hello_b, pair.b.offer()) == {}
    data = os.urandom(3 * BLOCK)
    pair.a_pool.view[0 : 3 * BLOCK] = data
    assert 3 * BLOCK <= INLINE_BYTES
    transfer_id = pair.a.write_blocks("B", [0, 1, 2], [5, 6, 9])
    assert [e.transfer_id for e in pair.a.poll("B") if e.success] == [transfer_id]
    assert not pair.notified.is_set()
    view = pair.b_pool.view
    assert bytes(view[5 * BLOCK : 7 * BLOCK]) == data[: 2 * BLOCK]
    assert bytes(view[9 * BLOCK : 10 * BLOCK]) == data[2 * BLOCK :]
    stats = pair.a.statistics()
    assert (stats.peers, stats.completed, stats.bytes_copied) == (1, 1, 3 * BLOCK)


def test_large_copy_runs_on_the_thread_and_notifies() -> None:
    """Past INLINE_BYTES the copy thread does the work and wakes the owner."""
    pair = Pair(num_blocks=8, block_len=INLINE_BYTES)
    try:
        assert pair.a.add_peer("B", pair.hello_b, pair.b.offer()) == {}
        data = os.urandom(2 * INLINE_BYTES)
        pair.a_pool.view[0 : 2 * INLINE_BYTES] = data
        transfer_id = pair.a.write_blocks("B", [0, 1], [3, 4])
        assert wait_event(pair.a, "B", transfer_id).success
        assert pair.notified.is_set()
        assert bytes(pair.b_pool.view[3 * INLINE_BYTES : 5 * INLINE_BYTES]) == data
    finally:
        pair.close()


def test_bytes_reach_another_process() -> None:
    """The consumer's region lives in a child process; our copy lands in its memory."""
    path = shm_path()
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import sys
                from kvpeer.host import BlockPool
                pool = BlockPool(4, {BLOCK}, shm_path={path!r})
                print("ready", flush=True)
                sys.stdin.readline()
                print(bytes(pool.view[{BLOCK} : {2 * BLOCK}]).hex(), flush=True)
                pool.close()
                """
            ),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    pool = BlockPool(4, BLOCK, shm_path=shm_path())
    backend = ShmBackend(region_of(pool), lambda: None)
    try:
        assert child.stdout is not None
        assert child.stdin is not None
        assert child.stdout.readline().strip() == "ready"
        offer: TransportOffer = {"path": path, "host_id": host_identity(), "size": 4 * BLOCK}
        backend.add_peer("child", hello(4), offer)
        data = os.urandom(BLOCK)
        pool.view[0:BLOCK] = data
        assert wait_event(backend, "child", backend.write_blocks("child", [0], [1])).success
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == data.hex()
        assert child.wait(TIMEOUT_S) == 0
    finally:
        backend.close()
        pool.close()
        if child.poll() is None:
            child.kill()
            child.wait()
        if os.path.exists(path):
            os.unlink(path)


def test_the_copy_thread_prefaults_a_new_mapping_after_add_peer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """add_peer runs inside the handshake: it must not wait for the peer's pages
    (faulting in a 64 MiB region took 11-120 ms per side of a first PD pull). The copy
    thread faults them in by pieces, and a small copy meanwhile still lands at once."""
    held = threading.Event()
    release = threading.Event()
    pieces: list[tuple[str, int, int]] = []

    def piece(mm: object, base: int, start: int, length: int) -> None:
        pieces.append((threading.current_thread().name, start, length))
        held.set()
        assert release.wait(TIMEOUT_S)

    monkeypatch.setattr(shm, "_prefault", piece)
    pair = Pair(num_blocks=2 * PREFAULT_BYTES // INLINE_BYTES, block_len=INLINE_BYTES)
    try:
        pair.a.add_peer("B", pair.hello_b, pair.b.offer())  # returns with a piece held
        assert held.wait(TIMEOUT_S)
        data = os.urandom(INLINE_BYTES)
        pair.a_pool.view[0:INLINE_BYTES] = data
        transfer_id = pair.a.write_blocks("B", [0], [3])
        assert [e.transfer_id for e in pair.a.poll("B") if e.success] == [transfer_id]
        assert bytes(pair.b_pool.view[3 * INLINE_BYTES : 4 * INLINE_BYTES]) == data
        release.set()
        deadline = time.monotonic() + TIMEOUT_S
        while len(pieces) < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert pieces == [
            ("kvpeer-shm-copy", 0, PREFAULT_BYTES),
            ("kvpeer-shm-copy", PREFAULT_BYTES, PREFAULT_BYTES),
        ]
    finally:
        release.set()
        pair.close()


def test_remove_peer_during_a_copy_is_safe_and_silent() -> None:
    """A big copy is stopped (or finished) before the mapping goes; never reported."""
    pair = Pair(num_blocks=64, block_len=1024 * 1024)
    try:
        pair.a.add_peer("B", pair.hello_b, pair.b.offer())
        ids = [pair.a.write_blocks("B", range(64), range(64)) for _ in range(4)]
        pair.a.remove_peer("B")
        assert pair.a.statistics().peers == 0
        assert pair.a.poll("B") == []
        assert pair.a.cancel(ids, wait=True) == []
        with pytest.raises(DataPlaneError, match="not registered"):
            pair.a.write_blocks("B", [0], [0])
        # The copy thread survived and serves a new registration.
        pair.a.add_peer("B", pair.hello_b, pair.b.offer())
        assert wait_event(pair.a, "B", pair.a.write_blocks("B", [1], [2])).success
    finally:
        pair.close()


def test_busy_copy_is_reported_after_a_waiting_cancel() -> None:
    pair = Pair(num_blocks=64, block_len=1024 * 1024)
    try:
        pair.a.add_peer("B", pair.hello_b, pair.b.offer())
        big = pair.a.write_blocks("B", range(64), range(64))
        queued = pair.a.write_blocks("B", [0], [0])
        deadline = time.monotonic() + TIMEOUT_S
        while pair.a.statistics().queued > 1 and time.monotonic() < deadline:
            time.sleep(0.0005)
        busy = pair.a.cancel([big, queued], wait=True)
        assert busy in ([], [big])  # copying, or already copied (then released)
        if busy:
            assert wait_event(pair.a, "B", big).success
        sentinel = pair.a.write_blocks("B", [1], [1])
        assert wait_event(pair.a, "B", sentinel).success
    finally:
        pair.close()


def test_writes_after_close_fail_and_close_is_idempotent(pair: Pair) -> None:
    pair.a.add_peer("B", pair.hello_b, pair.b.offer())
    pair.a.close()
    pair.a.close()
    with pytest.raises(DataPlaneError, match="closed"):
        pair.a.write_blocks("B", [0], [0])
    assert pair.a.statistics().peers == 0


def test_accept_writer_is_a_no_op(pair: Pair) -> None:
    pair.b.accept_writer("A", {}, WriteWindow())
    assert pair.b.statistics().peers == 0
