"""Forgetting a peer does not make the node's lock wait for slow teardown (issue 10
item 2): the slow part of a removal (unmapping, unloading NIXL state) runs on the
data plane set's reaper thread, and everything under the lock goes on meanwhile.

A fake backend whose teardown blocks on an event makes it deterministic: no timing
thresholds, only events and the order things happened in.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence

import pytest

from kvpeer.errors import DataPlaneError
from kvpeer.protocol import Connect, TransportOffer
from kvpeer.session.ports import TransferEvent
from kvpeer.testing import make_hello
from kvpeer.transport.data.base import PrimaryRegion
from kvpeer.transport.data.planes import DataPlaneSet
from tests.transport.quietbackend import QuietBackend

TIMEOUT_S = 10.0


class SlowTeardown(QuietBackend):
    """A backend that writes nothing and whose removals wait for :attr:`release`."""

    name = "slow"
    registers_slowly = False

    def __init__(self) -> None:
        self.log: list[str] = []
        self.started = threading.Event()  # a teardown is running
        self.release = threading.Event()  # let it finish
        self._lock = threading.Lock()
        self._ids = iter(range(1, 1 << 30))
        self._events: dict[str, list[TransferEvent]] = {}
        self._peers: set[str] = set()

    def _note(self, entry: str) -> None:
        with self._lock:
            self.log.append(entry)

    def add_peer(
        self, peer_id: str, hello: Connect, offer: TransportOffer | None
    ) -> TransportOffer:
        self._note(f"add {peer_id}")
        self._peers.add(peer_id)
        return {}

    def remove_peer(self, peer_id: str) -> None:
        work = self.detach_peer(peer_id)
        if work is not None:
            work()

    def detach_peer(self, peer_id: str) -> Callable[[], None] | None:
        if peer_id not in self._peers:
            return None
        self._peers.discard(peer_id)
        self._note(f"detach {peer_id}")
        self._events.pop(peer_id, None)

        def teardown() -> None:
            self._note(f"teardown {peer_id} starts")
            self.started.set()
            assert self.release.wait(TIMEOUT_S), "the test never released the teardown"
            self._note(f"teardown {peer_id} ends")

        return teardown

    def write_blocks(
        self, peer_id: str, local_slots: Sequence[int], remote_slots: Sequence[int]
    ) -> int:
        transfer_id = next(self._ids)
        self._events.setdefault(peer_id, []).append(TransferEvent(transfer_id, True))
        return transfer_id

    def poll(self, peer_id: str) -> list[TransferEvent]:
        return self._events.pop(peer_id, [])

    def close(self) -> None:
        self._note("close")


def hello(name: str) -> Connect:
    return make_hello(name, num_blocks=8, block_len=64, hash_seed="seed", fingerprint=None,
                      boot_id=b"\0" * 16, transports={"slow": {}})  # fmt: skip


@pytest.fixture
def plane() -> Iterator[tuple[DataPlaneSet, SlowTeardown]]:
    backend = SlowTeardown()
    region = PrimaryRegion(memoryview(bytearray(8 * 64)), 8, 64)
    planes = DataPlaneSet(region, [backend])
    try:
        yield planes, backend
    finally:
        backend.release.set()
        planes.close()


def run(target: Callable[[], object]) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def test_unregister_returns_while_the_teardown_still_runs(
    plane: tuple[DataPlaneSet, SlowTeardown],
) -> None:
    planes, backend = plane
    planes.register_peer("B", hello("B"))
    planes.register_peer("C", hello("C"))

    planes.unregister_peer("B")  # returns although the teardown blocks until released
    assert backend.started.wait(TIMEOUT_S)

    # What the node does under its lock goes on: other peers, the forgotten one refused.
    transfer_id = planes.write_blocks("C", [0], [0])
    assert planes.poll("C") == [TransferEvent(transfer_id, True)]
    assert planes.poll("B") == []
    with pytest.raises(DataPlaneError, match="not registered"):
        planes.write_blocks("B", [0], [0])
    assert planes.describe().offers == {"slow": {}}
    assert backend.log[-1] == "teardown B starts"

    backend.release.set()
    planes.close()
    assert backend.log.index("teardown B ends") < backend.log.index("close")


def test_a_peer_registered_again_waits_for_its_own_teardown(
    plane: tuple[DataPlaneSet, SlowTeardown],
) -> None:
    planes, backend = plane
    planes.register_peer("B", hello("B"))
    planes.unregister_peer("B")
    assert backend.started.wait(TIMEOUT_S)

    again = run(lambda: planes.register_peer("B", hello("B")))
    backend.release.set()
    again.join(TIMEOUT_S)

    assert not again.is_alive()
    removal = backend.log.index("teardown B ends")
    assert backend.log.index("add B", removal) > removal
    assert planes.chosen("B") == "slow"


def test_close_finishes_every_teardown_before_closing_the_backends(
    plane: tuple[DataPlaneSet, SlowTeardown],
) -> None:
    planes, backend = plane
    planes.register_peer("B", hello("B"))
    planes.unregister_peer("B")
    assert backend.started.wait(TIMEOUT_S)

    closing = run(planes.close)
    backend.release.set()
    closing.join(TIMEOUT_S)

    assert not closing.is_alive()
    assert backend.log[-2:] == ["teardown B ends", "close"]
    assert not [t for t in threading.enumerate() if t.name == "kvpeer-reaper"]
