"""Conformance checks for data planes (the :class:`~kvpeer.session.ports.DataPlane` contract).

Run it on a new plane the way ``tests/transport/test_conformance.py`` does: a factory
of :class:`Cluster` per plane, each check of :data:`CHECKS` called with it.

A :class:`Cluster` builds nodes, each a data plane over its own :class:`BlockPool`, and
connects pairs the way sessions do: each grants the other, ``register_peer`` with the
peer's ``connect`` (carrying our ``describe().offers``), then ``peer_acknowledged`` with
the choice the other side returned. Every check in :data:`CHECKS` takes a factory of
clusters, so one that needs a clean baseline (threads, file descriptors) can build its
own.

Planes run real threads: waits are deadline loops that poll until the event arrives
(or :data:`TIMEOUT_S` passes), sleeping at most a millisecond between polls.
"""

from __future__ import annotations

import abc
import enum
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvpeer.errors import DataPlaneError
from kvpeer.host import BlockPool
from kvpeer.protocol import Connect
from kvpeer.session.ports import TransferEvent
from kvpeer.testing.dataplane import Fabric, FakeDataPlane, Region
from kvpeer.testing.expect import raises, record_once, skip
from kvpeer.testing.harness import make_hello
from kvpeer.transport.base import NodeDataPlane
from kvpeer.transport.data.base import Backend, PrimaryRegion
from kvpeer.transport.data.planes import DataPlaneSet

__all__ = [
    "CHECKS",
    "TIMEOUT_S",
    "BackendCluster",
    "Cluster",
    "ClusterFactory",
    "FakeCluster",
    "NamedBackendCluster",
    "Node",
    "Windows",
    "collect_events",
    "hello_of",
    "wait_for_events",
]

TIMEOUT_S = 5.0
BLOCK_LEN = 4096
NUM_BLOCKS = 32

BackendFactory = Callable[[PrimaryRegion, Callable[[], None]], Backend]
#: A factory of backends that need the node's name (its control identity).
NamedBackendFactory = Callable[[str, PrimaryRegion, Callable[[], None]], Backend]


class Windows(enum.Enum):
    """How a plane treats writes into slots the consumer has not opened."""

    REFUSED = "refused"  # the transfer fails and the bytes do not land
    RECORDED = "recorded"  # the plane records a violation (the fake)
    UNENFORCED = "unenforced"  # one-sided writes (shm, nixl)


@dataclass
class Node:
    name: str
    pool: BlockPool
    plane: NodeDataPlane
    notified: threading.Event = field(default_factory=threading.Event)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def block_len(self) -> int:
        return self.pool.block_len

    def block(self, slot: int) -> bytes:
        start = slot * self.block_len
        return bytes(self.pool.view[start : start + self.block_len])

    def fill(self, slots: Sequence[int]) -> dict[int, bytes]:
        """Random contents into ``slots``; returns what each slot now holds."""
        contents: dict[int, bytes] = {}
        for slot in slots:
            data = os.urandom(self.block_len)
            start = slot * self.block_len
            self.pool.view[start : start + self.block_len] = data
            contents[slot] = data
        return contents

    def snapshot(self) -> list[bytes]:
        return [self.block(slot) for slot in range(self.num_blocks)]


def hello_of(name: str, plane: NodeDataPlane) -> Connect:
    """The ``connect`` a node named ``name`` over ``plane`` sends."""
    region = plane.describe()
    return make_hello(name, region, base_addr=region.base_addr, hash_seed="conformance-seed",
                      agent_metadata=region.agent_metadata, transports=region.offers)  # fmt: skip


