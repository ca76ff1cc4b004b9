"""A node's data plane: its backends in preference order, chosen per peer.

Negotiation (docs/protocol.md section 3): when the peer's ``connect`` lists kvpeer
transports, we write into it with the first backend of our preference list that
the peer offered and that works between the two (``usable_with``, then ``add_peer``:
a plane whose ``add_peer`` fails, e.g. ``shm`` when the same-host proof does, gives
way to the next); the choice and its parameters go back in our ``connect_ack``. A
peer without the kvpeer extension is a vLLM peer: we use NIXL with its
``agent_metadata``. The peer's ack tells us how it will write into us; that backend
then accepts its writes through the peer's :class:`WriteWindow`. Transfer ids are
unique across backends.
``grant``/``revoke`` go to every backend.

Forgetting a peer (``unregister_peer``, or a new ``register_peer`` for it) is quick
for the caller, who holds the node's lock: each backend detaches the peer at once
(no new transfer, no event, no write into our region) and the slow rest (unmapping
its shm file, releasing its NIXL descriptors and agent) runs on the set's
:class:`Reaper` thread, in order. ``register_peer`` waits for what is left of the
same peer's removal before adding it again (a restart right after a close), and
``close`` for all of it.

Registering a peer can be slow too: loading a peer's NIXL agent metadata took 2-500
ms (once 18 s), and ``shm`` asks the peer's descriptor server for its region (up to
:data:`~kvpeer.transport.data.shm.REQUEST_TIMEOUT_S`). So a node whose loop can be
asked for a poll (``notify``) registers off its lock, in three calls:

1. :meth:`DataPlaneSet.prepare_peer` (node lock held), when a peer's ``connect``
   arrives for a session that has not registered it: if a backend that registers
   slowly (``Backend.registers_slowly``) may be chosen, the peer's stale state is
   forgotten and the whole choice (``usable_with``, ``add_peer`` in preference
   order) is queued on the reaper thread, behind that removal; it returns False
   and the caller holds the peer's frames. Otherwise it returns True.
2. When the choice is made (or failed) the reaper thread wakes the node's loop
   (``notify`` only wakes: a poll on the reaper thread could wait for the reaper);
   :meth:`DataPlaneSet.preparing` turns False and the caller routes the held
   frames: the session's ``register_peer`` takes the prepared outcome (the backend
   and its parameters, or the error) at once, under the lock.
3. :meth:`DataPlaneSet.settle_peer` after those frames: an outcome nobody took
   (the session refused the peer before registering it) is forgotten, so no
   backend keeps a registration without a session.

A backend's own locks make ``add_peer`` safe beside the calls made under the node's
lock (each backend's invariants say so).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvpeer.errors import DataPlaneError, HandshakeRejected, LocalFault
from kvpeer.protocol import Connect, TransportChoice
from kvpeer.session.ports import TransferEvent
from kvpeer.transport.base import LocalRegion
from kvpeer.transport.data.base import Backend, PrimaryRegion, WriteWindow

__all__ = ["DataPlaneSet", "Reaper"]

log = logging.getLogger("kvpeer.planes")


class Reaper:
    """Runs the slow part of forgetting peers on its own thread, in submission order,
    started by :meth:`start` or else at the first submission. ``failures`` counts work
    that raised (logged)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._work: deque[tuple[str, Callable[[], None]]] = deque()
        self._pending: Counter[str] = Counter()  # per peer: submitted, not finished
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.failures = 0

    def start(self) -> None:
        """Start the thread now (if it is not running), not on a peer's first contact:
        starting a thread in a busy engine process took 20-165 ms there."""
        with self._cond:
            if not self._stopping:
                self._start_locked()

    def submit(self, peer_id: str, work: Callable[[], None]) -> None:
        with self._cond:
            if self._stopping:
                raise DataPlaneError("data plane is closed")
            self._work.append((peer_id, work))
            self._pending[peer_id] += 1
            self._start_locked()
            self._cond.notify_all()

    def _start_locked(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvpeer-reaper", daemon=True)
            self._thread.start()

    def wait_for(self, peer_id: str) -> None:
        """Return once no work submitted for ``peer_id`` is left."""
        with self._cond:
            self._cond.wait_for(lambda: not self._pending[peer_id])

    def close(self) -> None:
        """Run what is left, then stop the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._work) or self._stopping)
                if not self._work:
                    return
                peer_id, work = self._work.popleft()
            try:
                work()
            except Exception:  # the node's caller is long gone: log it, keep reaping
                self.failures += 1
                log.exception("data plane: forgetting %s failed", peer_id)
            finally:
                with self._cond:
                    self._pending[peer_id] -= 1
                    if self._pending[peer_id] <= 0:
                        del self._pending[peer_id]
                    self._cond.notify_all()


@dataclass(frozen=True, slots=True)
class _Outcome:
    """A registration made for ``hello``: the backend and its choice, or the error."""

    hello: Connect
    backend: Backend | None = None
    choice: TransportChoice | None = None
    error: Exception | None = None


class DataPlaneSet:
    """Implements :class:`~kvpeer.transport.base.NodeDataPlane` over backends."""

    def __init__(
        self,
        region: PrimaryRegion,
        backends: Sequence[Backend],
        notify: Callable[[], None] | None = None,
        *,
        held_rows: int = 0,
    ) -> None:
        """``held_rows``: local slots ``num_blocks ..`` + ``held_rows`` are the node's
        held copies (kvpeer.node.held); only the backends given them read them."""
        if not backends:
            raise DataPlaneError("a node needs at least one data plane")
        names = [b.name for b in backends]
        if len(set(names)) != len(names):
            raise DataPlaneError(f"data planes listed twice: {names}")
        self.region = region
        self._local_slots = region.num_blocks + held_rows
        self._backends = list(backends)
        self._by_name = {b.name: b for b in backends}
        self._writers: dict[str, Backend] = {}  # peer -> backend we write into it with
        self._windows: dict[str, WriteWindow] = {}
        self._ids = itertools.count(1)
        self._global: dict[int, tuple[Backend, int, str]] = {}  # id -> (backend, local, peer)
        self._local: dict[tuple[int, int], int] = {}
        self._reaper = Reaper()
        self._closed = False
        # Off-lock registration (module docstring): who asks for a poll when one is
        # prepared, and prepared outcomes not taken yet (written by the reaper thread).
        self._notify = notify
        self._outcomes: dict[str, _Outcome] = {}
        self._preparing: set[str] = set()  # queued, outcome not stored yet
        self._outcomes_lock = threading.Lock()
        if notify is not None:  # registrations run on the reaper: ready for the first
            self._reaper.start()

    @property
    def backends(self) -> list[str]:
        return [b.name for b in self._backends]

    def chosen(self, peer_id: str) -> str | None:
        """Name of the plane we write into ``peer_id`` with, once registered."""
        backend = self._writers.get(peer_id)
        return backend.name if backend is not None else None

    # -- NodeDataPlane ------------------------------------------------------------------

    def describe(self) -> LocalRegion:
        metadata = b""
        for backend in self._backends:
            metadata = metadata or backend.agent_metadata()
        return LocalRegion(
            num_blocks=self.region.num_blocks,
            block_len=self.region.block_len,
            base_addr=self.region.base_addr,
            agent_metadata=metadata,
            offers={b.name: b.offer() for b in self._backends},
        )

    def register_peer(self, peer_id: str, hello: Connect) -> TransportChoice | None:
        if hello.block_len != self.region.block_len:
            raise HandshakeRejected(
                f"block_len {hello.block_len} differs from ours ({self.region.block_len})"
            )
        prepared = self._prepared(peer_id, hello)
        if prepared is None:  # a preparation may still be running: its end, then again
            self._reaper.wait_for(peer_id)
            prepared = self._prepared(peer_id, hello)
        if prepared is not None:
            return self._take(peer_id, prepared)
        self._forget(peer_id)  # also what was prepared for another hello
        self._reaper.wait_for(peer_id)  # a backend may key its state by peer id
        return self._take(peer_id, self._choose(peer_id, hello))

    def prepare_peer(self, peer_id: str, hello: Connect) -> bool:
        """Node lock held, before ``register_peer`` for ``hello`` (module docstring):
        True when it may run now; False when it was queued off the lock (route the
        peer's frames once :meth:`preparing` is False, then :meth:`settle_peer`)."""
        if self._notify is None or self._closed or hello.block_len != self.region.block_len:
            return True
        with self._outcomes_lock:
            prepared = self._outcomes.get(peer_id)
        if prepared is not None and prepared.hello == hello:
            return True
        if not any(b.registers_slowly for b in self._candidates(hello)):
            return True
        with self._outcomes_lock:
            self._outcomes.pop(peer_id, None)  # for another hello: forgotten next
        self._forget(peer_id)
        notify = self._notify

        def choose() -> None:
            outcome: _Outcome | None = None
            try:
                outcome = self._choose(peer_id, hello)
            finally:  # stored before the poll it asks for looks (no outcome: redone)
                with self._outcomes_lock:
                    if outcome is not None:
                        self._outcomes[peer_id] = outcome
                    self._preparing.discard(peer_id)
                notify()

        with self._outcomes_lock:
            self._preparing.add(peer_id)
        self._reaper.submit(peer_id, choose)
        return False

    def preparing(self, peer_id: str) -> bool:
        """Whether a registration queued by :meth:`prepare_peer` is still running
        (False from the moment its outcome is stored, before it asks for a poll)."""
        with self._outcomes_lock:
            return peer_id in self._preparing

    def settle_peer(self, peer_id: str) -> None:
        """Node lock held, after the frames held for a preparation were routed: a
        prepared registration no session took is forgotten."""
        if not self.preparing(peer_id):
            self._settle(peer_id)

    def peer_acknowledged(self, peer_id: str, choice: TransportChoice | None) -> None:
        name = "nixl" if choice is None else choice.name
        backend = self._by_name.get(name)
        if backend is None:
            raise HandshakeRejected(f"peer writes with {name!r}, which we did not offer")
        window = self._windows.setdefault(peer_id, WriteWindow())
        backend.accept_writer(peer_id, {} if choice is None else choice.params, window)

    def unregister_peer(self, peer_id: str) -> None:
        self._forget(peer_id)
        self._windows.pop(peer_id, None)

    def write_blocks(
        self, peer_id: str, local_slots: Sequence[int], remote_slots: Sequence[int]
    ) -> int:
        backend = self._writers.get(peer_id)
        if backend is None:
            raise DataPlaneError(f"peer {peer_id!r} is not registered")
        for slot in local_slots:
            if not 0 <= slot < self._local_slots:
                raise DataPlaneError(f"local slot {slot} outside our {self._local_slots}")
        local_id = backend.write_blocks(peer_id, local_slots, remote_slots)
        transfer_id = next(self._ids)
        self._global[transfer_id] = (backend, local_id, peer_id)
        self._local[(id(backend), local_id)] = transfer_id
        return transfer_id

    def poll(self, peer_id: str) -> list[TransferEvent]:
        backend = self._writers.get(peer_id)
        if backend is None:
            return []
        events: list[TransferEvent] = []
        for event in backend.poll(peer_id):
            transfer_id = self._local.pop((id(backend), event.transfer_id), None)
            if transfer_id is None:
                continue  # abandoned by an immediate cancel
            del self._global[transfer_id]
            events.append(TransferEvent(transfer_id, event.success, event.reason))
        return events

    def cancel(self, transfer_ids: Sequence[int], *, wait: bool) -> list[int]:
        still: list[int] = []
        by_backend: dict[int, tuple[Backend, list[int]]] = {}
        for transfer_id in transfer_ids:
            entry = self._global.get(transfer_id)
            if entry is not None:
                backend, local_id, _ = entry
                by_backend.setdefault(id(backend), (backend, []))[1].append(local_id)
        for backend, local_ids in by_backend.values():
            busy = set(backend.cancel(local_ids, wait=wait))
            for local_id in local_ids:
                transfer_id = self._local[(id(backend), local_id)]
                if local_id in busy:
                    still.append(transfer_id)
                else:
                    del self._local[(id(backend), local_id)]
                    del self._global[transfer_id]
        return still

    def grant(self, peer_id: str) -> None:
        for backend in self._backends:
            backend.grant(peer_id)

    def revoke(self, peer_id: str) -> None:
        for backend in self._backends:
            backend.revoke(peer_id)

    def expect_writes(self, peer_id: str, slots: Sequence[int]) -> None:
        self._windows.setdefault(peer_id, WriteWindow()).open(slots)

    def revoke_writes(self, peer_id: str, slots: Sequence[int]) -> None:
        window = self._windows.get(peer_id)
        if window is not None:
            window.close(slots)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._reaper.close()
        for backend in self._backends:
            backend.close()
        self._writers.clear()
        self._windows.clear()
        self._global.clear()
        self._local.clear()

    # -- internals -----------------------------------------------------------------------

    def _candidates(self, hello: Connect) -> list[Backend]:
        """The backends that may write into the peer, in our order of preference."""
        extension = hello.kvpeer
        if extension is None:
            nixl = self._by_name.get("nixl")
            return [] if nixl is None else [nixl]
        return [b for b in self._backends if b.name in extension.transports]

    def _choose(self, peer_id: str, hello: Connect) -> _Outcome:
        """Register the peer with the first backend that takes it (any thread: only
        backend calls, each under the backend's own locks)."""
        extension = hello.kvpeer
        if extension is None:
            nixl = self._by_name.get("nixl")
            if nixl is None:
                return _Outcome(hello, error=DataPlaneError(
                    "peer speaks only NIXL (a vLLM peer) but the nixl data plane is not enabled"
                ))  # fmt: skip
            try:
                nixl.add_peer(peer_id, hello, None)
            except (DataPlaneError, HandshakeRejected) as exc:
                return _Outcome(hello, error=exc)
            return _Outcome(hello, backend=nixl)
        offers = extension.transports
        failures: list[DataPlaneError] = []
        for backend in self._backends:
            offer = offers.get(backend.name)
            if offer is None or not backend.usable_with(offer, hello):
                continue
            try:
                params = backend.add_peer(peer_id, hello, offer)
            except DataPlaneError as exc:
                log.info("data plane %s unusable with %s: %s", backend.name, peer_id, exc)
                failures.append(exc)
                continue
            return _Outcome(hello, backend, TransportChoice(name=backend.name, params=params))
        reasons = "".join(f"; {exc}" for exc in failures)
        message = f"no common data plane: ours {self.backends}, the peer offers {sorted(offers)}"
        if failures and all(isinstance(exc, LocalFault) for exc in failures):
            return _Outcome(hello, error=LocalFault(message + reasons))
        return _Outcome(hello, error=DataPlaneError(message + reasons))

    def _prepared(self, peer_id: str, hello: Connect) -> _Outcome | None:
        """The outcome prepared for ``hello``, taken (one for another hello is dropped)."""
        with self._outcomes_lock:
            prepared = self._outcomes.pop(peer_id, None)
        return prepared if prepared is not None and prepared.hello == hello else None

    def _take(self, peer_id: str, outcome: _Outcome) -> TransportChoice | None:
        """Node lock held: make a registration the peer's (or raise its error)."""
        if outcome.error is not None:
            raise outcome.error
        assert outcome.backend is not None
        self._writers[peer_id] = outcome.backend
        return outcome.choice

    def _settle(self, peer_id: str) -> None:
        with self._outcomes_lock:
            left = self._outcomes.pop(peer_id, None)
        if left is not None and left.backend is not None:
            self._forget(peer_id)

    def _forget(self, peer_id: str) -> None:
        for backend in self._backends:
            work = backend.detach_peer(peer_id)
            if work is not None and not self._closed:  # closed: released with the backend
                self._reaper.submit(peer_id, work)
        self._writers.pop(peer_id, None)
        for transfer_id in [t for t, e in self._global.items() if e[2] == peer_id]:
            backend, local_id, _ = self._global.pop(transfer_id)
            self._local.pop((id(backend), local_id), None)
