"""The driver's wake rule, deterministically (``kvpeer.node.driver`` invariant 2).

The driven node ``a`` sleeps on a fake waitable control: its ``wait`` blocks
until the test says a frame arrived (or someone wakes it or kicks the driver),
never on a timeout, and the fake clock only moves when a test moves it. So
every wake-up here has exactly one cause, and each test can say which thread
must have received the frames it sent:

- nobody waits in ``wait_for_work``: the driver watches frames and polls them;
- an engine thread waits in ``wait_for_work``: *it* polls the frames, and the
  driver (woken too, maybe) leaves the poll to it; when the engine leaves, the
  driver watches frames again;
- peer work waiting for a serve window calls ``wake_host`` once per wait;
- a timer set earlier than the driver's sleep kicks it to sleep less;
- a data plane's completion polls on the plane's own thread when the lock is
  free, and wakes the driver when it is not.

The peer ``b`` is a plain :class:`Tier` stepped by the test.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
from collections.abc import Iterator, Sequence

import pytest

from kvpeer.config import TierConfig
from kvpeer.node.driver import DrivenTier
from kvpeer.node.tier import Tier
from kvpeer.testing import FakeDataPlane, FakeParent, Region
from kvpeer.testing.cluster import BLOCK_LEN, NUM_BLOCKS, Cluster, TierNode, key
from kvpeer.testing.network import MemoryControl, MemoryControlLink
from kvpeer.transport.base import InboundFrame
from kvpeer.types import RequestContext, TransferJob

DRIVER = "kvpeer-driver"
ENGINE = "engine"
MAX_WAIT_S = 3600.0  # the driver never wakes by itself within a test
SAFETY_S = 10.0  # bounds a wait for a thread only if the test is already failing


class WaitableControl:
    """An in-memory control endpoint the loop can watch (ControlTransport and the
    loop's Source) and the loop's ``block``. Frames become visible on its
    descriptor when the test calls :meth:`arrive`; that stays so until the next
    ``receive``."""

    def __init__(self, inner: MemoryControl) -> None:
        self.inner = inner
        self._ready = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._descriptors = (self._ready,)
        self._changed = threading.Condition()
        self.received_by: list[str] = []  # the thread of each receive that got frames
        self.asleep: dict[str, float | None] = {}  # thread -> timeout it sleeps with
        self.sleeps: list[tuple[str, float | None]] = []  # every wait, in order

    # -- Source and Block ---------------------------------------------------------------

    @property
    def descriptors(self) -> tuple[int, ...]:
        return self._descriptors

    def pending(self) -> bool:
        return False  # level-triggered: what arrived stays readable until received

    def block(self, fds: Sequence[int], timeout_s: float) -> None:
        """Block until one of ``fds`` is readable. ``timeout_s`` is recorded, never
        waited for: time is the test's."""
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        name = threading.current_thread().name
        with self._changed:
            self.asleep[name] = timeout_s
            self.sleeps.append((name, timeout_s))
            self._changed.notify_all()
        try:
            poller.poll()
        finally:
            with self._changed:
                del self.asleep[name]
                self._changed.notify_all()

    # -- ControlTransport --------------------------------------------------------------

    @property
    def local_id(self) -> str:
        return self.inner.local_id

    def connect(self, peer_id: str) -> MemoryControlLink:
        return self.inner.connect(peer_id)

    def receive(self) -> list[InboundFrame]:
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self._ready)
        frames = self.inner.receive()
        if frames:
            with self._changed:
                self.received_by.append(threading.current_thread().name)
                self._changed.notify_all()
        return frames

    def flush(self) -> None:
        self.inner.flush()

    def refuse(self, peer_id: str, frame: bytes) -> None:
        self.inner.refuse(peer_id, frame)

    def next_deadline(self) -> float | None:
        return self.inner.next_deadline()

    def close(self) -> None:
        self.inner.close()
        os.close(self._ready)

    # -- the test's side ---------------------------------------------------------------

    def arrive(self) -> None:
        """Frames the peer sent are now readable (what a socket's descriptor says)."""
        os.eventfd_write(self._ready, 1)

    def until(self, condition: str, predicate: object) -> None:
        with self._changed:
            assert self._changed.wait_for(predicate, timeout=SAFETY_S), condition  # type: ignore[arg-type]

    def until_asleep(self, *names: str) -> None:
        self.until(f"{names} asleep", lambda: all(n in self.asleep for n in names))

    def until_received(self, count: int) -> None:
        self.until(f"{count} receives", lambda: len(self.received_by) >= count)


