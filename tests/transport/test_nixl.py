"""The ``nixl`` data plane over real NIXL agents (UCX, host memory).

Two backends in one process (two agents), one in a child process over a /dev/shm
region, and, when vLLM is installed, vLLM's own ``NixlTransport`` as the peer. The
contract checks shared with the other planes live in ``kvpeer.testing.conformance``; these are the
NIXL specifics: registration, remove-before-add, cancel, teardown and interop.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import multiprocessing
import os
import random
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import pytest
from msgspec.structs import replace

from kvpeer.errors import DataPlaneError
from kvpeer.host import BlockPool
from kvpeer.protocol import Connect, TransportChoice
from kvpeer.session.ports import TransferEvent
from kvpeer.testing import make_hello
from kvpeer.testing.conformance import collect_events
from kvpeer.transport.data import nixl as nixl_module
from kvpeer.transport.data.base import PrimaryRegion
from kvpeer.transport.data.nixl import INSTALL_HINT, NixlBackend
from kvpeer.transport.data.planes import DataPlaneSet

pytest.importorskip("nixl._api", reason="nixl is not installed")

NUM_BLOCKS = 64
BLOCK_LEN = 16 * 1024
TIMEOUT_S = 10.0
SEED = "test-seed"


def hello(
    peer_id: str, backend: NixlBackend, region: PrimaryRegion, *, kvpeer: bool = False
) -> Connect:
    """The ``connect`` a node with ``backend`` over ``region`` sends."""
    return make_hello(peer_id, region, base_addr=region.base_addr, hash_seed=SEED,
                      agent_metadata=backend.agent_metadata(), fingerprint=None,
                      kvpeer=kvpeer, transports={"nixl": {}})  # fmt: skip


def region_of(pool: BlockPool) -> PrimaryRegion:
    return PrimaryRegion(pool.view, pool.num_blocks, pool.block_len, pool.shm_path)


@dataclass
class Side:
    name: str
    pool: BlockPool
    region: PrimaryRegion
    backend: NixlBackend
    notified: threading.Event = field(default_factory=threading.Event)

    def hello(self, *, kvpeer: bool = False) -> Connect:
        return hello(self.name, self.backend, self.region, kvpeer=kvpeer)

    def fill(self, slots: Sequence[int]) -> dict[int, bytes]:
        contents: dict[int, bytes] = {}
        for slot in slots:
            data = random.randbytes(self.pool.block_len)
            self.pool.slot_view(slot)[:] = data
            contents[slot] = data
        return contents

    def block(self, slot: int) -> bytes:
        return bytes(self.pool.slot_view(slot))


MakeSide = Callable[..., Side]


@pytest.fixture
def make_side() -> Iterator[MakeSide]:
    sides: list[Side] = []

    def make(name: str, num_blocks: int = NUM_BLOCKS, block_len: int = BLOCK_LEN) -> Side:
        pool = BlockPool(num_blocks, block_len)
        region = region_of(pool)
        notified = threading.Event()
        try:
            backend = NixlBackend(region, notified.set)
        except BaseException:
            pool.close()
            raise
        side = Side(name, pool, region, backend, notified)
        sides.append(side)
        return side

    yield make
    for side in sides:
        side.backend.close()
    for side in sides:
        side.pool.close()


@pytest.fixture
def pair(make_side: MakeSide) -> tuple[Side, Side]:
    """A and B, each registered with the other (a vLLM-style handshake)."""
    a, b = make_side("A"), make_side("B")
    assert a.backend.add_peer(b.name, b.hello(), None) == {}
    assert b.backend.add_peer(a.name, a.hello(), None) == {}
    return a, b


def wait_for(
    backend: NixlBackend, peer: str, ids: Sequence[int], *, settle_s: float = 0.0
) -> dict[int, TransferEvent]:
    """Poll until every id in ``ids`` was reported (once); then ``settle_s`` more."""
    return collect_events(lambda: backend.poll(peer), ids, settle_s=settle_s, what="nixl")


def write(a: Side, b: Side, local: Sequence[int], remote: Sequence[int]) -> TransferEvent:
    transfer_id = a.backend.write_blocks(b.name, local, remote)
    return wait_for(a.backend, b.name, [transfer_id])[transfer_id]


# -- setup and negotiation -------------------------------------------------------------------


def test_agent_is_named_by_uuid_and_offers_the_base_connect(pair: tuple[Side, Side]) -> None:
    a, b = pair
    assert uuid.UUID(a.backend.agent_name) != uuid.UUID(b.backend.agent_name)
    assert a.backend.name == "nixl"
    assert a.backend.offer() == {}
    metadata = a.backend.agent_metadata()
    assert metadata
    assert metadata == a.backend.agent_metadata()
    assert a.backend.usable_with({}, b.hello())
    no_agent = Connect(
        peer_id="x", agent_metadata=b"", base_addr=0, num_blocks=1, block_len=1, hash_seed=SEED
    )
    assert not a.backend.usable_with(None, no_agent)


def test_without_nixl_construction_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "nixl._api", None)  # makes the import fail
    assert not NixlBackend.available()
    pool = BlockPool(1, 64)
    try:
        with pytest.raises(DataPlaneError) as raised:
            NixlBackend(region_of(pool))
    finally:
        pool.close()
    assert str(raised.value) == INSTALL_HINT
    assert "pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1" in INSTALL_HINT


def test_add_peer_rejects_what_cannot_be_written(make_side: MakeSide) -> None:
    a, b = make_side("A"), make_side("B")
    good = b.hello()
    bad = {
        "no metadata": replace(good, agent_metadata=b""),
        "garbage metadata": replace(good, agent_metadata=b"not nixl metadata"),
        "our own agent": replace(good, agent_metadata=a.backend.agent_metadata()),
        "block_len": replace(good, block_len=BLOCK_LEN * 2, num_blocks=NUM_BLOCKS // 2),
        "beyond the registration": replace(good, base_addr=good.base_addr + BLOCK_LEN),
        "more blocks than registered": replace(good, num_blocks=NUM_BLOCKS + 1),
        "unaddressable": replace(good, num_blocks=2**62),
    }
    for what, connect in bad.items():
        with pytest.raises(DataPlaneError):
            a.backend.add_peer("B", connect, None)
        with pytest.raises(DataPlaneError, match="not registered"):
            a.backend.write_blocks("B", [0], [0])
        assert a.backend.statistics().peers == 0, what
    a.backend.add_peer("B", good, None)  # failures left nothing behind
    sent = a.fill([0])
    assert write(a, b, [0], [1]).success
    assert b.block(1) == sent[0]


def test_data_plane_set_uses_nixl_for_a_vllm_peer(make_side: MakeSide) -> None:
    a, b = make_side("A"), make_side("B")
    plane = DataPlaneSet(a.region, [a.backend])
    assert plane.describe().agent_metadata == a.backend.agent_metadata()
    assert plane.register_peer("vllm", b.hello()) is None  # no kvpeer extension
    assert plane.chosen("vllm") == "nixl"
    plane.peer_acknowledged("vllm", None)  # a vLLM ack: it writes into us with NIXL
    sent = a.fill([3])
    transfer_id = plane.write_blocks("vllm", [3], [4])
    deadline = time.monotonic() + TIMEOUT_S
    events: list[TransferEvent] = []
    while not events and time.monotonic() < deadline:
        events = plane.poll("vllm")
        time.sleep(0.0005)
    assert events == [TransferEvent(transfer_id, True)]
    assert b.block(4) == sent[3]
    choice = plane.register_peer("kvpeer", b.hello(kvpeer=True))
    assert choice == TransportChoice(name="nixl", params={})


# -- transfers -------------------------------------------------------------------------------


def test_blocks_land_byte_exact(pair: tuple[Side, Side]) -> None:
    a, b = pair
    b.fill(range(NUM_BLOCKS))
    cases = [([0], [0]), ([5, 6, 7], [20, 21, 22]), ([9, 2, 40, 13], [63, 0, 31, 17])]
    for local, remote in cases:
        sent = a.fill(local)
        before = [b.block(s) for s in range(NUM_BLOCKS)]
        assert write(a, b, local, remote).success
        expected = list(before)
        for src, dst in zip(local, remote, strict=True):
            expected[dst] = sent[src]
        assert [b.block(s) for s in range(NUM_BLOCKS)] == expected, (local, remote)


def test_many_scattered_blocks_in_one_transfer_both_ways(pair: tuple[Side, Side]) -> None:
    a, b = pair
    rng = random.Random(7)
    local = rng.sample(range(NUM_BLOCKS), 48)
    remote = rng.sample(range(NUM_BLOCKS), 48)
    # B writes back into the 16 slots A does not send from, from the 16 A does not fill.
    back_from = [s for s in range(NUM_BLOCKS) if s not in remote]
    back_to = [s for s in range(NUM_BLOCKS) if s not in local][::-1]
    sent_a, sent_b = a.fill(local), b.fill(back_from)
    to_b = a.backend.write_blocks(b.name, local, remote)
    to_a = b.backend.write_blocks(a.name, back_from, back_to)
    assert wait_for(a.backend, b.name, [to_b])[to_b].success
    assert wait_for(b.backend, a.name, [to_a])[to_a].success
    for src, dst in zip(local, remote, strict=True):
        assert b.block(dst) == sent_a[src]
    for src, dst in zip(back_from, back_to, strict=True):
        assert a.block(dst) == sent_b[src]
    stats = a.backend.statistics()
    assert (stats.succeeded, stats.blocks_written) == (1, 48)
    assert stats.bytes_written == 48 * BLOCK_LEN
    assert (stats.queued, stats.running, stats.failed) == (0, 0, 0)


def test_completion_wakes_the_driver(pair: tuple[Side, Side]) -> None:
    a, b = pair
    a.notified.clear()
    a.backend.write_blocks(b.name, [0, 1], [2, 3])
    assert a.notified.wait(TIMEOUT_S)


def test_an_empty_write_succeeds_without_nixl(pair: tuple[Side, Side]) -> None:
    a, b = pair
    transfer_id = a.backend.write_blocks(b.name, [], [])
    assert wait_for(a.backend, b.name, [transfer_id]) == {
        transfer_id: TransferEvent(transfer_id, True)
    }


def test_bad_slots_and_unknown_peers_are_refused_by_name(make_side: MakeSide) -> None:
    a, b = make_side("A", num_blocks=8), make_side("B", num_blocks=4)
    a.backend.add_peer(b.name, b.hello(), None)
    cases: list[tuple[list[int], list[int], str]] = [
        ([8], [0], "local slot 8"),
        ([0], [4], "remote .* slot 4"),
        ([-1], [0], "local slot -1"),
        ([0], [-1], "remote .* slot -1"),
        ([True], [0], "local slot True"),
        ([0, 1], [0], "2 local slots but 1 remote"),
    ]
    for local, remote, message in cases:
        with pytest.raises(DataPlaneError, match=message):
            a.backend.write_blocks(b.name, local, remote)
    with pytest.raises(DataPlaneError, match="'nobody' is not registered"):
        a.backend.write_blocks("nobody", [0], [0])
    assert a.backend.poll("nobody") == []
    assert a.backend.statistics().succeeded == 0


def test_poll_is_per_peer_and_a_shared_agent_outlives_one_peer(pair: tuple[Side, Side]) -> None:
    a, b = pair
    a.backend.add_peer("B-again", b.hello(), None)  # a second peer id, the same NIXL agent
    sent = a.fill(range(8))
    to_b = [a.backend.write_blocks(b.name, [i], [i]) for i in range(4)]
    to_again = [a.backend.write_blocks("B-again", [i + 4], [i + 8]) for i in range(4)]
    assert sorted(wait_for(a.backend, "B-again", to_again)) == to_again
    assert sorted(wait_for(a.backend, b.name, to_b)) == to_b
    assert a.backend.poll(b.name) == a.backend.poll("B-again") == []
    a.backend.remove_peer("B-again")
    assert write(a, b, [0], [20]).success  # the agent is still loaded for B
    assert [b.block(i + 8) for i in range(4)] == [sent[i + 4] for i in range(4)]
    assert b.block(20) == sent[0]


# -- cancel ----------------------------------------------------------------------------------


@pytest.mark.parametrize("wait", [True, False])
def test_cancel_reports_only_busy_transfers(make_side: MakeSide, wait: bool) -> None:
    a, b = make_side("A", block_len=256 * 1024), make_side("B", block_len=256 * 1024)
    a.backend.add_peer(b.name, b.hello(), None)
    a.fill(range(NUM_BLOCKS))
    ids = [
        a.backend.write_blocks(b.name, [2 * i, 2 * i + 1], [2 * i, 2 * i + 1]) for i in range(32)
    ]
    busy = a.backend.cancel(ids, wait=wait)
    assert set(busy) <= set(ids)
    if not wait:
        assert busy == []
    sentinel = a.backend.write_blocks(b.name, [0], [0])
    events = wait_for(a.backend, b.name, [sentinel, *busy], settle_s=0.05)
    assert set(events) == {sentinel, *busy}, "a released or abandoned transfer was reported"
    assert events[sentinel].success
    deadline = time.monotonic() + TIMEOUT_S
    while a.backend.statistics().abandoned and time.monotonic() < deadline:
        time.sleep(0.001)  # abandoned handles are released once NIXL lets go
    stats = a.backend.statistics()
    assert (stats.queued, stats.running, stats.abandoned) == (0, 0, 0)


def test_cancel_after_completion_or_of_unknown_ids_is_harmless(pair: tuple[Side, Side]) -> None:
    a, b = pair
    done = a.backend.write_blocks(b.name, [0], [0])
    deadline = time.monotonic() + TIMEOUT_S
    while a.backend.statistics().succeeded == 0 and time.monotonic() < deadline:
        time.sleep(0.0005)
    assert a.backend.cancel([done, 10_000], wait=True) == []  # finished, not yet polled
    assert wait_for(a.backend, b.name, [], settle_s=0.05) == {}


# -- teardown --------------------------------------------------------------------------------


def test_remove_peer_drops_its_transfers_and_readd_works(pair: tuple[Side, Side]) -> None:
    a, b = pair
    sent = a.fill(range(8))
    ids = [a.backend.write_blocks(b.name, [i], [i]) for i in range(8)]
    a.backend.remove_peer(b.name)
    a.backend.remove_peer(b.name)  # idempotent
    assert a.backend.poll(b.name) == []
    assert a.backend.cancel(ids, wait=True) == []
    with pytest.raises(DataPlaneError):
        a.backend.write_blocks(b.name, [0], [0])
    assert a.backend.statistics().peers == 0
    a.backend.add_peer(b.name, b.hello(), None)
    assert write(a, b, [1], [30]).success
    assert b.block(30) == sent[1]


def test_add_peer_again_replaces_the_registration(pair: tuple[Side, Side]) -> None:
    a, b = pair
    pending = a.backend.write_blocks(b.name, [0], [0])
    a.backend.add_peer(b.name, b.hello(), None)  # the peer reconnected: remove, then add
    assert a.backend.statistics().peers == 1
    sent = a.fill([2])
    events = wait_for(a.backend, b.name, [], settle_s=0.02)
    assert pending not in events, "a transfer of the old registration was reported"
    assert write(a, b, [2], [9]).success
    assert b.block(9) == sent[2]


def test_a_slow_registration_is_logged(
    make_side: MakeSide, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine waits for a registration (it runs under the tier's lock): a slow one
    is named in the log, a quick one is not."""
    a, b = make_side("A"), make_side("B")
    caplog.set_level(logging.WARNING, logger="kvpeer.nixl")
    monkeypatch.setattr(nixl_module, "SLOW_REGISTRATION_S", 3600.0)
    a.backend.add_peer(b.name, b.hello(), None)
    assert not [r for r in caplog.records if "registering" in r.getMessage()]
    monkeypatch.setattr(nixl_module, "SLOW_REGISTRATION_S", 0.0)
    a.backend.add_peer(b.name, b.hello(), None)
    (record,) = [r for r in caplog.records if "registering" in r.getMessage()]
    assert b.name in record.getMessage()
    assert f"{NUM_BLOCKS} x {BLOCK_LEN} bytes" in record.getMessage()