class Cluster(abc.ABC):
    """Nodes of one plane kind; ``close`` releases every plane, pool and file.

    A plane's conformance run subclasses it and says how to build one node
    (:meth:`_make`); :class:`FakeCluster` and :class:`BackendCluster` are the two here."""

    windows: Windows = Windows.UNENFORCED
    validates_slots: bool = True  # write_blocks raises for slots outside the regions
    shm: bool = False  # back pools with files under /dev/shm

    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}
        self._tag = f"kvpeer-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def node(self, name: str, num_blocks: int = NUM_BLOCKS, block_len: int = BLOCK_LEN) -> Node:
        path = f"/dev/shm/{self._tag}-{name}" if self.shm else None
        pool = BlockPool(num_blocks, block_len, shm_path=path)
        try:
            node = self._make(name, pool)
        except BaseException:
            pool.close()
            raise
        self.nodes[name] = node
        return node

    @abc.abstractmethod
    def _make(self, name: str, pool: BlockPool) -> Node:
        """One node of this plane kind over ``pool``."""

    def connect(self, a: Node, b: Node) -> None:
        """Both handshakes, as two sessions do them."""
        a.plane.grant(b.name)
        b.plane.grant(a.name)
        a_writes_b = a.plane.register_peer(b.name, hello_of(b.name, b.plane))
        b_writes_a = b.plane.register_peer(a.name, hello_of(a.name, a.plane))
        a.plane.peer_acknowledged(b.name, b_writes_a)
        b.plane.peer_acknowledged(a.name, a_writes_b)

    def violations(self) -> list[str]:
        return []

    def files(self) -> list[str]:
        """Files this cluster created under /dev/shm (still present)."""
        return [name for name in os.listdir("/dev/shm") if name.startswith(self._tag)]

    def close(self) -> None:
        for node in self.nodes.values():
            node.plane.close()
        for node in self.nodes.values():
            node.pool.close()
        self.nodes.clear()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FakeCluster(Cluster):
    """The in-memory :class:`~kvpeer.testing.FakeDataPlane`, completing on poll."""

    windows = Windows.RECORDED

    def __init__(self) -> None:
        super().__init__()
        self.fabric = Fabric()

    def _make(self, name: str, pool: BlockPool) -> Node:
        region = Region(pool.num_blocks, pool.block_len, memory=pool.view)
        plane = FakeDataPlane(self.fabric, name, region, auto_complete=True)
        return Node(name, pool, plane)

    def violations(self) -> list[str]:
        return [v for plane in self.fabric.planes.values() for v in plane.violations]


class BackendCluster(Cluster):
    """Nodes whose plane is a :class:`DataPlaneSet` over one backend kind."""

    def __init__(self, backend: BackendFactory, *, shm: bool, windows: Windows) -> None:
        super().__init__()
        self._backend = backend
        self.shm = shm
        self.windows = windows

    def _new_backend(self, name: str, region: PrimaryRegion, notify: Callable[[], None]) -> Backend:
        return self._backend(region, notify)

    def _make(self, name: str, pool: BlockPool) -> Node:
        region = PrimaryRegion(pool.view, pool.num_blocks, pool.block_len, pool.shm_path)
        notified = threading.Event()
        plane = DataPlaneSet(region, [self._new_backend(name, region, notified.set)])
        return Node(name, pool, plane, notified)


class NamedBackendCluster(BackendCluster):
    """A :class:`BackendCluster` whose backends are told their node's name."""

    def __init__(self, backend: NamedBackendFactory, *, shm: bool, windows: Windows) -> None:
        super().__init__(
            lambda region, notify: backend("", region, notify), shm=shm, windows=windows
        )
        self._named = backend

    def _new_backend(self, name: str, region: PrimaryRegion, notify: Callable[[], None]) -> Backend:
        return self._named(name, region, notify)


ClusterFactory = Callable[[], Cluster]


# -- waiting ---------------------------------------------------------------------------------


def wait_for_events(
    node: Node, peer: str, ids: Sequence[int], *, settle_s: float = 0.0
) -> dict[int, TransferEvent]:
    """Poll ``node`` for ``peer`` until every id in ``ids`` was reported (see
    :func:`collect_events`)."""
    return collect_events(lambda: node.plane.poll(peer), ids, settle_s=settle_s, what=node.name)


def collect_events(
    poll: Callable[[], Sequence[TransferEvent]],
    ids: Sequence[int],
    *,
    settle_s: float = 0.0,
    what: str = "plane",
) -> dict[int, TransferEvent]:
    """Call ``poll`` (a plane's or a backend's, for one peer) until every id in ``ids``
    was reported.

    Returns every event seen (ids outside ``ids`` included); fails on a duplicate or
    when :data:`TIMEOUT_S` passes. ``settle_s``: keep polling that long afterwards,
    to catch events that must never come.
    """
    events: dict[int, TransferEvent] = {}
    deadline = time.monotonic() + TIMEOUT_S
    settle_until: float | None = None
    while True:
        for event in poll():
            record_once(events, event.transfer_id, event, "transfer")
        now = time.monotonic()
        if settle_until is None and set(ids) <= events.keys():
            settle_until = now + settle_s
        if settle_until is not None and now >= settle_until:
            return events
        if now > deadline:
            missing = sorted(set(ids) - events.keys())
            raise AssertionError(f"{what}: transfers {missing} not reported in {TIMEOUT_S} s")
        time.sleep(0.0005)


def _pair(cluster: Cluster, **sizes: int) -> tuple[Node, Node]:
    a, b = cluster.node("A", **sizes), cluster.node("B", **sizes)
    cluster.connect(a, b)
    return a, b


