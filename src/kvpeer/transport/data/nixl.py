"""The ``nixl`` data plane: one-sided NIXL WRITEs into a peer's registered region.

This is the plane a vLLM 0.32 p2p peer speaks (docs/protocol.md sections 3 and 4): our
``connect`` carries the agent's metadata (``agent_metadata()``) and our region's
``base_addr``/``num_blocks``/``block_len``; a peer loads the metadata and writes row
``i`` of its region into our row ``j`` at ``base_addr + j * block_len``. We do the same
with a peer's ``connect``. The consumer takes no part in a write (``accept_writer`` is a
no-op), so the producer learns completion from NIXL and tells the consumer with
``transfer_done``.

Setup: one agent per backend, named by a fresh uuid4 (never the peer id: two nodes on
one host must not collide); the whole region registered once as DRAM (device 0); one
prepared descriptor list over our rows, and one per peer over its rows. Both lists are
*strided* (one ``(addr, len, dev, stride, count)`` row that NIXL indexes per block), so
registering a peer costs the same for 100 blocks or 10 million. NIXL itself is reached
only through :class:`~kvpeer.transport.data.nixlagent.Nixl`, its typed face.

Invariants:

1. Every call into NIXL happens with ``_agent_lock`` held (the agent is also created
   with ``NIXL_THREAD_SYNC_STRICT``); ``_lock`` guards our own tables and is taken after
   ``_agent_lock`` when both are needed. ``write_blocks``, ``poll`` and ``cancel`` never
   take ``_agent_lock``, so they never wait for NIXL.
2. Transfers are posted in order by the backend's one thread (``kvpeer-nixl``): with
   UCX between processes of one host (CMA) NIXL copies the bytes inside the post call
   itself (about 80 ms for 256 MiB here), which must not stall the caller.
3. The same thread watches posted transfers (``check_xfer_state`` every 0.5 ms while any
   is running) and calls ``notify`` when one finished; ``poll`` only collects. DONE is
   success; PROC/PEND is still running; any other state, or an exception, is failure.
4. A transfer's handle is released only once NIXL says it is no longer in progress (or
   at ``close``, after waiting for that): NIXL 1.5.1 "releases" a running transfer
   without stopping it, and its bytes keep landing. So a transfer that is posting or
   running is *busy* for ``cancel(wait=True)``, and an abandoned one (``cancel`` with
   ``wait=False``, or one of a removed peer) is kept, unreported, until NIXL is done.
5. Each transfer is reported at most once, through ``poll`` of its peer. Cancelled ones,
   abandoned ones and those of a removed peer are never reported.
6. ``add_peer`` of a registered peer tears the old registration down first (re-adding
   over a live one left stale UCX endpoints upstream, vLLM #60205). ``remove_peer`` and
   ``close`` attempt every teardown step even when one fails. A remote agent registered
   under several peer ids is removed when the last of them goes.
7. A peer that loaded our metadata can write anywhere in our registered region: NIXL
   writes are one-sided, so the :class:`~kvpeer.transport.data.base.WriteWindow` cannot
   be enforced here (contract item 5 applies only to planes the consumer takes part in).
8. NIXL's progress thread waits for UCX events up to ``_PROGRESS_WAIT_US`` instead of
   busy-polling (see :mod:`~kvpeer.transport.data.nixlagent`): an idle node costs ~0 %
   of a core, not ~100 %.
9. A peer's agent metadata is loaded only if ``trusted(peer_id)``: NIXL parses it in
   native code (a forged one crashed the process with SIGSEGV) and it decides where our
   writes go (a forged one aimed them at our own region). The node trusts the peers
   of ``nixl_peers``, or of an explicit ``allowed_peers`` (``TierConfig.nixl_trusted``).
"""

from __future__ import annotations

import enum
import importlib
import itertools
import logging
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvpeer.errors import DataPlaneError
from kvpeer.protocol import Connect, TransportOffer
from kvpeer.session.ports import TransferEvent
from kvpeer.transport.data.base import PrimaryRegion, WriteWindow
from kvpeer.transport.data.nixlagent import Handle, Nixl

__all__ = ["INSTALL_HINT", "NixlBackend", "NixlStatistics"]

log = logging.getLogger("kvpeer.nixl")

INSTALL_HINT = "nixl is not installed: pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1"