class Node:
    """The driven node ``a`` and what it did."""

    def __init__(self, cluster: Cluster, config: dict[str, object] | None = None) -> None:
        self.config = TierConfig.from_dict({"host": "a", "port": 1, **(config or {})})
        self.region = Region(NUM_BLOCKS, BLOCK_LEN)
        self.plane = FakeDataPlane(cluster.fabric, self.config.peer_id, self.region)
        self.parent = FakeParent(self.region, cluster.job_ids)
        self.control = WaitableControl(cluster.net.attach(self.config.peer_id))
        self.host_wakeups = threading.Semaphore(0)
        tier = Tier(self.config, self.control, self.plane, clock=cluster.clock)
        self.driven = DrivenTier(
            tier,
            self.control,
            clock=cluster.clock,
            max_wait_s=MAX_WAIT_S,
            wake_host=self.host_wakeups.release,
            block=self.control.block,
        )

    @property
    def peer_id(self) -> str:
        return self.config.peer_id

    def source(self, kv_id: str) -> dict[str, object]:
        return {"kv_request_id": kv_id, "remote_host": "a", "remote_port": 1}

    @contextlib.contextmanager
    def engine_waiting(self) -> Iterator[list[bool]]:
        """An engine thread in ``wait_for_work`` (asleep) for the ``with`` block;
        afterwards the list holds what the call returned."""
        returned: list[bool] = []
        thread = threading.Thread(
            target=lambda: returned.append(self.driven.wait_for_work(60.0)), name=ENGINE
        )
        thread.start()
        self.control.until_asleep(ENGINE)
        try:
            yield returned
        finally:
            thread.join(SAFETY_S)
            assert not thread.is_alive(), "wait_for_work did not return"


@pytest.fixture
def cluster() -> Cluster:
    return Cluster()


@pytest.fixture
def a(cluster: Cluster) -> Iterator[Node]:
    node = Node(cluster)
    node.control.until_asleep(DRIVER)
    yield node
    node.driven.shutdown()


@pytest.fixture
def b(cluster: Cluster) -> TierNode:
    return cluster.add("b", 2)


def handshake(a: Node, b: TierNode) -> RequestContext:
    """``b`` opens a session to ``a`` for a symmetric pull; ``a``'s driver polls
    each frame. Returns ``b``'s request."""
    ctx = b.request("r", {"remote_kv_source": a.source("kv")})
    received = len(a.control.received_by)
    a.control.arrive()  # b's connect
    a.control.until_received(received + 1)
    a.control.until_asleep(DRIVER)
    b.step()  # a's connect and ack
    assert b.session(a).ready  # type: ignore[arg-type]
    return ctx


def send_lookup(a: Node, b: TierNode, ctx: RequestContext, n: int) -> None:
    """``b`` probes one key at ``a`` (the lookup leaves at its schedule end)."""
    b.lookup(ctx, key(n))
    b.tier.on_schedule_end()
    a.control.arrive()


class TestWhoPolls:
    def test_with_nobody_waiting_the_driver_polls_frames(self, a: Node, b: TierNode) -> None:
        handshake(a, b)
        assert a.control.received_by == [DRIVER]

    def test_a_waiting_engine_polls_the_frames_itself(self, a: Node, b: TierNode) -> None:
        ctx = handshake(a, b)
        with a.engine_waiting() as returned:
            send_lookup(a, b, ctx, 1)  # peer work for a serve window: wait_for_work returns
        assert returned == [True]
        assert a.control.received_by == [DRIVER, ENGINE]

    def test_the_driver_watches_frames_again_when_the_engine_leaves(
        self, a: Node, b: TierNode
    ) -> None:
        ctx = handshake(a, b)
        with a.engine_waiting():
            send_lookup(a, b, ctx, 1)
        a.control.until_asleep(DRIVER)  # back on the frames' descriptor: kicked
        a.driven.serve_external_requests(a.parent)
        b.step()
        send_lookup(a, b, ctx, 2)
        a.control.until_received(3)
        assert a.control.received_by == [DRIVER, ENGINE, DRIVER]

    def test_frames_that_need_no_serve_keep_the_engine_waiting(self, a: Node, b: TierNode) -> None:
        with a.engine_waiting() as returned:
            b.request("r", {"remote_kv_source": a.source("kv")})  # b's connect
            a.control.arrive()
            a.control.until_received(1)
            a.control.until_asleep(ENGINE)  # handled it and sleeps again
            b.step()  # the handshake completes on b; a receives b's ack
            a.control.arrive()
            a.control.until_received(2)
            a.control.until_asleep(ENGINE)
            assert returned == []
            a.driven.submit_store(TransferJob(99, (), (), RequestContext("local", None)))
        assert returned == [True]  # the store's result waits to be collected
        assert a.control.received_by == [ENGINE, ENGINE]


