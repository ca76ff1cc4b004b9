"""The thread-safe tier the engine talks to: a facade over :class:`Tier` driven by
a :class:`~kvpeer.node.loop.NodeLoop` (docs/design.md §4.3).

Invariants:

1. The loop's lock guards the tier and its sockets; who polls when, on which
   thread, and what each thread sleeps on is the loop's (its module docstring has
   the table). Frames an engine call queues leave on the engine thread at once
   (the control transport sends them under the lock).
2. Every engine call enters the tier one way (``DrivenTier._call``): through the
   loop (under the lock, settled on the way out), after a crash check. A crash in
   a poll fails every job the tier held (they come back from
   ``get_finished_jobs``) and raises :class:`DriverCrashed` on the engine's next
   call, once; afterwards the tier answers MISS and fails new jobs without being
   called (it may be what broke).
3. ``shutdown`` stops the driver thread (joined) before the tier closes its
   sockets and data planes, and closes the loop's wake-up channel after them;
   nothing survives it.

Fields read without the lock, and why a stale read is harmless (everything else
is read and written under the lock):

=================  ==============================  ===================================
field              written                         read outside the lock by
=================  ==============================  ===================================
``_crash``         under the lock, once            ``crashed``: a stale None means the
                                                   crash is reported by the next call
``_closed``        ``shutdown``, once              ``drain_jobs``: a stale False costs
                                                   one more bounded round
=================  ==============================  ===================================
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvpeer.errors import KVPeerError
from kvpeer.node.ahead import KeysOf, RowCopy
from kvpeer.node.counters import CounterSnapshot
from kvpeer.node.loop import Block, NodeLoop, Polled, Source, poll_block
from kvpeer.node.tier import Tier, TierStatistics
from kvpeer.node.trim import HeapTrimmer, glibc_malloc_trim
from kvpeer.session.ports import Parent
from kvpeer.types import JobResult, Key, LookupResult, OffloadPolicy, RequestContext, TransferJob

__all__ = ["DrivenTier", "DriverCrashed"]

log = logging.getLogger("kvpeer.driver")

T = TypeVar("T")


class DriverCrashed(KVPeerError):
    """The driver thread died; the tier's jobs were failed."""


