"""The node's loop: one owner for the lock, the wake-up channel, the poll set and
the rule of who polls when (docs/design.md §4.3).

What a poll is belongs to the caller (``poll``: the tier's receive, timers,
completions, sends); *when* one happens, and on which thread, is decided here and
nowhere else. The pieces:

- **the lock** (:attr:`NodeLoop.lock`): guards the tier, its sockets and every
  field of this loop not named in the table of stale reads below;
- **the wake-up channel**: one eventfd. Written means "the watcher polls soon";
  drained only by a thread that then polls, under the lock;
- **the poll set**: the source's descriptors (a control transport's sockets, see
  :class:`Source`) plus the wake-up eventfd. One thread at a time *watches* it;
- **the settle rule**: whoever leaves the lock after touching the tier (every
  :meth:`NodeLoop.call`, every poll) asks the source whether it left work that its
  descriptors will not announce (:meth:`Source.pending`: ZMQ's edge-triggered
  ``ZMQ_FD``) and whether its descriptors changed; either writes the wake-up
  channel, so the watcher polls or sleeps on the new set. Nothing else in the node
  writes it on the source's behalf.

Who sleeps on what, who wakes it, what it may touch (every thread touches the
tier and the sockets only under the lock):

================  =========  =======================  ==========================  ==============
thread            mode       sleeps on                woken by                    polls
================  =========  =======================  ==========================  ==============
driver            watcher    the poll set, until the  a frame (socket descriptor) on every wake
                  (no engine tier's next deadline,    or the wake-up channel; its
                  waits)     at most ``max_wait_s``   timer
driver            an engine  the lock's condition,    a timer set earlier than    only when a
                  waits:     until the next deadline  it sleeps, the last engine  timer is due
                  timers                              leaving, a host wake-up
                                                      owed, ``stop`` (notify)
engine in         watcher    the poll set, until its  a frame, the wake-up        on every wake
``wait_for_work``            own timeout              channel (e.g. a poll
                                                      elsewhere found host work)
engine, any       -          the lock only            -                           after a serve
other call                                                                        window that
                                                                                  served; frames
                                                                                  it queues
                                                                                  leave at once
data-plane        -          the lock, at most        -                           if it got the
thread                       ``COMPLETION_LOCK_                                   lock, else it
(request_poll)               WAIT_S``, then gives up                              writes the
                                                                                  channel
================  =========  =======================  ==========================  ==============

That is the driven mode (a real node: :class:`~kvpeer.node.driver.DrivenTier`). In
the undriven mode (a plain :class:`~kvpeer.node.tier.Tier`: the simulation, the
cluster kit) there is no loop: one thread calls ``poll`` when it likes and nothing
sleeps.

Host wake-ups: when a poll finds peer work waiting for a serve window while no
engine thread is in ``wait_for_work``, the driver calls ``wake_host`` once per
such wait (outside the lock). An engine in ``wait_for_work`` is woken instead by
the wake-up channel and returns True.

Fields read without the lock, and why a stale read is harmless (everything else
is read and written under the lock):

==================  ============================  =====================================
field               written                       read outside the lock by
==================  ============================  =====================================
``_wake_fd``        ``__init__``; -1 by ``close`` :meth:`wake` from a data plane's thread:
                    (after the planes stopped)    planes are closed before the loop, so
                                                  no write goes into a reused descriptor
``_wakeups``,       under the lock                the properties: counters, one int read,
``_polls``                                        never used for a decision
``_fresh``          the driver only               the driver only (no other reader)
==================  ============================  =====================================

Stale decisions this design accepts: a driver that was watching when an engine
entered ``wait_for_work`` stays asleep on the poll set until the next wake-up
(then both wake; the driver sees the engine watching and leaves the poll to it);
and a wake-up meant to re-arm the watching driver's timer may be drained by an
engine that starts watching at that moment, in which case the timer fires at most
``max_wait_s`` late.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from kvpeer.node.trim import HeapTrimmer, TrimStatistics

__all__ = ["COMPLETION_LOCK_WAIT_S", "Block", "NodeLoop", "Polled", "Source"]

log = logging.getLogger("kvpeer.loop")

T = TypeVar("T")

#: How long a data plane's thread waits for the lock to poll a completion itself.
COMPLETION_LOCK_WAIT_S = 0.002

#: Block until one of the descriptors is readable or ``timeout_s`` passed.
Block = Callable[[Sequence[int], float], None]


class Source(Protocol):
    """What the loop watches besides its own wake-up channel: a control transport."""

    @property
    def descriptors(self) -> tuple[int, ...]:
        """Descriptors readable when work may be waiting (the same tuple object until
        the set changes; changed only by calls made under the lock)."""
        ...

    def pending(self) -> bool:
        """Lock held: whether work waits that :attr:`descriptors` will not announce
        (a read cut short, a send that ate an edge, frames queued for the pump).
        After False, new work makes a descriptor readable until the next call."""
        ...


@dataclass(frozen=True, slots=True)
class Polled:
    """What a poll found: the next timer, and what waits for the host."""

    deadline: float | None
    needs_serve: bool
    has_results: bool


def poll_block(fds: Sequence[int], timeout_s: float) -> None:
    """The default :data:`Block`: ``poll(2)`` on ``fds``."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    poller.poll(max(0.0, timeout_s) * 1000)


