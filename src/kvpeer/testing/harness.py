"""Two coupled sessions over an in-memory link, for behaviour tests.

:class:`SessionPair` wires node ``a`` and node ``b`` (each with a region, a
fake data plane, a fake parent and a :class:`PeerSession` toward the other)
through a :class:`MemoryLink`. Tests drive time and delivery explicitly.
Every result is recorded per node and checked for exactly-once reporting.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from kvpeer.protocol import (
    PROTOCOL_VERSION,
    Connect,
    ConnectExtension,
    Message,
    TransportOffer,
    UnknownMessage,
)
from kvpeer.session.peer import Admit, PeerSession
from kvpeer.session.ports import EngineSteps
from kvpeer.session.results import LoadFinished, PollResult, SessionClosed, StoreFinished
from kvpeer.session.settings import SessionSettings
from kvpeer.testing.clock import FakeClock
from kvpeer.testing.dataplane import Fabric, FakeDataPlane, Region
from kvpeer.testing.expect import record_once
from kvpeer.testing.link import LinkEnd, MemoryLink
from kvpeer.testing.parent import FakeParent

__all__ = ["Node", "SessionPair", "make_hello"]


class Shape(Protocol):
    """What a ``connect`` says of a region: how many rows, of how many bytes."""

    @property
    def num_blocks(self) -> int: ...

    @property
    def block_len(self) -> int: ...


def make_hello(
    peer_id: str,
    region: Shape | None = None,
    *,
    num_blocks: int = 64,
    block_len: int = 64,
    hash_seed: str = "vllm-none-hash",
    fingerprint: str | None = "",
    base_addr: int = 0,
    agent_metadata: bytes = b"",
    kvpeer: bool | tuple[int, int] = True,
    boot_id: bytes | None = None,
    transports: Mapping[str, TransportOffer] | None = None,
    session: int | None = None,
) -> Connect:
    """A ``connect`` as a node would send it, describing ``region`` (without one:
    ``num_blocks`` rows of ``block_len`` bytes at ``base_addr``). ``kvpeer``: with
    kvpeer's extension, of this protocol version (True) or of the one given (``boot_id``,
    random by default; the data planes offered in ``transports``; ``session``, its
    session number, as a kvpeer node of this version sends it); False: as vLLM sends it.
    The tests' one builder of a ``connect``."""
    if region is not None:
        num_blocks, block_len = region.num_blocks, region.block_len
    extension = None
    if kvpeer is not False:
        extension = ConnectExtension(
            version=PROTOCOL_VERSION if kvpeer is True else kvpeer,
            boot_id=boot_id or os.urandom(16),
            transports=dict(transports or {}),
            session=session,
        )
    return Connect(
        peer_id=peer_id,
        agent_metadata=agent_metadata,
        base_addr=base_addr,
        num_blocks=num_blocks,
        block_len=block_len,
        hash_seed=hash_seed,
        config_fingerprint=fingerprint,
        kvpeer=extension,
    )


@dataclass
class Node:
    """One side of a pair and everything it observed."""

    node_id: str
    region: Region
    plane: FakeDataPlane
    parent: FakeParent
    session: PeerSession
    outbox: LinkEnd
    loads: dict[int, LoadFinished] = field(default_factory=dict)
    stores: dict[int, StoreFinished] = field(default_factory=dict)
    fetched_ids: list[str] = field(default_factory=list)
    expired_probe_ids: list[str] = field(default_factory=list)
    closed: SessionClosed | None = None

    def record(self, result: PollResult) -> PollResult:
        loads = list(result.loads)
        stores = list(result.stores)
        if result.closed is not None:
            assert self.closed is None, "session closed twice"
            self.closed = result.closed
            loads.extend(result.closed.loads)
            stores.extend(result.closed.stores)
            for serve in result.closed.unreleased_serves:
                self.parent.on_request_finished(serve)
        for load in loads:
            record_once(self.loads, load.job_id, load, "load job")
        for store in stores:
            record_once(self.stores, store.job_id, store, "store job")
            self.parent.job_finished(store)
        self.fetched_ids.extend(result.fetched_ids)
        self.expired_probe_ids.extend(result.expired_probe_ids)
        return result

    def sent(self) -> list[Message | UnknownMessage]:
        """Every message this node put on the wire, decoded."""
        return self.outbox.messages()

    def sent_of(self, kind: type[Message]) -> list[Message]:
        return [m for m in self.sent() if isinstance(m, kind)]