def test_close_is_idempotent_and_final(pair: tuple[Side, Side]) -> None:
    a, b = pair
    a.fill([0])
    assert write(a, b, [0], [0]).success
    a.backend.write_blocks(b.name, [1], [1])  # maybe still in flight at close
    a.backend.close()
    a.backend.close()
    with pytest.raises(DataPlaneError, match="closed"):
        a.backend.write_blocks(b.name, [0], [0])
    with pytest.raises(DataPlaneError, match="closed"):
        a.backend.add_peer(b.name, b.hello(), None)
    assert a.backend.poll(b.name) == []
    assert a.backend.cancel([1, 2], wait=True) == []
    a.backend.remove_peer(b.name)
    stats = a.backend.statistics()
    assert (stats.peers, stats.queued, stats.running, stats.abandoned) == (0, 0, 0, 0)


# -- another process -------------------------------------------------------------------------


def _serve_region(conn: Connection, shm_path: str, num_blocks: int, block_len: int) -> None:
    """Child: a NixlBackend over a /dev/shm pool; checks the blocks the parent names."""
    pool = BlockPool(num_blocks, block_len, shm_path=shm_path)
    backend = NixlBackend(region_of(pool))
    try:
        conn.send((backend.agent_metadata(), region_of(pool).base_addr))
        expected: dict[int, bytes] = conn.recv()
        conn.send(sorted(s for s, data in expected.items() if bytes(pool.slot_view(s)) != data))
        conn.recv()  # the parent is done with us
    finally:
        backend.close()
        pool.close()