def _write(
    a: Node, b: Node, local: Sequence[int], remote: Sequence[int], *, open_slots: bool = True
) -> int:
    if open_slots:
        b.plane.expect_writes(a.name, remote)
    return a.plane.write_blocks(b.name, local, remote)


# -- checks ----------------------------------------------------------------------------------


def check_bytes_land_exactly(make: ClusterFactory) -> None:
    """1, 2, many, and non-contiguous blocks land byte for byte; nothing else changes."""
    cases = [
        ([0], [0]),
        ([1, 2], [5, 6]),
        (list(range(4, 24)), list(range(10, 30))),
        ([3, 0, 7, 5, 6], [9, 2, 4, 11, 12]),
        ([30, 31], [31, 1]),
    ]
    with make() as cluster:
        a, b = _pair(cluster)
        b.fill(range(b.num_blocks))
        for local, remote in cases:
            sent = a.fill(local)
            before = b.snapshot()
            transfer_id = _write(a, b, local, remote)
            events = wait_for_events(a, b.name, [transfer_id])
            assert events[transfer_id].success, events[transfer_id]
            expected = list(before)
            for src, dst in zip(local, remote, strict=True):
                expected[dst] = sent[src]
            assert b.snapshot() == expected, f"case {local} -> {remote}"
            b.plane.revoke_writes(a.name, remote)
        assert cluster.violations() == []


def check_both_directions(make: ClusterFactory) -> None:
    """Each node is producer and consumer at once."""
    with make() as cluster:
        a, b = _pair(cluster)
        sent_a, sent_b = a.fill([0, 1]), b.fill([2, 3])
        to_b = _write(a, b, [0, 1], [8, 9])
        to_a = _write(b, a, [2, 3], [4, 5])
        assert wait_for_events(a, b.name, [to_b])[to_b].success
        assert wait_for_events(b, a.name, [to_a])[to_a].success
        assert [b.block(8), b.block(9)] == [sent_a[0], sent_a[1]]
        assert [a.block(4), a.block(5)] == [sent_b[2], sent_b[3]]


def check_poll_is_once_and_per_peer(make: ClusterFactory) -> None:
    with make() as cluster:
        a, b, c = cluster.node("A"), cluster.node("B"), cluster.node("C")
        cluster.connect(a, b)
        cluster.connect(a, c)
        a.fill(range(8))
        to_b = [_write(a, b, [i], [i]) for i in range(4)]
        to_c = [_write(a, c, [i + 4], [i]) for i in range(4)]
        assert len(set(to_b + to_c)) == 8, "transfer ids are unique"
        seen_b = wait_for_events(a, b.name, to_b)
        seen_c = wait_for_events(a, c.name, to_c)
        assert sorted(seen_b) == sorted(to_b)
        assert sorted(seen_c) == sorted(to_c)
        assert all(e.success for e in [*seen_b.values(), *seen_c.values()])
        assert a.plane.poll(b.name) == []
        assert a.plane.poll(c.name) == []
        assert a.plane.poll("nobody") == []


def check_many_concurrent_transfers(make: ClusterFactory) -> None:
    with make() as cluster:
        a, b = _pair(cluster, num_blocks=128)
        sent = a.fill(range(128))
        pairs = [([i, i + 64], [127 - i, 63 - i]) for i in range(64)]
        ids = [_write(a, b, local, remote) for local, remote in pairs]
        events = wait_for_events(a, b.name, ids)
        assert sorted(events) == sorted(ids)
        assert all(e.success for e in events.values())
        for local, remote in pairs:
            for src, dst in zip(local, remote, strict=True):
                assert b.block(dst) == sent[src]


def check_unknown_peer_is_refused(make: ClusterFactory) -> None:
    with make() as cluster:
        a, _ = _pair(cluster)
        with raises(DataPlaneError):
            a.plane.write_blocks("nobody", [0], [0])


def check_bad_slots_are_refused(make: ClusterFactory) -> None:
    with make() as cluster:
        a = cluster.node("A", num_blocks=8)
        b = cluster.node("B", num_blocks=4)
        cluster.connect(a, b)
        with raises(DataPlaneError):
            a.plane.write_blocks(b.name, [0, 1], [0])
        if not cluster.validates_slots:
            return
        with raises(DataPlaneError, match="4"):
            a.plane.write_blocks(b.name, [0], [4])
        with raises(DataPlaneError, match="8"):
            a.plane.write_blocks(b.name, [8], [0])
        with raises(DataPlaneError):
            a.plane.write_blocks(b.name, [0], [-1])


