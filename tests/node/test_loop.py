"""The node loop's settle rule, deterministically (``kvpeer.node.loop``).

The loop watches a fake source: its descriptor is an eventfd the test writes
(a frame arrived), ``pending`` answers what the test scripted, and the loop's
``block`` is the test's, which records who sleeps on what and never times out.
No clock moves, so every poll here has exactly one cause:

- a source that says work is pending after a poll (a read cut short) gets a
  second poll, then the watcher sleeps;
- an engine call that leaves work pending (a send that ate an edge) wakes the
  watcher, and so does one that changed the source's descriptors, after which
  the watcher sleeps on the new set;
- ``wake`` ends a watcher's sleep from any thread.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
from collections.abc import Iterator, Sequence

import pytest

from kvpeer.node.loop import NodeLoop, Polled

DRIVER = "kvpeer-driver"
SAFETY_S = 10.0  # bounds a wait for a thread only if the test is already failing


def _eventfd() -> int:
    return os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)


class FakeSource:
    """A control transport as the loop sees it, plus the loop's ``block``."""

    def __init__(self) -> None:
        self.frame_fd = _eventfd()
        self.descriptors: tuple[int, ...] = (self.frame_fd,)
        self.pending_answers: list[bool] = []  # what the next pending() calls say
        self.changed = threading.Condition()
        self.polls: list[str] = []  # the thread of each poll
        self.asleep: dict[str, tuple[int, ...]] = {}  # thread -> fds it sleeps on
        self.extra: list[int] = []

    def pending(self) -> bool:
        return self.pending_answers.pop(0) if self.pending_answers else False

    def poll(self) -> Polled:
        for fd in self.descriptors:  # what a receive does: the frames are read
            with contextlib.suppress(BlockingIOError):
                os.eventfd_read(fd)
        with self.changed:
            self.polls.append(threading.current_thread().name)
            self.changed.notify_all()
        return Polled(None, False, False)

    def block(self, fds: Sequence[int], timeout_s: float) -> None:
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        name = threading.current_thread().name
        with self.changed:
            self.asleep[name] = tuple(fds)
            self.changed.notify_all()
        try:
            poller.poll()
        finally:
            with self.changed:
                del self.asleep[name]
                self.changed.notify_all()

    def until(self, condition: str, predicate: object) -> None:
        with self.changed:
            assert self.changed.wait_for(predicate, timeout=SAFETY_S), condition  # type: ignore[arg-type]

    def until_settled(self, polls: int) -> None:
        """The driver polled ``polls`` times and sleeps."""
        self.until(
            f"{polls} polls, then asleep",
            lambda: len(self.polls) >= polls and DRIVER in self.asleep,
        )
        assert self.polls == [DRIVER] * polls

    def close(self) -> None:
        for fd in (self.frame_fd, *self.extra):
            os.close(fd)


@pytest.fixture
def source() -> Iterator[FakeSource]:
    made = FakeSource()
    yield made
    made.close()


@pytest.fixture
def loop(source: FakeSource) -> Iterator[NodeLoop]:
    made = NodeLoop(source, source.poll, clock=lambda: 0.0, max_wait_s=3600.0, block=source.block)
    made.start()
    yield made
    made.stop()
    with made.lock:
        made.close()


def test_the_driver_polls_once_then_sleeps_on_the_source_and_the_channel(
    source: FakeSource, loop: NodeLoop
) -> None:
    source.until_settled(1)
    assert source.asleep[DRIVER][0] == source.frame_fd
    assert len(source.asleep[DRIVER]) == 2  # and the wake-up channel


def test_a_frame_wakes_the_driver_to_poll(source: FakeSource, loop: NodeLoop) -> None:
    source.until_settled(1)
    os.eventfd_write(source.frame_fd, 1)
    source.until_settled(2)


def test_work_left_pending_by_a_poll_gets_one_more_poll(source: FakeSource) -> None:
    source.pending_answers = [True]  # the first poll's receive was cut short
    loop = NodeLoop(source, source.poll, clock=lambda: 0.0, max_wait_s=3600.0, block=source.block)
    loop.start()
    try:
        source.until_settled(2)
    finally:
        loop.stop()
        with loop.lock:
            loop.close()


def test_an_engine_call_that_leaves_work_pending_wakes_the_watcher(
    source: FakeSource, loop: NodeLoop
) -> None:
    source.until_settled(1)
    loop.call(lambda: source.pending_answers.append(True))  # a send ate an edge
    source.until_settled(2)


def test_an_engine_call_that_leaves_nothing_pending_wakes_nobody(
    source: FakeSource, loop: NodeLoop
) -> None:
    source.until_settled(1)
    assert loop.call(lambda: 7) == 7
    os.eventfd_write(source.frame_fd, 1)  # the next thing the driver wakes for
    source.until_settled(2)  # not 3: the call itself woke nobody


def test_new_descriptors_are_watched(source: FakeSource, loop: NodeLoop) -> None:
    source.until_settled(1)
    new = _eventfd()
    source.extra.append(new)

    def connect() -> None:  # a new link's socket
        source.descriptors = (source.frame_fd, new)

    loop.call(connect)
    source.until_settled(2)  # woken to sleep on the new set (a spare poll)
    assert new in source.asleep[DRIVER]
    os.eventfd_write(new, 1)
    source.until_settled(3)


def test_wake_ends_a_watchers_sleep_from_another_thread(source: FakeSource, loop: NodeLoop) -> None:
    source.until_settled(1)
    waker = threading.Thread(target=loop.wake)
    waker.start()
    waker.join(SAFETY_S)
    source.until_settled(2)


def test_a_waiting_engine_polls_and_the_driver_leaves_the_frames_to_it(
    source: FakeSource, loop: NodeLoop
) -> None:
    source.until_settled(1)
    returned: list[bool] = []
    engine = threading.Thread(
        target=lambda: returned.append(loop.wait_for_work(60.0, lambda: None)), name="engine"
    )
    engine.start()
    source.until("engine asleep", lambda: "engine" in source.asleep)
    os.eventfd_write(source.frame_fd, 1)  # may wake both sleepers: one polls
    source.until(
        "engine polled and sleeps",
        lambda: len(source.polls) == 2 and "engine" in source.asleep,
    )
    assert source.polls == [DRIVER, "engine"]
    with loop.lock:
        loop.want()  # host work found elsewhere: the channel tells the engine
    engine.join(SAFETY_S)
    assert returned == [True]
    assert source.polls[:3] == [DRIVER, "engine", "engine"]  # the last found the want
    source.until("the driver watches again", lambda: DRIVER in source.asleep)
    polls = len(source.polls)
    os.eventfd_write(source.frame_fd, 1)
    source.until(
        "the driver polled the frame",
        lambda: len(source.polls) > polls and source.polls[-1] == DRIVER,
    )