_WATCH_S = 0.0005  # how often running transfers are checked
_JOIN_TIMEOUT_S = 10.0
_DRAIN_TIMEOUT_S = 10.0  # close() waits this long for running transfers
_MAX_INDEX = 2**31  # NIXL takes descriptor indexes as int32
_ADDRESS_LIMIT = 2**64
_IN_PROGRESS = ("PROC", "PEND")
# A peer's registration runs on the driver under the tier's lock, so engine calls wait
# for it; longer than this is logged (18 s seen once, as every engine on the machine stalled).
SLOW_REGISTRATION_S = 1.0


class _State(enum.Enum):
    QUEUED = "queued"
    POSTING = "posting"  # inside NIXL's post call: bytes are moving
    RUNNING = "running"  # posted, NIXL says in progress: bytes may still move
    FINISHED = "finished"  # handle released; waits for poll


@dataclass(slots=True)
class _Transfer:
    peer_id: str
    local: tuple[int, ...]
    remote: tuple[int, ...]
    state: _State = _State.QUEUED
    handle: Handle = None
    success: bool = False
    reason: str = ""
    abandoned: bool = False  # nobody waits for it: released when NIXL is done, unreported


@dataclass(slots=True)
class _Peer:
    agent: str | bytes  # NIXL's name of the peer's agent
    dlist: Handle
    num_blocks: int


@dataclass(frozen=True, slots=True)
class NixlStatistics:
    agent_name: str
    peers: int
    queued: int
    running: int  # posting or posted, not finished, still wanted
    abandoned: int  # posting or posted, not finished, nobody waits for them
    succeeded: int
    failed: int
    blocks_written: int
    bytes_written: int