@pytest.fixture
def shm_path() -> Iterator[str]:
    path = f"/dev/shm/kvpeer-test-nixl-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield path
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


@pytest.mark.slow  # a NIXL agent in a child process
def test_write_into_another_process_then_it_dies(make_side: MakeSide, shm_path: str) -> None:
    a = make_side("A")
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    child = context.Process(
        target=_serve_region, args=(theirs, shm_path, NUM_BLOCKS, BLOCK_LEN), daemon=True
    )
    child.start()
    try:
        assert ours.poll(60), "the child did not start"
        metadata, base_addr = ours.recv()
        peer = Connect(
            peer_id="child",
            agent_metadata=metadata,
            base_addr=base_addr,
            num_blocks=NUM_BLOCKS,
            block_len=BLOCK_LEN,
            hash_seed=SEED,
        )
        a.backend.add_peer("child", peer, None)
        local = random.Random(3).sample(range(NUM_BLOCKS), 40)
        remote = list(range(NUM_BLOCKS - 1, NUM_BLOCKS - 41, -1))
        sent = a.fill(local)
        transfer_id = a.backend.write_blocks("child", local, remote)
        assert wait_for(a.backend, "child", [transfer_id])[transfer_id].success
        expected = {dst: sent[src] for src, dst in zip(local, remote, strict=True)}
        ours.send(expected)
        assert ours.recv() == [], "blocks the child saw differ"
        with open(shm_path, "rb") as region:  # and through the file, independently
            data = region.read()
        for slot, block in expected.items():
            assert data[slot * BLOCK_LEN : (slot + 1) * BLOCK_LEN] == block
        ours.send("bye")
        child.join(30)
        assert child.exitcode == 0
        assert not os.path.exists(shm_path)
        late = a.backend.write_blocks("child", [0], [0])
        assert not wait_for(a.backend, "child", [late])[late].success, "wrote into a dead peer"
        a.backend.remove_peer("child")
    finally:
        if child.is_alive():
            child.kill()
            child.join(10)


