"""Registering a peer off the node's lock (issue 10 item 2): a backend whose
``add_peer`` may wait on the outside world (NIXL metadata, an shm region request) is
called on the plane set's reaper thread, and the session takes the outcome under the
lock at once (:mod:`kvpeer.transport.data.planes`, peer table invariant 9).

A fake backend whose ``add_peer`` blocks on an event makes the plane-set tests
deterministic; the node test gates the real shm plane the same way.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence

import pytest

from kvpeer.errors import DataPlaneError
from kvpeer.lab.pull import PullResult
from kvpeer.protocol import Connect, TransportOffer
from kvpeer.session.ports import TransferEvent
from kvpeer.testing import make_hello
from kvpeer.transport.data.base import PrimaryRegion
from kvpeer.transport.data.planes import DataPlaneSet
from kvpeer.transport.data.shm import ShmBackend
from tests.net.common import DEADLINE_S, keys_of
from tests.net.localnode import LocalNode
from tests.net.servingnode import ServingNode
from tests.transport.quietbackend import QuietBackend

TIMEOUT_S = 10.0


class GatedRegistration(QuietBackend):
    """A backend whose ``add_peer`` waits for :attr:`gate` (or raises :attr:`fail`)."""

    name = "gated"
    registers_slowly = True

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.fail: str | None = None
        self.added: list[tuple[str, str]] = []  # (peer, thread name)
        self.detached: list[str] = []
        self.peers: set[str] = set()

    def add_peer(
        self, peer_id: str, hello: Connect, offer: TransportOffer | None
    ) -> TransportOffer:
        self.added.append((peer_id, threading.current_thread().name))
        self.entered.set()
        assert self.gate.wait(TIMEOUT_S), "the test never opened the gate"
        if self.fail is not None:
            raise DataPlaneError(self.fail)
        self.peers.add(peer_id)
        return {"n": len(self.added)}

    def remove_peer(self, peer_id: str) -> None:
        self.detach_peer(peer_id)

    def detach_peer(self, peer_id: str) -> Callable[[], None] | None:
        if peer_id in self.peers:
            self.peers.discard(peer_id)
            self.detached.append(peer_id)
        return None

    def write_blocks(
        self, peer_id: str, local_slots: Sequence[int], remote_slots: Sequence[int]
    ) -> int:
        return 1

    def poll(self, peer_id: str) -> list[TransferEvent]:
        return []

    def close(self) -> None:
        pass


def hello(name: str, num_blocks: int = 8) -> Connect:
    return make_hello(name, num_blocks=num_blocks, block_len=64, hash_seed="seed",
                      fingerprint=None, boot_id=b"\0" * 16, transports={"gated": {}})  # fmt: skip


class Planes:
    def __init__(self, *, notify: bool = True, slow: bool = True) -> None:
        self.backend = GatedRegistration()
        self.backend.registers_slowly = slow
        self.notified = threading.Event()
        self.preparing_when_notified: list[bool] = []
        region = PrimaryRegion(memoryview(bytearray(8 * 64)), 8, 64)
        self.set = DataPlaneSet(region, [self.backend], notify=self.notify if notify else None)

    def notify(self) -> None:
        """The loop's ``request_poll``: the poll it runs must find the peer ready."""
        self.preparing_when_notified.append(self.set.preparing("p"))
        self.notified.set()

    def ready(self, peer_id: str) -> None:
        """Open the gate and wait for the poll the preparation asks for."""
        self.backend.gate.set()
        assert self.notified.wait(TIMEOUT_S)
        # A poll that still saw the preparation running would hold the frames until
        # some other wake-up (a vLLM peer's handshake then timed out).
        assert self.preparing_when_notified == [False]
        assert not self.set.preparing(peer_id)


@pytest.fixture
def planes() -> Iterator[Planes]:
    made = Planes()
    try:
        yield made
    finally:
        made.backend.gate.set()
        made.set.close()


def reapers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kvpeer-reaper"]


def test_a_set_that_registers_off_the_lock_starts_its_reaper_before_any_peer() -> None:
    """A peer's first contact must not pay for starting a thread: in a busy engine
    process that took 20-165 ms, most of a restarted producer's fallback."""
    before = set(reapers())
    eager = Planes()
    try:
        started = set(reapers()) - before
        assert len(started) == 1
        assert all(t.is_alive() for t in started)
    finally:
        eager.set.close()
    assert not any(t.is_alive() for t in started)
    lazy = Planes(notify=False)  # the undriven node registers under the lock
    try:
        assert set(reapers()) - before == set()
    finally:
        lazy.set.close()


def test_a_slow_registration_runs_off_the_callers_thread_and_is_taken_once(
    planes: Planes,
) -> None:
    assert not planes.set.prepare_peer("p", hello("p"))  # queued: hold the frames
    assert planes.backend.entered.wait(TIMEOUT_S)
    assert planes.set.preparing("p")  # the caller returned while add_peer waits
    planes.ready("p")
    assert planes.set.prepare_peer("p", hello("p"))  # routed again: ready now
    choice = planes.set.register_peer("p", hello("p"))
    assert choice is not None
    assert (choice.name, choice.params) == ("gated", {"n": 1})
    assert planes.backend.added == [("p", "kvpeer-reaper")]  # once, on the reaper
    assert planes.set.chosen("p") == "gated"
    planes.set.settle_peer("p")  # taken: nothing to forget
    assert planes.backend.detached == []