def _cancel_many(make: ClusterFactory, *, wait: bool) -> list[int]:
    """Cancel transfers while the plane works through them; returns the busy ones."""
    with make() as cluster:
        a, b = _pair(cluster, num_blocks=64, block_len=256 * 1024)
        a.fill(range(64))
        ids = [_write(a, b, [2 * i, 2 * i + 1], [2 * i, 2 * i + 1]) for i in range(32)]
        finished = wait_for_events(a, b.name, ids[:1])  # the plane is busy with the rest
        rest = [i for i in ids if i not in finished]
        busy = a.plane.cancel(rest, wait=wait)
        assert set(busy) <= set(rest)
        if not wait:
            assert busy == []
        sentinel = _write(a, b, [0], [0])
        events = wait_for_events(a, b.name, [sentinel, *busy], settle_s=0.05)
        assert set(events) == {sentinel, *busy}, "released or abandoned transfers were reported"
        assert events[sentinel].success
        return busy


def check_cancel_wait_releases_unstarted(make: ClusterFactory) -> None:
    """wait=True: released transfers are never reported; busy ones are, once."""
    _cancel_many(make, wait=True)


def check_cancel_immediate_abandons(make: ClusterFactory) -> None:
    """wait=False: nothing is busy and nothing is ever reported."""
    _cancel_many(make, wait=False)


def check_cancel_after_completion(make: ClusterFactory) -> None:
    """Cancelling a finished or unknown transfer is harmless and not busy."""
    with make() as cluster:
        a, b = _pair(cluster)
        done = _write(a, b, [0], [0])
        wait_for_events(a, b.name, [done])
        assert a.plane.cancel([done, 10_000], wait=True) == []
        assert a.plane.poll(b.name) == []


def check_unregister_purges(make: ClusterFactory) -> None:
    with make() as cluster:
        a, b = _pair(cluster)
        a.fill(range(8))
        ids = [_write(a, b, [i], [i]) for i in range(8)]
        a.plane.unregister_peer(b.name)
        b.plane.unregister_peer(a.name)
        assert a.plane.poll(b.name) == []
        with raises(DataPlaneError):
            a.plane.write_blocks(b.name, [0], [0])
        assert a.plane.cancel(ids, wait=True) == []
        cluster.connect(a, b)  # a new session between the same nodes
        sentinel = _write(a, b, [0], [3])
        events = wait_for_events(a, b.name, [sentinel], settle_s=0.05)
        assert list(events) == [sentinel]
        assert events[sentinel].success


def check_close_releases_everything(make: ClusterFactory) -> None:
    threads = threading.active_count()
    fds = len(os.listdir("/proc/self/fd"))
    cluster = make()
    try:
        a, b = _pair(cluster)
        a.fill([0])
        done = _write(a, b, [0], [0])
        wait_for_events(a, b.name, [done])
        _write(a, b, [1], [1])  # maybe still in flight at close
    finally:
        planes = [node.plane for node in cluster.nodes.values()]
        cluster.close()
    for plane in planes:
        plane.close()  # idempotent
    deadline = time.monotonic() + TIMEOUT_S
    while threading.active_count() > threads and time.monotonic() < deadline:
        time.sleep(0.001)
    assert threading.active_count() == threads, [t.name for t in threading.enumerate()]
    assert len(os.listdir("/proc/self/fd")) == fds
    assert cluster.files() == []


def check_unopened_slots_are_refused(make: ClusterFactory) -> None:
    with make() as cluster:
        if cluster.windows is Windows.UNENFORCED:
            skip("one-sided writes: the consumer cannot refuse them")
        a, b = _pair(cluster)
        a.fill([0, 1])
        b.fill([2, 3])
        before = b.snapshot()
        b.plane.expect_writes(a.name, [0, 1])
        b.plane.expect_writes(a.name, [3])
        b.plane.revoke_writes(a.name, [3])
        for slot in (2, 3):
            transfer_id = a.plane.write_blocks(b.name, [0], [slot])
            event = wait_for_events(a, b.name, [transfer_id])[transfer_id]
            if cluster.windows is Windows.REFUSED:
                assert not event.success
                assert b.snapshot() == before
            else:
                assert any(f"slot {slot}" in v for v in cluster.violations())


CHECKS: list[Callable[[ClusterFactory], None]] = [
    check_bytes_land_exactly,
    check_both_directions,
    check_poll_is_once_and_per_peer,
    check_many_concurrent_transfers,
    check_unknown_peer_is_refused,
    check_bad_slots_are_refused,
    check_cancel_wait_releases_unstarted,
    check_cancel_immediate_abandons,
    check_cancel_after_completion,
    check_unregister_purges,
    check_close_releases_everything,
    check_unopened_slots_are_refused,
]
