"""The driver thread and the thread-safe tier the engine talks to (DESIGN.md 4.3).

Invariants:

1. One lock guards the tier and its sockets. The driver thread holds it only
   while it polls (receive, decode, dispatch, timers, completions, sends); the
   engine holds it for each call, and frames an engine call queues leave on the
   engine thread at once (the control transport sends them under the lock).
   Waiting for frames touches no socket.
2. The driver polls whenever a frame arrives, something wakes it (a queued
   frame, a finished transfer), or the tier's next deadline comes, and at
   least every ``max_wait_s``. Everything that does not need the parent is
   therefore applied without waiting for an engine step; when peer work starts
   waiting for a serve window, ``wake_host`` tells an idle engine to step.
   One thread watches for frames: while an engine thread is blocked in
   :meth:`DrivenTier.wait_for_work`, *it* polls when a frame, a wake-up or a
   completion arrives, so a result reaches it without a hop through the driver
   thread, and the driver only keeps the tier's timers (two threads woken by
   one frame would only fight for the lock and the cores). The driver sleeps
   on its own eventfd then; it is kicked when a timer moves earlier and when
   the last engine thread leaves ``wait_for_work``, and then watches frames
   again (a frame that arrived meanwhile keeps its descriptor readable).
   A data plane's thread that finishes a transfer polls itself, waiting
   briefly for the lock.
3. Every engine call enters the tier one way (``DrivenTier._call``): under the
   lock, after a crash check. A crash in the driver fails every job the tier
   held (they come back from ``get_finished_jobs``) and raises
   :class:`DriverCrashed` on the engine's next call, once; afterwards the tier
   answers MISS and fails new jobs without being called (it may be what broke).
4. ``shutdown`` stops the thread (joined) before the tier closes its sockets;
   nothing survives it.

Fields read without the lock, and why a stale read is harmless (everything else
is read and written under the lock, or by one thread only):

=================  ==============================  ===================================
field              written                         read outside the lock by
=================  ==============================  ===================================
``_crash``         under the lock, once            the driver's loop and ``crashed``:
                                                   a stale None costs one more loop,
                                                   whose locked poll sees the crash
``_watchers``      under the lock                  the driver, to pick what it sleeps
                                                   on: stale 0 means two threads watch
                                                   frames for one round (they queue on
                                                   the lock); stale >0 is ended by the
                                                   kick the last watcher sends
``_deadline``      under the lock (each poll and   the driver, to size its sleep: an
                   ``submit_load``)                earlier timer set meanwhile kicks it
                                                   when it is before ``_sleeps_until``,
                                                   else fires at most ``max_wait_s`` late
``_sleeps_until``  the driver only, without lock   engine threads under the lock, to
                                                   decide a kick: stale means a spare
                                                   kick or a timer ``max_wait_s`` late
``_wakeups``,      one thread each (driver; the    ``wakeups``/``polls``: counters, one
``_polls``         lock holder)                    int read, never used for a decision
``_stop``,         ``threading.Event``             anyone (thread-safe by itself)
``_serve_wanted``
=================  ==============================  ===================================
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from kvpeer.errors import KVPeerError
from kvpeer.node.counters import CounterSnapshot
from kvpeer.node.tier import Tier, TierStatistics
from kvpeer.session.ports import Parent
from kvpeer.types import JobResult, Key, LookupResult, OffloadPolicy, RequestContext, TransferJob

__all__ = ["DrivenTier", "DriverCrashed", "Waitable"]

log = logging.getLogger("kvpeer.driver")

T = TypeVar("T")

#: How long a data plane's thread waits for the lock to poll a completion itself.
COMPLETION_LOCK_WAIT_S = 0.002


class DriverCrashed(KVPeerError):
    """The driver thread died; the tier's jobs were failed."""


class Waitable(Protocol):
    """What the driver sleeps on: the control transport (frames, wake-ups)."""

    def wait(self, timeout_s: float | None, also: Sequence[int] = ()) -> None:
        """Block until a frame may have arrived, :meth:`wake` was called, one of
        the file descriptors ``also`` is readable, or ``timeout_s`` passed. Safe
        from several threads at once; touches no socket."""
        ...

    def wake(self) -> None: ...