def test_a_prepared_failure_is_raised_by_register_peer_without_trying_again(
    planes: Planes,
) -> None:
    planes.backend.fail = "the metadata does not load"
    assert not planes.set.prepare_peer("p", hello("p"))
    planes.ready("p")
    with pytest.raises(DataPlaneError, match="the metadata does not load"):
        planes.set.register_peer("p", hello("p"))
    assert len(planes.backend.added) == 1
    assert planes.set.chosen("p") is None


def test_a_registration_no_session_took_is_forgotten_by_settle(planes: Planes) -> None:
    """The session refused the peer before registering it (e.g. a fingerprint)."""
    assert not planes.set.prepare_peer("p", hello("p"))
    planes.ready("p")
    assert planes.backend.peers == {"p"}
    planes.set.settle_peer("p")
    assert planes.backend.peers == set()
    assert planes.backend.detached == ["p"]


def test_a_registration_prepared_for_another_hello_is_redone(planes: Planes) -> None:
    assert not planes.set.prepare_peer("p", hello("p", num_blocks=8))
    planes.ready("p")
    choice = planes.set.register_peer("p", hello("p", num_blocks=4))
    assert choice is not None
    assert choice.params == {"n": 2}
    assert planes.backend.detached == ["p"]  # the first one went first
    assert [thread for _, thread in planes.backend.added][1] == threading.current_thread().name


def test_an_adopted_next_session_replaces_the_registration_off_the_lock(
    planes: Planes,
) -> None:
    """A session adopting the peer's next connect registers it again (session
    invariant 3): prepared off the lock like a first one, the old registration goes
    first, and ``register_peer`` takes the new outcome in its place."""
    first, later = hello("p", num_blocks=8), hello("p", num_blocks=4)
    planes.backend.gate.set()
    assert planes.set.prepare_peer("p", first) is False
    assert planes.notified.wait(TIMEOUT_S)
    assert planes.set.register_peer("p", first) is not None
    planes.notified.clear()
    assert planes.set.prepare_peer("p", later) is False
    assert planes.notified.wait(TIMEOUT_S)
    choice = planes.set.register_peer("p", later)
    assert choice is not None
    assert choice.params == {"n": 2}
    assert planes.backend.detached == ["p"]  # the first registration, before the second
    assert [thread for _, thread in planes.backend.added] == ["kvpeer-reaper"] * 2
    assert planes.set.chosen("p") == "gated"


@pytest.mark.parametrize("why", ["no loop to notify", "a quick backend"])
def test_registration_stays_on_the_callers_thread_when_nothing_is_gained(why: str) -> None:
    made = Planes(notify=why != "no loop to notify", slow=why != "a quick backend")
    made.backend.gate.set()
    try:
        assert made.set.prepare_peer("p", hello("p"))
        assert made.set.register_peer("p", hello("p")) is not None
        assert made.backend.added == [("p", threading.current_thread().name)]
    finally:
        made.set.close()


def test_a_peer_registering_slowly_does_not_hold_the_nodes_lock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two real nodes over the shm plane: while every ``add_peer`` waits at a gate,
    both nodes' locks are free (engine calls go on); opened, the pull completes.
    Before, the registration ran in the driver under the lock, and taking the lock
    here waited until the gate opened (this test timed out)."""
    gate, entered = threading.Event(), threading.Event()
    threads: list[str] = []
    real_add_peer = ShmBackend.add_peer

    def gated(
        self: ShmBackend, peer_id: str, hello: Connect, offer: TransportOffer | None
    ) -> TransportOffer:
        threads.append(threading.current_thread().name)
        entered.set()
        assert gate.wait(TIMEOUT_S)
        return real_add_peer(self, peer_id, hello, offer)

    monkeypatch.setattr(ShmBackend, "add_peer", gated)
    producer = ServingNode("shm")
    try:
        with LocalNode("shm") as consumer:
            results: list[PullResult] = []
            pulling = threading.Thread(
                target=lambda: results.append(
                    consumer.pull(producer.peer_id, keys_of(range(8)), range(8))
                ),
                daemon=True,
            )
            pulling.start()
            assert entered.wait(TIMEOUT_S)
            for node in (producer.node, consumer.node):
                lock = node.locked()
                assert lock.acquire(timeout=DEADLINE_S), "a registration holds the lock"
                lock.release()
            gate.set()
            pulling.join(DEADLINE_S)
            assert not pulling.is_alive()
            (result,) = results
            assert (result.hits, result.loaded) == (8, True)
            consumer.assert_blocks(range(8), range(8))
        assert threads
        assert set(threads) == {"kvpeer-reaper"}
    finally:
        gate.set()
        producer.close()