class SessionPair:
    """Nodes ``a`` and ``b`` with one session each toward the other."""

    def __init__(
        self,
        *,
        clock: FakeClock | None = None,
        settings: SessionSettings | None = None,
        num_blocks: int = 64,
        block_len: int = 64,
        auto_complete: bool = False,
        enforce_windows: bool = False,
        hello_a: Callable[[Region], Connect] | None = None,
        hello_b: Callable[[Region], Connect] | None = None,
        admit_a: Admit | None = None,
        admit_b: Admit | None = None,
        engine_b: EngineSteps | None = None,
        start: bool = True,
    ) -> None:
        """``engine_b``: when ``b``'s lookups stop waiting for its engine (producer
        invariant 10); None: they wait for a serve window."""
        self.clock = clock or FakeClock()
        self.settings = settings or SessionSettings()
        self.fabric = Fabric()
        self.link = MemoryLink("a", "b")
        job_ids = itertools.count(1)
        self.a = self._node(
            "a",
            "b",
            self.link.a_to_b,
            num_blocks,
            block_len,
            auto_complete,
            hello_a,
            admit_a,
            job_ids,
        )
        self.b = self._node(
            "b",
            "a",
            self.link.b_to_a,
            num_blocks,
            block_len,
            auto_complete,
            hello_b,
            admit_b,
            job_ids,
            engine_b,
        )
        self.job_ids = job_ids
        self.a.plane.enforce_windows = enforce_windows
        self.b.plane.enforce_windows = enforce_windows
        if start:
            self.a.session.start(self.clock.now)
            self.b.session.start(self.clock.now)
            self.pump()

    def _node(
        self,
        node_id: str,
        peer_id: str,
        outbox: LinkEnd,
        num_blocks: int,
        block_len: int,
        auto_complete: bool,
        hello: Callable[[Region], Connect] | None,
        admit: Admit | None,
        job_ids: itertools.count[int],
        engine: EngineSteps | None = None,
    ) -> Node:
        region = Region(num_blocks, block_len)
        plane = FakeDataPlane(self.fabric, node_id, region, auto_complete=auto_complete)
        parent = FakeParent(region, job_ids)
        connect = hello(region) if hello is not None else make_hello(node_id, region)
        session = PeerSession(
            peer_id,
            connect,
            plane,
            outbox.transmit,
            self.settings,
            admit=admit,
            engine=engine,
            unread=lambda: outbox.unread,
        )
        return Node(node_id, region, plane, parent, session, outbox)

    def next_job_id(self) -> int:
        return next(self.job_ids)

    def deliver(self, limit: int | None = None) -> int:
        """Deliver frames in transit, in order, alternating directions."""
        delivered = 0
        pipes = ((self.link.a_to_b, self.b), (self.link.b_to_a, self.a))
        while any(pipe.in_transit for pipe, _ in pipes):
            for pipe, receiver in pipes:
                if pipe.in_transit and (limit is None or delivered < limit):
                    receiver.session.receive(pipe.in_transit.popleft(), self.clock.now)
                    delivered += 1
            if limit is not None and delivered >= limit:
                break
        return delivered

    def poll(self) -> None:
        """Poll both sessions at the current time and record the results."""
        self.a.record(self.a.session.poll(self.clock.now))
        self.b.record(self.b.session.poll(self.clock.now))

    def pump(self, rounds: int = 50) -> None:
        """Deliver and poll until nothing moves (completions included)."""
        for _ in range(rounds):
            moved = self.deliver()
            self.poll()
            if not moved and not self.link.a_to_b.in_transit and not self.link.b_to_a.in_transit:
                return
        raise AssertionError("pair did not settle")

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` pass for two live nodes: at every session deadline
        before the end, poll and deliver (so pings are answered, as a live
        peer's node does without its engine), then move the clock to the end.
        What is due at the end is left to the caller's next poll or pump."""
        end = self.clock.now + seconds
        for _ in range(10_000):
            due = [
                d
                for d in (self.a.session.next_deadline(), self.b.session.next_deadline())
                if d is not None and self.clock.now < d < end
            ]
            if not due:
                break
            self.clock.advance(min(due) - self.clock.now)
            self.poll()
            self.deliver()
        else:
            raise AssertionError("a session keeps a deadline in the past")
        self.clock.advance(end - self.clock.now)

    def serve(self) -> None:
        """Open a serve window on both sides."""
        self.a.session.serve(self.a.parent, self.clock.now)
        self.b.session.serve(self.b.parent, self.clock.now)