class TestWakeHost:
    def test_once_per_wait_for_a_serve_window(self, a: Node, b: TierNode) -> None:
        ctx = handshake(a, b)
        send_lookup(a, b, ctx, 1)
        assert a.host_wakeups.acquire(timeout=SAFETY_S)
        a.control.until_asleep(DRIVER)
        send_lookup(a, b, ctx, 2)  # still waiting for the same window
        a.control.until_received(3)
        a.control.until_asleep(DRIVER)
        assert a.driven.wakeups == 1
        polls = a.driven.polls
        a.driven.serve_external_requests(a.parent)  # the window, polled at once
        a.control.until(
            "the driver polled after the serve window",
            lambda: a.driven.polls > polls and DRIVER in a.control.asleep,
        )
        b.step()
        send_lookup(a, b, ctx, 3)  # a new wait
        assert a.host_wakeups.acquire(timeout=SAFETY_S)
        assert a.driven.wakeups == 2


class TestServeWindow:
    def test_a_window_that_serves_polls_on_the_engine_thread(self, a: Node, b: TierNode) -> None:
        ctx = handshake(a, b)
        send_lookup(a, b, ctx, 1)
        assert a.host_wakeups.acquire(timeout=SAFETY_S)
        a.control.until_asleep(DRIVER)
        polls = a.driven.polls
        a.driven.serve_external_requests(a.parent)
        assert a.driven.polls == polls + 1  # done before the call returned, by this thread

    def test_a_window_with_nothing_to_serve_polls_nothing(self, a: Node, b: TierNode) -> None:
        handshake(a, b)
        polls = a.driven.polls
        a.driven.serve_external_requests(a.parent)
        assert a.driven.polls == polls


class TestTimers:
    def test_an_earlier_timer_kicks_the_driver_to_sleep_less(self, cluster: Cluster) -> None:
        a = Node(
            cluster, {"handshake_timeout_s": 1000.0, "peer_wait_s": 900.0, "load_timeout_s": 30.0}
        )
        try:
            b = cluster.add("b", 2)
            a.control.until_asleep(DRIVER)
            assert a.control.asleep[DRIVER] == MAX_WAIT_S
            ctx = RequestContext("r", {"remote_prefiller": b.source("kv")})
            a.driven.on_new_request(ctx)
            a.driven.submit_load(TransferJob(1, (key(1),), (40,), ctx))
            a.control.until(
                "driver re-armed", lambda: a.control.asleep.get(DRIVER) not in (None, MAX_WAIT_S)
            )
            assert a.control.asleep[DRIVER] == pytest.approx(30.0)
        finally:
            a.driven.shutdown()


class TestCompletions:
    def test_a_completion_polls_on_the_planes_thread(self, a: Node, b: TierNode) -> None:
        b.request("r", {"remote_kv_source": a.source("kv")})  # a frame waits, unannounced
        plane = threading.Thread(target=a.driven.loop.request_poll, name="plane")
        plane.start()
        plane.join(SAFETY_S)
        assert a.control.received_by == ["plane"]

    def test_with_the_lock_taken_a_completion_wakes_the_driver(self, a: Node, b: TierNode) -> None:
        b.request("r", {"remote_kv_source": a.source("kv")})
        with a.driven.locked():
            plane = threading.Thread(target=a.driven.loop.request_poll, name="plane")
            plane.start()
            plane.join(SAFETY_S)
            assert a.control.received_by == []
        a.control.until_received(1)
        assert a.control.received_by == [DRIVER]