class DrivenTier:
    """A :class:`Tier` polled by its own driver thread; safe to call from the engine."""

    def __init__(
        self,
        tier: Tier,
        waiter: Waitable,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_wait_s: float = 0.05,
        name: str = "kvpeer-driver",
        wake_host: Callable[[], None] | None = None,
    ) -> None:
        """``wake_host`` is called (from the driver thread) when peer work starts
        waiting for a serve window, so a host that sleeps while idle steps again."""
        self._tier = tier
        self._waiter = waiter
        self._clock = clock
        self._max_wait = max_wait_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._crash: BaseException | None = None
        self._crash_reported = False
        self._polls = 0
        self._serve_wanted = threading.Event()
        # Readable while _serve_wanted is set: an engine asleep in wait_for_work
        # sleeps on it next to the waiter's descriptors.
        self._wanted_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._wanted_written = False  # spares a read of an eventfd nobody wrote
        self._wake_host = wake_host
        self._host_woken = False
        self._wakeups = 0
        self._sleeps_until = 0.0  # when the driver wakes by itself next
        self._deadline: float | None = None  # the tier's next timer, from the last poll
        self._watchers = 0  # engine threads in wait_for_work (invariant 2)
        # The driver's own wake-up (invariant 2): always watched by the driver only.
        self._kick_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._kick_poller = select.poll()
        self._kick_poller.register(self._kick_fd, select.POLLIN)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- driver ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            poll = True
            while not self._stop.is_set() and self._crash is None:
                wake_host = False
                # An engine thread that watches frames was woken by whatever woke
                # us: unless a timer is due, leave the poll to it (invariant 2).
                if poll or self._clock() >= self._sleeps_until:
                    with self._lock:
                        _, needs_serve = self._poll_locked(driver=True)
                    wake_host = needs_serve and not self._host_woken
                    self._host_woken = needs_serve
                if wake_host and self._wake_host is not None:
                    self._wakeups += 1
                    self._wake_host()  # once per wait for a serve window
                now = self._clock()
                wait = self._max_wait
                if (deadline := self._deadline) is not None:
                    wait = min(wait, max(0.0, deadline - now))
                self._sleeps_until = now + wait
                if self._watchers == 0:
                    self._waiter.wait(wait, also=(self._kick_fd,))
                else:
                    self._kick_poller.poll(wait * 1000)
                kicked = False
                with contextlib.suppress(BlockingIOError):
                    kicked = os.eventfd_read(self._kick_fd) > 0
                poll = not kicked and self._watchers == 0
        except BaseException as exc:  # surfaced to the engine, never swallowed
            if self._crash is None:  # the wait itself broke
                log.exception("kvpeer driver thread crashed")
                with self._lock:
                    self._crashed(exc)

    def _poll_locked(
        self, *, driver: bool = False, watcher: bool = False
    ) -> tuple[float | None, bool]:
        """Poll the tier (lock held, any thread): its next deadline and whether peer
        work waits for a serve window. A crash fails every job and re-raises.
        ``watcher``: the caller is a thread in wait_for_work."""
        if self._crash is not None:
            return None, False
        try:
            self._tier.poll()
            self._polls += 1
            deadline = self._deadline = self._tier.next_deadline()
            if not driver and deadline is not None and deadline < self._sleeps_until:
                self._kick()  # the driver re-arms its timer
            needs_serve = self._tier.needs_serve()
            if needs_serve or self._tier.has_results():
                # The only waiting thread is this one: nobody sleeps on the eventfd.
                self._want_serve(wake=not (watcher and self._watchers == 1))
        except BaseException as exc:
            log.exception("kvpeer driver crashed")
            self._crashed(exc)
            raise
        return deadline, needs_serve

    def _crashed(self, exc: BaseException) -> None:
        self._crash = exc
        self._fail_all(f"driver crashed: {exc!r}")
        self._want_serve()

    def _kick(self) -> None:
        if self._kick_fd >= 0:
            os.eventfd_write(self._kick_fd, 1)

    def _want_serve(self, *, wake: bool = True) -> None:
        if not self._serve_wanted.is_set():
            self._serve_wanted.set()
            if wake and self._wanted_fd >= 0:
                self._wanted_written = True
                os.eventfd_write(self._wanted_fd, 1)

    def on_transfer_finished(self) -> None:
        """A data plane finished a transfer (its own thread, no backend lock held):
        poll right here, so the completion goes out without waking another thread.
        The lock is usually held for a poll or an engine call (well under a
        millisecond): wait that long for it, then leave the poll to whoever watches
        (a thread that holds the lock may be waiting for this one to stop)."""
        if not self._lock.acquire(timeout=COMPLETION_LOCK_WAIT_S):
            self._waiter.wake()
            return
        try:
            if self._stop.is_set():
                return
            _, needs_serve = self._poll_locked()
            if needs_serve:
                self._waiter.wake()  # a watching driver calls wake_host
        except BaseException:
            return  # recorded as a crash: the engine hears of it on its next call
        finally:
            self._lock.release()

    def _fail_all(self, reason: str) -> None:
        try:
            self._tier.shutdown()
        except Exception:  # the tier may be what broke; its jobs still must fail
            log.exception("tier shutdown after a driver crash failed (%s)", reason)

    def _check(self) -> None:
        if self._crash is not None and not self._crash_reported:
            self._crash_reported = True
            raise DriverCrashed(f"kvpeer driver thread crashed: {self._crash!r}") from self._crash

    def wait_for_work(self, timeout_s: float) -> bool:
        """Block until peer work waits for a serve window or results wait to be
        collected (True), or ``timeout_s`` passes (False). For hosts that step
        only when needed, e.g. an idle engine. While it waits, the calling thread
        polls the tier itself whenever a frame or a completion arrives."""
        deadline = self._clock() + timeout_s
        with self._lock:
            self._watchers += 1
        try:
            return self._wait_for_work(deadline)
        finally:
            with self._lock:
                self._watchers -= 1
                if self._watchers == 0:
                    self._kick()  # the driver watches frames again

    def _wait_for_work(self, deadline: float) -> bool:
        # No poll before the first sleep: until now the driver watched, and what it
        # has not handled yet keeps a descriptor readable, so the sleep returns.
        woken = False
        while True:
            with self._lock:
                self._check()
                if self._wanted_fd < 0:  # shut down
                    return self._serve_wanted.is_set()
                if self._wanted_written:
                    self._wanted_written = False
                    with contextlib.suppress(BlockingIOError):
                        os.eventfd_read(self._wanted_fd)  # written again while wanted
                try:
                    if woken:
                        self._poll_locked(watcher=True)
                except Exception:
                    self._check()  # raises DriverCrashed
                    raise
                if self._serve_wanted.is_set():
                    self._serve_wanted.clear()
                    return True
            remaining = deadline - self._clock()
            if remaining <= 0:
                return False
            self._waiter.wait(remaining, also=(self._wanted_fd,))
            woken = True

    @property
    def crashed(self) -> bool:
        return self._crash is not None

    @property
    def wakeups(self) -> int:
        """Times the driver asked an idle host to step (one int: any thread)."""
        return self._wakeups

    @property
    def polls(self) -> int:
        return self._polls

    @property
    def tier(self) -> Tier:
        """The wrapped tier (inspect it only under :meth:`locked`)."""
        return self._tier

    def locked(self) -> threading.Lock:
        return self._lock

    def statistics(self) -> TierStatistics:
        """The tier's statistics (under the lock; never raises DriverCrashed)."""
        with self._lock:
            return self._tier.statistics()

    def counters(self) -> CounterSnapshot:
        """The tier's since-start counters (under the lock, like :meth:`statistics`)."""
        with self._lock:
            return self._tier.counters()

    # -- SecondaryTier ------------------------------------------------------------------

    def _call(self, call: Callable[[Tier], T], after_crash: Callable[[Tier], T]) -> T:
        """The engine's one way into the tier (invariant 3): under the lock; a driver
        crash is raised once as :class:`DriverCrashed`, and from then on
        ``after_crash`` answers instead of ``call``: it only reads the tier or adds
        a failed result, never sends, receives or calls the parent (the tier, shut
        down by the crash, may be what broke)."""
        with self._lock:
            self._check()
            return call(self._tier) if self._crash is None else after_crash(self._tier)

    def on_new_request(self, request: RequestContext) -> OffloadPolicy:
        return self._call(lambda t: t.on_new_request(request), _constant(OffloadPolicy.CHUNK_LEVEL))

    def lookup(self, key: Key, request: RequestContext) -> LookupResult:
        return self._call(lambda t: t.lookup(key, request), _constant(LookupResult.MISS))

    def submit_store(self, job: TransferJob) -> None:
        self._call(lambda t: t.submit_store(job), lambda t: t.fail_job(job.job_id))
        self._waiter.wake()

    def submit_load(self, job: TransferJob) -> None:
        def submit(tier: Tier) -> None:
            tier.submit_load(job)
            # The fetch already left (frames go out under the lock); the driver
            # only needs kicking if the load's timer is due before it wakes anyway.
            deadline = self._deadline = tier.next_deadline()
            if deadline is not None and deadline < self._sleeps_until:
                self._kick()

        self._call(submit, lambda t: t.fail_job(job.job_id))

    def get_finished_jobs(self) -> list[JobResult]:
        return self._call(Tier.take_results, Tier.take_results)

    def serve_external_requests(self, parent: Parent) -> None:
        self._call(lambda t: t.serve_external_requests(parent), _constant(None))
        self._waiter.wake()

    def on_schedule_end(self) -> None:
        self._call(Tier.on_schedule_end, _constant(None))

    def on_request_finished(self, request: RequestContext) -> None:
        self._call(lambda t: t.on_request_finished(request), _constant(None))
        self._waiter.wake()

    def has_pending_work(self) -> bool:
        return self._call(Tier.has_pending_work, Tier.has_pending_work)

    def drain_jobs(self) -> None:
        """Wait (bounded) for in-flight transfers while the driver keeps polling."""
        deadline = self._clock() + 5.0
        while self._clock() < deadline and not self._stop.is_set():
            if not self._call(Tier.has_transfers, _constant(False)):
                return
            self._waiter.wake()
            time.sleep(0.001)
        log.warning("drain_jobs: transfers still in flight after 5s")

    def shutdown(self) -> None:
        self._stop.set()
        self._kick()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)
        with self._lock:
            self._tier.shutdown()
            if self._wanted_fd >= 0:
                os.close(self._wanted_fd)
                self._wanted_fd = -1
            if self._kick_fd >= 0 and not self._thread.is_alive():
                os.close(self._kick_fd)
                self._kick_fd = -1


def _constant(value: T) -> Callable[[Tier], T]:
    """An answer that does not look at the tier."""
    return lambda _: value
