"""The I/O shell around :class:`~kvpeer.router.feed.EventFeed`: one engine's vLLM KV
event publisher (ZMQ SUB) and replay endpoint (ZMQ DEALER), on the edge's asyncio loop.

All sequencing decisions are the feed's; this class only moves frames between sockets
and the feed, feed items into the index, and the feed's answer to a :meth:`verify` to
whoever awaits it. It runs on the same event loop as the
policy, so the index needs no lock. Sockets are bounded (``MAXMSGSIZE``), never linger,
and a message that does not fit is dropped by ZMQ before it reaches Python.

The history is asked for only once the SUB socket's connection to the publisher has
completed its handshake (a socket monitor says so), never as the sockets are created. A
PUB socket sends a batch only to the subscriptions it holds at that moment: asked any
earlier, the replay could be answered before the subscription reached the publisher,
and a batch published in between would be in neither -- lost for good if the engine
then goes quiet, since only a later batch would reveal the gap. Asked after the
handshake, the subscription (the first thing a SUB sends on a connection) left before
the request did, and a batch published after the answer reaches it. What remains is a
window of about a millisecond in principle (a PUB takes new subscriptions in at a send,
unless it already did so within the last millisecond): an engine publishing that fast is
not quiet, and its next batch shows the gap, which is replayed.

Every replay request goes out on a DEALER socket of its own, and the one before it is
closed. vLLM's replay answers carry no request id, only sequence numbers and an end
marker, so an answer still in flight when the feed gave its request up (a verify()
decided by its first frame, a reset, an answer that stalled) would otherwise be read as
the answer to the next request: its end marker closed the next replay before a frame
of it arrived, the real answer was dropped as unexpected, and the engine's history was
lost until its next restart (``tests/router/test_flap.py``, under load). A closed
socket's pending frames go with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvpeer.router.events import MAX_PAYLOAD_BYTES
from kvpeer.router.feed import (
    Anchor,
    Continuity,
    EventFeed,
    FeedLimits,
    FeedOutput,
    FeedStatistics,
    encode_replay_request,
)
from kvpeer.router.index import PrefixIndex

__all__ = ["REPLAY_RCVHWM", "EventSubscriber"]

_MAX_MESSAGES_PER_WAKE = 256  # then yield to the loop, so HTTP requests are not starved
#: Replayed frames libzmq may queue for the feed (ZMQ's default is 1,000). vLLM sends a
#: whole answer at once and its replay socket drops what exceeds its own send
#: high-water mark (1,000): room for vLLM's whole default buffer (10,000 batches) on
#: this side drains that socket as fast as the connection moves frames, so far fewer are
#: dropped; the feed asks again for the rest.
REPLAY_RCVHWM = 16_384


class EventSubscriber:
    """Follows one engine's KV events into ``index`` until ``stop`` is set."""

    def __init__(
        self,
        engine: str,
        endpoint: str,
        index: PrefixIndex,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        context: zmq.asyncio.Context | None = None,
        limits: FeedLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._engine = engine
        self._endpoint = endpoint
        self._replay_endpoint = replay_endpoint
        self._topic = topic.encode()
        self._index = index
        self._context = context
        self._clock = clock
        # Items reach the index as the feed produces them: a replayed history is applied
        # batch by batch, never held decoded in full.
        self._feed = EventFeed(
            can_replay=replay_endpoint is not None,
            limits=limits,
            sink=lambda item: index.apply(engine, item),
        )
        self._replay_sockets: _ReplaySockets | None = None  # while run() runs
        self._ask: int | None = None  # a replay request verify() left for run() to send
        self._wake = asyncio.Event()  # run() re-reads the feed's deadline
        self._verdict: asyncio.Future[Continuity] | None = None

    @property
    def engine(self) -> str:
        return self._engine

    @property
    def endpoint(self) -> str:
        """The publisher's endpoint this feed subscribes to."""
        return self._endpoint

    def statistics(self) -> FeedStatistics:
        return self._feed.statistics()

    def resync(self, *, restarted: bool = True) -> None:
        """The edge saw the engine restart: forget it and relearn from its stream."""
        self._apply(self._feed.reset(restarted=restarted))

    def anchor(self) -> Anchor | None:
        """Where the feed stands now, to :meth:`verify` the engine against later."""
        return self._feed.anchor()

    async def verify(self, anchor: Anchor | None) -> Continuity:
        """Whether the publisher is still the process that published ``anchor`` (the
        feed's invariant 5). Not bounded here: the caller bounds it (the feed's replay
        deadline answers UNKNOWN at the latest)."""
        if self._replay_sockets is None or self._verdict is not None:
            return Continuity.UNKNOWN  # not running, or another verify is pending
        out = self._feed.verify(anchor, self._clock())
        if out.continuity is not None:
            self._apply(out)
            return out.continuity
        verdict: asyncio.Future[Continuity] = asyncio.get_running_loop().create_future()
        self._verdict = verdict
        try:
            # run() sends the request: its sockets change only while nothing polls them
            self._apply(out)
            self._ask = out.replay_from
            self._wake.set()  # and the feed has a replay deadline now
            return await verdict
        finally:
            self._verdict = None

    async def run(self, stop: asyncio.Event) -> None:
        """Subscribe and follow the stream until ``stop`` is set; closes its sockets."""
        own_context = self._context is None
        context = self._context or zmq.asyncio.Context()
        sub = context.socket(zmq.SUB)
        # Tells when the subscription is on its way: only then is the history asked for.
        replay = self._replay_endpoint is not None
        monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED) if replay else None
        stop_wait = asyncio.ensure_future(stop.wait())
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.MAXMSGSIZE, MAX_PAYLOAD_BYTES + 4096)
            sub.setsockopt(zmq.SUBSCRIBE, self._topic)
            poller = zmq.asyncio.Poller()
            poller.register(sub, zmq.POLLIN)
            if monitor is not None:
                poller.register(monitor, zmq.POLLIN)
            sub.connect(self._endpoint)
            if self._replay_endpoint is not None:
                self._replay_sockets = _ReplaySockets(context, poller, self._replay_endpoint)
            while not stop.is_set():
                if self._ask is not None:
                    start, self._ask = self._ask, None
                    await self._handle(FeedOutput(replay_from=start))
                deadline = self._feed.next_deadline()
                timeout = -1 if deadline is None else max(0, int((deadline - self._clock()) * 1e3))
                self._wake.clear()
                polling = asyncio.ensure_future(poller.poll(timeout))
                wake = asyncio.ensure_future(self._wake.wait())
                done, _ = await asyncio.wait(
                    {polling, stop_wait, wake}, return_when=asyncio.FIRST_COMPLETED
                )
                if not wake.done():
                    wake.cancel()
                if polling not in done:
                    polling.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await polling
                    if stop_wait in done:
                        break
                    await self._handle(self._feed.poll(self._clock()))
                    continue
                ready = dict(polling.result())
                if monitor is not None and monitor in ready and await self._subscribed(monitor):
                    poller.unregister(monitor)
                    sub.disable_monitor()
                    monitor.close(linger=0)
                    monitor = None
                    await self._handle(self._feed.start(self._clock()))
                if sub in ready:
                    await self._drain(sub, replay=False)
                dealer = self._replay_sockets.current if self._replay_sockets else None
                if dealer is not None and dealer in ready:
                    await self._drain(dealer, replay=True)
                await self._handle(self._feed.poll(self._clock()))
        finally:
            self._ask = None
            if self._verdict is not None and not self._verdict.done():
                self._verdict.set_result(Continuity.UNKNOWN)
            stop_wait.cancel()
            if monitor is not None:
                sub.disable_monitor()
                monitor.close(linger=0)
            sub.close(linger=0)
            if self._replay_sockets is not None:
                self._replay_sockets.close()
                self._replay_sockets = None
            if own_context:
                context.term()

    @staticmethod
    async def _subscribed(monitor: zmq.asyncio.Socket) -> bool:
        """Whether the monitor reported the SUB connection's handshake (then the
        subscription has been sent: the history may be asked for)."""
        while True:
            try:
                parts = await monitor.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return False
            if parse_monitor_message(parts)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return True

    async def _drain(self, sock: zmq.asyncio.Socket, *, replay: bool) -> None:
        for _ in range(_MAX_MESSAGES_PER_WAKE):
            if replay and (
                self._replay_sockets is None or sock is not self._replay_sockets.current
            ):
                return  # a new request replaced it: what it still holds is stale
            try:
                parts = await sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            now = self._clock()
            out = self._feed.on_replay(parts, now) if replay else self._feed.on_live(parts, now)
            await self._handle(out)

    async def _handle(self, out: FeedOutput) -> None:
        self._apply(out)
        sockets = self._replay_sockets
        if out.replay_from is not None and sockets is not None:
            await sockets.fresh().send_multipart(encode_replay_request(out.replay_from))

    def _apply(self, out: FeedOutput) -> None:
        for item in out.items:
            self._index.apply(self._engine, item)
        verdict = self._verdict
        if out.continuity is not None and verdict is not None and not verdict.done():
            verdict.set_result(out.continuity)


class _ReplaySockets:
    """The DEALER sockets of one subscriber's replay requests: one per request, the
    previous one closed (with whatever of its answer is still queued) when the next is
    made. Requests are rare (subscribing, a gap, a verify, a stalled answer)."""

    def __init__(self, context: zmq.asyncio.Context, poller: zmq.asyncio.Poller,
                 endpoint: str) -> None:  # fmt: skip
        self._context = context
        self._poller = poller
        self._endpoint = endpoint
        self.current: zmq.asyncio.Socket | None = None  # the latest request's socket

    def fresh(self) -> zmq.asyncio.Socket:
        self.close()
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_PAYLOAD_BYTES + 4096)
        sock.setsockopt(zmq.RCVHWM, REPLAY_RCVHWM)
        sock.connect(self._endpoint)
        self._poller.register(sock, zmq.POLLIN)
        self.current = sock
        return sock

    def close(self) -> None:
        sock, self.current = self.current, None
        if sock is not None:
            self._poller.unregister(sock)
            sock.close(linger=0)