# -- vLLM ------------------------------------------------------------------------------------


def test_vllm_nixl_transport_and_ours_write_into_each_other(make_side: MakeSide) -> None:
    vllm_nixl = pytest.importorskip("vllm.v1.kv_offload.tiering.p2p.data.nixl")
    a = make_side("kvpeer")
    memory = mmap.mmap(-1, NUM_BLOCKS * BLOCK_LEN)
    view = memoryview(memory).cast("B", (NUM_BLOCKS, BLOCK_LEN))
    theirs = vllm_nixl.NixlTransport(str(uuid.uuid4()), view)
    try:
        assert theirs.available
        a.backend.add_peer(
            "vllm",
            Connect(
                peer_id="vllm",
                agent_metadata=theirs.get_agent_metadata(),
                base_addr=theirs.base_addr,
                num_blocks=theirs.num_blocks,
                block_len=theirs.block_len,
                hash_seed=SEED,
            ),
            None,
        )
        theirs.add_remote_peer(
            "kvpeer", a.backend.agent_metadata(), a.region.base_addr, NUM_BLOCKS, BLOCK_LEN
        )
        sent = a.fill([1, 2])
        transfer_id = a.backend.write_blocks("vllm", [1, 2], [10, 11])
        assert wait_for(a.backend, "vllm", [transfer_id])[transfer_id].success
        assert memory[10 * BLOCK_LEN : 12 * BLOCK_LEN] == sent[1] + sent[2]
        their_block = random.randbytes(BLOCK_LEN)
        memory[5 * BLOCK_LEN : 6 * BLOCK_LEN] = their_block
        theirs_id = theirs.write_blocks("kvpeer", [5], [33])
        deadline = time.monotonic() + TIMEOUT_S
        done: list[int] = []
        while theirs_id not in done and time.monotonic() < deadline:
            result = theirs.poll("kvpeer")
            assert theirs_id not in result.failed
            done.extend(result.done)
            time.sleep(0.0005)
        assert theirs_id in done
        assert a.block(33) == their_block
    finally:
        theirs.close()
        view.release()
        memory.close()