class NixlBackend:
    """Implements :class:`~kvpeer.transport.data.base.Backend` over NIXL (UCX)."""

    registers_slowly = True  # loading a peer's agent metadata: 2-500 ms, once 18 s

    def __init__(
        self,
        region: PrimaryRegion,
        notify: Callable[[], None] | None = None,
        *,
        backends: Sequence[str] = ("UCX",),
        num_threads: int = 4,
        trusted: Callable[[str], bool] | None = None,
    ) -> None:
        """``backends``: NIXL backends the agent creates; ``num_threads``: worker threads
        of backends that take one (UCX); ``trusted(peer_id)``: whether that peer's agent
        metadata may be loaded (invariant 9; None: every peer's)."""
        if not self.available():
            raise DataPlaneError(INSTALL_HINT)
        self._region = region
        self._notify = notify
        self._trusted = trusted
        self._agent_name = str(uuid.uuid4())
        self._agent_lock = threading.Lock()
        self._lock = threading.Condition()
        self._ids = itertools.count(1)
        self._transfers: dict[int, _Transfer] = {}
        self._queue: deque[int] = deque()
        self._running: set[int] = set()  # POSTING or RUNNING, abandoned or not
        self._peers: dict[str, _Peer] = {}
        self._agent_users: Counter[str | bytes] = Counter()
        self._succeeded = self._failed = self._blocks = 0
        self._thread: threading.Thread | None = None
        self._closed = False
        base, size = region.base_addr, region.num_blocks * region.block_len
        try:
            self._nixl = Nixl(self._agent_name, backends, num_threads)
            self._registration: Handle = self._nixl.register(base, size)
            self._local: Handle = self._nixl.prep_rows(
                None, base, region.num_blocks, region.block_len
            )
            self._metadata = self._nixl.metadata()
        except Exception as exc:  # nixl raises its own exception types, all Exceptions
            raise DataPlaneError(f"nixl: cannot set up agent {self._agent_name}: {exc}") from exc

    @classmethod
    def available(cls) -> bool:
        """Whether NIXL (and numpy, which it needs) can be imported."""
        try:
            importlib.import_module("nixl._api")
        except (ImportError, OSError):
            return False
        return True

    @property
    def name(self) -> str:
        return "nixl"

    @property
    def agent_name(self) -> str:
        return self._agent_name

    # -- negotiation ---------------------------------------------------------------------

    def offer(self) -> TransportOffer:
        return {}  # everything a peer needs is in the base connect fields

    def agent_metadata(self) -> bytes:
        """What goes in ``connect.agent_metadata`` (NIXL's full local metadata)."""
        return self._metadata

    def usable_with(self, offer: TransportOffer | None, hello: Connect) -> bool:
        return bool(hello.agent_metadata)

    def add_peer(
        self, peer_id: str, hello: Connect, offer: TransportOffer | None
    ) -> TransportOffer:
        if not hello.agent_metadata:
            raise DataPlaneError(f"nixl: {peer_id!r} sent no agent metadata")
        if self._trusted is not None and not self._trusted(peer_id):
            raise DataPlaneError(
                f"nixl: {peer_id!r} is not a trusted nixl peer (nixl_peers, or an explicit "
                "allowed_peers): its NIXL agent metadata is not loaded"
            )
        if hello.block_len != self._region.block_len:
            raise DataPlaneError(
                f"nixl: {peer_id!r} has block_len {hello.block_len}, ours is "
                f"{self._region.block_len}"
            )
        extent = f"{hello.num_blocks} x {hello.block_len} bytes at {hello.base_addr:#x}"
        if hello.base_addr + hello.num_blocks * hello.block_len > _ADDRESS_LIMIT:
            raise DataPlaneError(f"nixl: {peer_id!r} region ({extent}) is not addressable")
        started = time.monotonic()
        with self._agent_lock:
            if self._closed:
                raise DataPlaneError("nixl: backend is closed")
            self._remove(peer_id)
            try:
                agent = self._nixl.load(hello.agent_metadata)
            except Exception as exc:
                raise DataPlaneError(
                    f"nixl: cannot load the agent metadata of {peer_id!r}: {exc}"
                ) from exc
            try:
                dlist = self._nixl.prep_rows(
                    agent, hello.base_addr, hello.num_blocks, hello.block_len
                )
            except Exception as exc:
                if not self._agent_users[agent]:
                    self._attempt(self._nixl.unload, agent, f"remove the agent of {peer_id!r}")
                raise DataPlaneError(
                    f"nixl: {peer_id!r} region ({extent}) is not memory its agent registered: {exc}"
                ) from exc
            with self._lock:
                self._peers[peer_id] = _Peer(agent, dlist, hello.num_blocks)
                self._agent_users[agent] += 1
        took = time.monotonic() - started
        if took > SLOW_REGISTRATION_S:
            log.warning("nixl: registering %s (%s) took %.1f s", peer_id, extent, took)
        return {}

    def accept_writer(self, peer_id: str, params: TransportOffer, window: WriteWindow) -> None:
        """Nothing to do: the peer writes one-sided into our registered region."""

    def remove_peer(self, peer_id: str) -> None:
        """Forget ``peer_id`` and abandon its transfers; waits for a post in progress
        unless we know nothing of ``peer_id``."""
        with self._lock:
            if peer_id not in self._peers and all(
                t.peer_id != peer_id or t.abandoned for t in self._transfers.values()
            ):
                return
        release = self.detach_peer(peer_id)
        if release is not None:
            release()

    def detach_peer(self, peer_id: str) -> Callable[[], None] | None:
        """Forget ``peer_id`` now; the returned work releases its descriptors and, for
        the agent's last peer, unloads the agent (NIXL calls that took up to seconds)."""
        with self._lock:
            forgotten = self._forget_peer(peer_id)
        if forgotten is None:
            return None
        peer, last_user = forgotten

        def release() -> None:
            with self._agent_lock:
                if not self._closed:
                    self._release_peer(peer_id, peer, last_user)

        return release

    # -- transfers -----------------------------------------------------------------------

    def write_blocks(
        self, peer_id: str, local_slots: Sequence[int], remote_slots: Sequence[int]
    ) -> int:
        if len(local_slots) != len(remote_slots):
            raise DataPlaneError(
                f"nixl: {len(local_slots)} local slots but {len(remote_slots)} remote slots"
            )
        local = tuple(local_slots)
        remote = tuple(remote_slots)
        _check_slots(local, min(self._region.num_blocks, _MAX_INDEX), "local")
        with self._lock:
            if self._closed:
                raise DataPlaneError("nixl: backend is closed")
            peer = self._peers.get(peer_id)
            if peer is None:
                raise DataPlaneError(f"nixl: peer {peer_id!r} is not registered")
            _check_slots(remote, min(peer.num_blocks, _MAX_INDEX), f"remote ({peer_id!r})")
            transfer_id = next(self._ids)
            transfer = _Transfer(peer_id, local, remote)
            self._transfers[transfer_id] = transfer
            if not local:  # NIXL refuses empty requests; nothing to move
                self._finish(transfer, True, "")
            else:
                self._queue.append(transfer_id)
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run, name="kvpeer-nixl", daemon=True
                    )
                    self._thread.start()
                self._lock.notify_all()
        if not local and self._notify is not None:
            self._notify()
        return transfer_id

    def poll(self, peer_id: str) -> list[TransferEvent]:
        with self._lock:
            finished = [
                (transfer_id, transfer)
                for transfer_id, transfer in self._transfers.items()
                if transfer.peer_id == peer_id and transfer.state is _State.FINISHED
            ]
            for transfer_id, _ in finished:
                del self._transfers[transfer_id]
        return [TransferEvent(tid, t.success, t.reason) for tid, t in finished]

    def cancel(self, transfer_ids: Sequence[int], *, wait: bool) -> list[int]:
        busy: list[int] = []
        with self._lock:
            for transfer_id in transfer_ids:
                transfer = self._transfers.get(transfer_id)
                if transfer is None or transfer.abandoned:
                    continue
                if transfer.state is _State.QUEUED:
                    self._queue.remove(transfer_id)
                    del self._transfers[transfer_id]
                elif transfer.state is _State.FINISHED:
                    del self._transfers[transfer_id]
                elif wait:  # posting or running: its bytes may still move
                    busy.append(transfer_id)
                else:
                    transfer.abandoned = True
        return busy

    def statistics(self) -> NixlStatistics:
        with self._lock:
            active = [self._transfers[tid] for tid in self._running]
            abandoned = sum(t.abandoned for t in active)
            return NixlStatistics(
                agent_name=self._agent_name,
                peers=len(self._peers),
                queued=len(self._queue),
                running=len(active) - abandoned,
                abandoned=abandoned,
                succeeded=self._succeeded,
                failed=self._failed,
                blocks_written=self._blocks,
                bytes_written=self._blocks * self._region.block_len,
            )

    def close(self) -> None:
        """Stop posting, wait (bounded) for running transfers, release everything,
        deregister our region and drop the agent. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.clear()
            self._lock.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(_JOIN_TIMEOUT_S)
            if thread.is_alive():
                log.warning("nixl: agent %s: posting thread did not stop", self._agent_name)
        with self._agent_lock:
            self._drain(time.monotonic() + _DRAIN_TIMEOUT_S)
            self._teardown()
            # Every NIXL object keeps the agent alive: with the last one gone, it goes.
            self._local = self._registration = None
            self._nixl.shutdown()

    # -- internals (the posting thread) --------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                while not (self._closed or self._queue or self._running):
                    self._lock.wait()
                if self._closed:
                    return
                if not self._queue:  # only watching: a new transfer wakes us early
                    self._lock.wait(_WATCH_S)
                    if self._closed:
                        return
            with self._agent_lock:
                finished = self._post_next()
                finished = self._watch() or finished
            if finished and self._notify is not None:
                self._notify()

    def _post_next(self) -> bool:
        """Post the oldest queued transfer; True if it finished and is reportable."""
        with self._lock:
            if not self._queue:
                return False
            transfer_id = self._queue.popleft()
            transfer = self._transfers[transfer_id]
            peer = self._peers[transfer.peer_id]  # _remove drops queued transfers
            transfer.state = _State.POSTING
            self._running.add(transfer_id)
        try:
            transfer.handle = self._nixl.make_write(
                self._local, transfer.local, peer.dlist, transfer.remote
            )
            status = self._nixl.post(transfer.handle)
            reason = "" if status == "DONE" else f"nixl: post returned {status}"
        except Exception as exc:
            status, reason = "ERR", _describe(exc)
        if status in _IN_PROGRESS:
            with self._lock:
                transfer.state = _State.RUNNING
            return False
        return self._settle(transfer_id, transfer, status == "DONE", reason)

    def _watch(self) -> bool:
        """Check running transfers; True if one finished and is reportable."""
        with self._lock:
            running = [
                (tid, self._transfers[tid])
                for tid in self._running
                if self._transfers[tid].state is _State.RUNNING
            ]
        reportable = False
        for transfer_id, transfer in running:
            try:
                status = self._nixl.state(transfer.handle)
                reason = "" if status == "DONE" else f"nixl: transfer state {status}"
            except Exception as exc:
                status, reason = "ERR", _describe(exc)
            if status not in _IN_PROGRESS:
                reportable |= self._settle(transfer_id, transfer, status == "DONE", reason)
        return reportable

    def _settle(self, transfer_id: int, transfer: _Transfer, success: bool, reason: str) -> bool:
        """NIXL is done with ``transfer``: release it, then report it unless abandoned."""
        if transfer.handle is not None:
            self._attempt(self._nixl.release, transfer.handle, "release a finished transfer")
        with self._lock:
            transfer.handle = None
            self._running.discard(transfer_id)
            if transfer.abandoned:
                self._transfers.pop(transfer_id, None)
                return False
            self._finish(transfer, success, reason)
            return True

    def _finish(self, transfer: _Transfer, success: bool, reason: str) -> None:
        """Mark ``transfer`` reportable (``_lock`` held)."""
        transfer.state = _State.FINISHED
        transfer.success = success
        transfer.reason = reason
        if success:
            self._succeeded += 1
            self._blocks += len(transfer.local)
        else:
            self._failed += 1

    # -- internals (teardown, ``_agent_lock`` held) --------------------------------------

    def _remove(self, peer_id: str) -> None:
        """Tear down ``peer_id``'s registration; abandon its transfers (agent lock held)."""
        with self._lock:
            forgotten = self._forget_peer(peer_id)
        if forgotten is not None:
            self._release_peer(peer_id, *forgotten)

    def _forget_peer(self, peer_id: str) -> tuple[_Peer, bool] | None:
        """Drop ``peer_id`` and its transfers (lock held): its peer record and whether
        it was its agent's last user, for :meth:`_release_peer`."""
        peer = self._peers.pop(peer_id, None)
        for transfer_id, transfer in list(self._transfers.items()):
            if transfer.peer_id != peer_id:
                continue
            if transfer_id in self._running:
                transfer.abandoned = True  # released by the thread when NIXL is done
                continue
            if transfer.state is _State.QUEUED:
                self._queue.remove(transfer_id)
            del self._transfers[transfer_id]
        if peer is None:
            return None
        self._agent_users[peer.agent] -= 1
        last_user = self._agent_users[peer.agent] <= 0
        if last_user:
            del self._agent_users[peer.agent]
        return peer, last_user

    def _release_peer(self, peer_id: str, peer: _Peer, last_user: bool) -> None:
        """NIXL's part of forgetting a peer (agent lock held, not the lock)."""
        self._attempt(self._nixl.release, peer.dlist, f"release descriptors of {peer_id!r}")
        if last_user:
            self._attempt(self._nixl.unload, peer.agent, f"remove the agent of {peer_id!r}")

    def _drain(self, deadline: float) -> None:
        """Wait until NIXL is done with every posted transfer, or ``deadline``."""
        while self._running:
            self._watch()
            if not self._running:
                return
            if time.monotonic() > deadline:
                log.warning(
                    "nixl: agent %s: %d transfers still running at close",
                    self._agent_name,
                    len(self._running),
                )
                return
            time.sleep(_WATCH_S)

    def _teardown(self) -> None:
        """Release every transfer, peer and our own registration."""
        with self._lock:
            handles = [t.handle for t in self._transfers.values() if t.handle is not None]
            peers = list(self._peers.values())
            self._transfers.clear()
            self._queue.clear()
            self._running.clear()
            self._peers.clear()
            self._agent_users.clear()
        for handle in handles:
            self._attempt(self._nixl.release, handle, "release a transfer")
        for peer in peers:
            self._attempt(self._nixl.release, peer.dlist, "release a peer's descriptors")
        for agent in {peer.agent for peer in peers}:
            self._attempt(self._nixl.unload, agent, "remove a remote agent")
        self._attempt(self._nixl.release, self._local, "release our descriptors")
        self._attempt(self._nixl.deregister, self._registration, "deregister our region")

    def _attempt(self, step: Callable[[Any], None], target: object, what: str) -> None:
        """Run one NIXL step; a failure is logged and the caller goes on."""
        try:
            step(target)
        except Exception as exc:
            log.warning("nixl: agent %s: cannot %s: %s", self._agent_name, what, _describe(exc))

    # -- grants (the agent metadata in our connect is all a peer gets) ----------------

    def grant(self, peer_id: str) -> None:
        """Nothing to do."""

    def revoke(self, peer_id: str) -> None:
        """Nothing to do."""


def _check_slots(slots: Sequence[int], limit: int, whose: str) -> None:
    for slot in slots:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < limit:
            raise DataPlaneError(f"nixl: {whose} slot {slot!r} outside [0, {limit})")


def _describe(exc: BaseException) -> str:
    return f"nixl: {type(exc).__name__}: {exc}"