class DrivenTier:
    """A :class:`Tier` polled by its own driver thread; safe to call from the engine."""

    def __init__(
        self,
        tier: Tier,
        source: Source,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_wait_s: float = 0.05,
        name: str = "kvpeer-driver",
        wake_host: Callable[[], None] | None = None,
        block: Block = poll_block,
        trim_heap: bool = False,
    ) -> None:
        """``source``: the control transport the loop watches. ``wake_host`` is
        called (from the driver thread) when peer work starts waiting for a serve
        window, so a host that sleeps while idle steps again. ``block``: how a
        watcher sleeps on descriptors (tests give a recording one). ``trim_heap``:
        the driver hands the process's freed heap memory back to the system
        (:mod:`kvpeer.node.trim`; a no-op without glibc): for a node that owns its
        process."""
        self._tier = tier
        self._clock = clock
        self._crash: BaseException | None = None
        self._crash_reported = False
        self._closed = False
        self._loop = NodeLoop(
            source,
            self._poll_locked,
            clock=clock,
            max_wait_s=max_wait_s,
            name=name,
            wake_host=wake_host,
            broke=self._crashed,
            block=block,
            trimmer=HeapTrimmer(glibc_malloc_trim(), clock=clock) if trim_heap else None,
        )
        self._loop.start()

    def _poll_locked(self) -> Polled:
        """Poll the tier (lock held, any thread). A crash fails every job and re-raises."""
        if self._crash is not None:
            return Polled(None, False, False)
        try:
            tier = self._tier
            tier.poll()
            return Polled(tier.next_deadline(), tier.needs_serve(), tier.has_results())
        except BaseException as exc:
            log.exception("kvpeer driver crashed")
            self._crashed(exc)
            raise

    def _crashed(self, exc: BaseException) -> None:
        """Lock held."""
        if self._crash is not None:
            return
        self._crash = exc
        self._fail_all(f"driver crashed: {exc!r}")
        self._loop.want()
        self._loop.halt()

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
        return self._loop.wait_for_work(timeout_s, self._check)

    @property
    def crashed(self) -> bool:
        return self._crash is not None

    @property
    def wakeups(self) -> int:
        """Times the driver asked an idle host to step (one int: any thread)."""
        return self._loop.wakeups

    @property
    def polls(self) -> int:
        return self._loop.polls

    @property
    def loop(self) -> NodeLoop:
        return self._loop

    @property
    def tier(self) -> Tier:
        """The wrapped tier (inspect it only under :meth:`locked`)."""
        return self._tier

    def locked(self) -> threading.Lock:
        """The loop's lock, for reading the tier (a section that sends or receives
        goes through the loop instead, which settles it)."""
        return self._loop.lock

    def statistics(self) -> TierStatistics:
        """The tier's statistics (under the lock; never raises DriverCrashed)."""
        with self._loop.lock:
            return self._tier.statistics()

    def counters(self) -> CounterSnapshot:
        """The tier's since-start counters (under the lock, like :meth:`statistics`)."""
        with self._loop.lock:
            return self._tier.counters()

    # -- SecondaryTier ------------------------------------------------------------------

    def _call(self, call: Callable[[Tier], T], after_crash: Callable[[Tier], T]) -> T:
        """The engine's one way into the tier (invariant 2): under the lock; a driver
        crash is raised once as :class:`DriverCrashed`, and from then on
        ``after_crash`` answers instead of ``call``: it only reads the tier or adds
        a failed result, never sends, receives or calls the parent (the tier, shut
        down by the crash, may be what broke)."""

        def enter() -> T:
            self._check()
            return call(self._tier) if self._crash is None else after_crash(self._tier)

        return self._loop.call(enter)

    def on_new_request(self, request: RequestContext) -> OffloadPolicy:
        return self._call(lambda t: t.on_new_request(request), _constant(OffloadPolicy.CHUNK_LEVEL))

    def lookup(self, key: Key, request: RequestContext) -> LookupResult:
        return self._call(lambda t: t.lookup(key, request), _constant(LookupResult.MISS))

    def pull_confirmed(self, request: RequestContext) -> bool:
        return self._call(lambda t: t.pull_confirmed(request), _constant(False))

    def promotion_waited(self, request: RequestContext, waited_s: float, done: bool) -> None:
        self._call(lambda t: t.promotion_waited(request, waited_s, done), _constant(None))

    def configure_staging(
        self, rows: list[int], keys_of: KeysOf, copy: RowCopy, block_len: int
    ) -> None:
        """The host withheld ``rows`` for pulling ahead (:meth:`Tier.configure_staging`)."""
        self._call(lambda t: t.configure_staging(rows, keys_of, copy, block_len),
                   _constant(None))  # fmt: skip

    def reset_staging(self) -> frozenset[int]:
        return self._call(Tier.reset_staging, lambda t: t.ahead.rows)

    def staged_state(
        self, keys: Sequence[Key], request: RequestContext | None = None
    ) -> bool | None:
        return self._call(lambda t: t.staged_state(keys, request), _constant(None))

    def adopt_staged(
        self, keys: Sequence[Key], rows: list[int], request: RequestContext
    ) -> list[int] | None:
        return self._call(lambda t: t.adopt_staged(keys, rows, request), _constant(None))

    def submit_store(self, job: TransferJob) -> None:
        self._call(lambda t: t.submit_store(job), lambda t: t.fail_job(job.job_id))
        self._loop.wake()

    def submit_load(self, job: TransferJob) -> None:
        def submit(tier: Tier) -> None:
            tier.submit_load(job)
            # The fetch already left (frames go out under the lock); the driver
            # only needs a nudge if the load's timer is due before it wakes anyway.
            self._loop.timer_set(tier.next_deadline())

        self._call(submit, lambda t: t.fail_job(job.job_id))

    def get_finished_jobs(self) -> list[JobResult]:
        return self._call(Tier.take_results, Tier.take_results)

    def serve_external_requests(self, parent: Parent) -> None:
        def serve(tier: Tier) -> None:
            if not tier.needs_serve():
                return  # nothing waits for this window: nothing to serve or poll
            tier.serve_external_requests(parent)
            # What the window started (a copy done inline, answers) is reported by
            # a poll: this thread holds the lock, so it polls rather than wake one.
            try:
                self._loop.poll_now()
            except Exception:
                self._check()  # raises DriverCrashed: the poll recorded the crash
                raise

        self._call(serve, _constant(None))

    def on_schedule_end(self) -> None:
        self._call(Tier.on_schedule_end, _constant(None))

    def on_request_finished(self, request: RequestContext) -> None:
        self._call(lambda t: t.on_request_finished(request), _constant(None))
        self._loop.wake()

    def has_pending_work(self) -> bool:
        return self._call(Tier.has_pending_work, Tier.has_pending_work)

    def drain_jobs(self) -> None:
        """Wait (bounded) for in-flight transfers while the driver keeps polling."""
        deadline = self._clock() + 5.0
        while self._clock() < deadline and not self._closed:
            if not self._call(Tier.has_transfers, _constant(False)):
                return
            self._loop.wake()
            time.sleep(0.001)
        log.warning("drain_jobs: transfers still in flight after 5s")

    def shutdown(self) -> None:
        self._closed = True
        self._loop.stop()
        with self._loop.lock:
            self._tier.shutdown()  # its data planes' threads are stopped with it
            self._loop.close()


def _constant(value: T) -> Callable[[Tier], T]:
    """An answer that does not look at the tier."""
    return lambda _: value