class NodeLoop:
    """Runs the driver thread and decides who polls when (see the module docstring)."""

    def __init__(
        self,
        source: Source,
        poll: Callable[[], Polled],
        *,
        clock: Callable[[], float],
        max_wait_s: float = 0.05,
        name: str = "kvpeer-driver",
        wake_host: Callable[[], None] | None = None,
        broke: Callable[[BaseException], None] | None = None,
        block: Block = poll_block,
        trimmer: HeapTrimmer | None = None,
    ) -> None:
        """``poll`` polls the tier (lock held) and may raise after recording a crash
        (then the loop stops driving, see :meth:`halt`); ``broke`` is told, under the
        lock, when the driver thread itself fails outside a poll. ``trimmer``: the
        driver hands freed heap memory back when it is due, outside the lock, before
        it sleeps on the poll set (:mod:`kvpeer.node.trim`)."""
        self.lock = threading.Lock()
        self._cond = threading.Condition(self.lock)
        self._source = source
        self._poll = poll
        self._clock = clock
        self._max_wait = max_wait_s
        self._wake_host = wake_host
        self._broke = broke
        self._block = block
        self._trimmer = trimmer
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._fds = source.descriptors
        self._stopping = False
        self._halted = False  # a crash: polls stop, the driver leaves
        self._watchers = 0  # engine threads in wait_for_work
        self._wanted = False  # work for the host: wait_for_work returns True
        self._host_woken = False  # wake_host was called for the current wait
        self._host_due = False  # the driver owes a wake_host call
        self._deadline: float | None = None  # the tier's next timer
        self._sleeps_until = 0.0  # when the driver wakes by itself next
        self._fresh = True  # the driver's last wake came from the poll set (driver only)
        self._wakeups = 0
        self._polls = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    # -- any thread ------------------------------------------------------------------

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` under the lock, then settle (the engine's way in)."""
        with self.lock:
            try:
                return fn()
            finally:
                self._settle()

    def wake(self) -> None:
        """The watcher polls soon (any thread, lock held or not)."""
        fd = self._wake_fd
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.eventfd_write(fd, 1)

    def request_poll(self) -> None:
        """A data plane's one way to ask for a poll (its own thread, no backend lock
        held): poll right here if the lock comes within ``COMPLETION_LOCK_WAIT_S``,
        so a completion goes out without waking another thread; else leave it to
        the watcher (the lock holder may be waiting for this thread)."""
        if not self.lock.acquire(timeout=COMPLETION_LOCK_WAIT_S):
            self.wake()
            return
        try:
            if not self._stopping:
                self._poll_here(watcher=False)
        except BaseException:
            return  # recorded as a crash by ``poll``: the engine hears of it
        finally:
            try:
                self._settle()
            finally:
                self.lock.release()

    def poll_now(self) -> None:
        """Lock held: poll on this thread now (an engine call that knows a poll is due:
        cheaper than waking the watcher for it)."""
        self._poll_here(watcher=False)

    def want(self) -> None:
        """Lock held: something waits for the host (a crash's failed jobs)."""
        self._set_wanted(watcher=False)

    def halt(self) -> None:
        """Lock held: stop polling for good (the tier crashed) and wake every sleeper."""
        self._halted = True
        self._cond.notify_all()
        self.wake()

    def timer_set(self, deadline: float | None) -> None:
        """Lock held: the tier's next timer moved without a poll (a new load)."""
        self._deadline = deadline
        if deadline is not None and deadline < self._sleeps_until:
            self._nudge_driver()

    def wait_for_work(self, timeout_s: float, check: Callable[[], None]) -> bool:
        """Watch the poll set for up to ``timeout_s``, polling on every wake, until
        work waits for the host (True) or the time is up (False). ``check`` runs
        under the lock each round (it raises a crash once)."""
        deadline = self._clock() + timeout_s
        with self.lock:
            self._watchers += 1
        try:
            return self._watch(deadline, check)
        finally:
            with self.lock:
                self._watchers -= 1
                if self._watchers == 0:
                    self._cond.notify_all()  # the driver watches again

    def _watch(self, deadline: float, check: Callable[[], None]) -> bool:
        # No poll before the first sleep: until now the driver watched, and what it
        # left undone keeps a descriptor or the wake-up channel readable.
        woken = False
        while True:
            with self.lock:
                try:
                    check()
                    if self._wake_fd < 0:  # closed
                        return self._take_wanted()
                    if woken:
                        self._poll_here(watcher=True)
                    if self._take_wanted():
                        return True
                finally:
                    self._settle()
                fds = (*self._fds, self._wake_fd)
            remaining = deadline - self._clock()
            if remaining <= 0:
                return False
            self._block(fds, remaining)
            woken = True

    def stop(self) -> None:
        """Stop the driver thread and wait for it (not from the driver itself)."""
        with self.lock:
            self._stopping = True
            self._cond.notify_all()
        self.wake()
        if threading.current_thread() is not self._thread and self._thread.is_alive():
            self._thread.join(timeout=10)

    def close(self) -> None:
        """Lock held, after :meth:`stop` and after the data planes stopped."""
        if self._wake_fd >= 0 and not self._thread.is_alive():
            os.close(self._wake_fd)
            self._wake_fd = -1

    @property
    def heap_trims(self) -> TrimStatistics | None:
        """What the driver's heap trims did (None: it does not trim)."""
        return self._trimmer.statistics() if self._trimmer is not None else None

    @property
    def wakeups(self) -> int:
        """Times the driver asked an idle host to step."""
        return self._wakeups

    @property
    def polls(self) -> int:
        return self._polls

    # -- the driver thread -------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._drive():
                pass
        except BaseException as exc:  # the loop itself broke: surfaced to the engine
            log.exception("kvpeer driver thread crashed")
            with self.lock:
                if not self._halted and self._broke is not None:
                    self._broke(exc)

    def _drive(self) -> bool:
        """One round of the driver: poll if it watches or a timer is due, call the
        host if owed, sleep. False when the thread should end."""
        with self.lock:
            if self._stopping or self._halted:
                return False
            watching = self._watchers == 0
            try:
                if (watching and self._fresh) or self._clock() >= self._sleeps_until:
                    self._poll_here(watcher=watching, driver=True)
            except Exception:
                return False  # a crash, recorded by ``poll``
            finally:
                self._settle()
            host = self._host_due and self._wake_host is not None
            self._host_due = False
            if host:
                self._wakeups += 1
            wait = self._max_wait
            now = self._clock()
            if (deadline := self._deadline) is not None:
                wait = min(wait, max(0.0, deadline - now))
            self._sleeps_until = now + wait
            # Woken from anything but the poll set, the driver has nothing to poll
            # for: what arrived meanwhile keeps the poll set readable.
            self._fresh = False
            if not host and not watching:
                self._cond.wait(wait)  # timers only: the engine watches
                return True
            fds = (*self._fds, self._wake_fd)
        if host:
            assert self._wake_host is not None
            self._wake_host()  # once per wait for a serve window
            return True  # the sleep is decided under the lock again
        trimmer = self._trimmer
        if trimmer is not None and trimmer.due(now):
            trimmer.look(now)  # outside the lock: no frame or engine call waits on it
        self._block(fds, wait)
        self._fresh = True
        return True

    # -- internals (lock held) ------------------------------------------------------------

    def _poll_here(self, *, watcher: bool, driver: bool = False) -> None:
        """Poll on this thread. ``watcher``: it watches the poll set, so the wake-up
        it was woken by is its to drain."""
        if watcher:
            with contextlib.suppress(BlockingIOError):
                os.eventfd_read(self._wake_fd)
        if self._halted:
            return  # a crash: the tier is not polled again
        found = self._poll()
        self._polls += 1
        self._deadline = found.deadline
        if found.needs_serve or found.has_results:
            self._set_wanted(watcher=watcher and not driver)
        if self._watchers == 0:
            if found.needs_serve and not self._host_woken:
                self._host_due = True
                if not driver:
                    self._nudge_driver()
            self._host_woken = found.needs_serve
        if not driver and found.deadline is not None and found.deadline < self._sleeps_until:
            self._nudge_driver()  # it re-arms its timer

    def _set_wanted(self, *, watcher: bool) -> None:
        if not self._wanted:
            self._wanted = True
            # An engine in wait_for_work learns of it through the channel, unless the
            # poller is the only one there.
            if self._watchers > (1 if watcher else 0):
                self.wake()

    def _take_wanted(self) -> bool:
        wanted, self._wanted = self._wanted, False
        return wanted

    def _nudge_driver(self) -> None:
        """Make the driver run a round: it watches (channel) or keeps timers (condition)."""
        if self._watchers == 0:
            self.wake()
        else:
            self._cond.notify_all()

    def _settle(self) -> None:
        """The settle rule (module docstring): the one place that turns what the
        source left behind into a wake-up."""
        source = self._source
        fds = source.descriptors
        changed = fds is not self._fds
        if changed:
            self._fds = fds
        if source.pending() or changed:
            self.wake()
