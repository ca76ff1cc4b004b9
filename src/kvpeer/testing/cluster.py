"""A small in-memory cluster of :class:`~kvpeer.node.tier.Tier` nodes driven like engines.

For anyone testing a host or the tier itself: whole nodes over one fake clock, with
every job result checked. It sits above the node layer (it builds tiers), so it is
not re-exported from :mod:`kvpeer.testing`, whose other kits a session-level test
can import without pulling in the node.

:class:`Cluster` owns the fake clock, the :class:`MemoryNetwork` and the data
plane fabric; :meth:`Cluster.add` builds a :class:`TierNode` (config, region,
fake data plane, fake parent, tier). One engine *step* of a node is
``get_finished_jobs`` (store results released through the fake parent),
``serve_external_requests`` and ``on_schedule_end``. Every job result is
checked: it belongs to a job the engine submitted (or one the parent pinned
for a peer) and it arrives exactly once. Control frames each node sends are
recorded decoded, so tests can inspect the wire.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from kvpeer.config import TierConfig
from kvpeer.node.held import HeldBlocks
from kvpeer.node.tier import Tier, TierStatistics
from kvpeer.protocol import Codec, Message, UnknownMessage
from kvpeer.session import PeerSession, StoreFinished
from kvpeer.testing import Fabric, FakeClock, FakeDataPlane, FakeParent, Region
from kvpeer.testing.network import MemoryControl, MemoryControlLink, MemoryNetwork
from kvpeer.transport.base import InboundFrame
from kvpeer.types import (
    JobResult,
    Key,
    LookupResult,
    OffloadPolicy,
    RequestContext,
    TransferJob,
)

M = TypeVar("M", bound=Message)

NUM_BLOCKS = 64
BLOCK_LEN = 64
SLEEP_BUDGET = 100_000  # fake sleeps per test before a wait counts as unbounded


def key(n: int, group: int = 0) -> Key:
    """A block key: a prefix-hash stand-in followed by a 4-byte group index."""
    return f"prefix-hash-{n:04d}".encode() + group.to_bytes(4, "big")


def keys(*numbers: int) -> tuple[Key, ...]:
    return tuple(key(n) for n in numbers)


def decoder(kv_id: str) -> dict[str, object]:
    """``kv_transfer_params`` of a PD producer leg."""
    return {"remote_decoder": {"kv_request_id": kv_id}}


def prefiller(kv_id: str, peer: TierNode) -> dict[str, object]:
    """``kv_transfer_params`` of a PD consumer leg pulling from ``peer``."""
    return {"remote_prefiller": peer.source(kv_id)}


def kv_source(kv_id: str, peer: TierNode) -> dict[str, object]:
    """``kv_transfer_params`` of a symmetric consumer probing ``peer``."""
    return {"remote_kv_source": peer.source(kv_id)}


class RecordingLink:
    """A :class:`MemoryControlLink` that keeps every frame it carried, decoded."""

    def __init__(self, inner: MemoryControlLink, log: list[tuple[str, Message | UnknownMessage]]):
        self._inner = inner
        self._log = log
        self._codec = Codec()

    @property
    def peer_id(self) -> str:
        return self._inner.peer_id

    @property
    def alive(self) -> bool:
        return self._inner.alive

    @property
    def unread(self) -> str | None:
        return self._inner.unread

    def transmit(self, frame: bytes) -> bool:
        accepted = self._inner.transmit(frame)
        if accepted:
            self._log.append((self._inner.peer_id, self._codec.decode(frame)))
        return accepted

    def close(self, *, park: bool = True) -> None:
        self._inner.close(park=park)


class RecordingControl:
    """A node's control endpoint that records what it sends (ControlTransport)."""

    def __init__(self, inner: MemoryControl) -> None:
        self.inner = inner
        self.log: list[tuple[str, Message | UnknownMessage]] = []

    @property
    def local_id(self) -> str:
        return self.inner.local_id

    def connect(self, peer_id: str) -> RecordingLink:
        return RecordingLink(self.inner.connect(peer_id), self.log)

    def receive(self) -> list[InboundFrame]:
        return self.inner.receive()

    def flush(self) -> None:
        self.inner.flush()

    def refuse(self, peer_id: str, frame: bytes) -> None:
        self.log.append((peer_id, Codec().decode(frame)))
        self.inner.refuse(peer_id, frame)

    def next_deadline(self) -> float | None:
        return self.inner.next_deadline()

    def close(self) -> None:
        self.inner.close()


@dataclass
class TierNode:
    """One engine: its tier and everything the test observed of it."""

    config: TierConfig
    region: Region
    plane: FakeDataPlane
    parent: FakeParent
    control: RecordingControl
    tier: Tier
    job_ids: itertools.count[int]
    submitted: set[int] = field(default_factory=set)
    results: dict[int, bool] = field(default_factory=dict)
    reports: dict[int, JobResult] = field(default_factory=dict)  # the whole report
    _next_load_slot: int = 0

    @property
    def peer_id(self) -> str:
        return self.config.peer_id

    def source(self, kv_id: str) -> dict[str, object]:
        """The role dict a consumer uses to name this node as its source."""
        return {
            "kv_request_id": kv_id,
            "remote_host": self.config.host,
            "remote_port": self.config.port,
        }

    # -- the engine's calls --------------------------------------------------------

    def start(
        self, req_id: str, params: Mapping[str, object] | None = None
    ) -> tuple[RequestContext, OffloadPolicy]:
        ctx = RequestContext(req_id, params)
        return ctx, self.tier.on_new_request(ctx)

    def request(self, req_id: str, params: Mapping[str, object] | None = None) -> RequestContext:
        return self.start(req_id, params)[0]

    def lookup(self, ctx: RequestContext, *wanted: Key) -> list[LookupResult]:
        return [self.tier.lookup(k, ctx) for k in wanted]

    def store(self, ctx: RequestContext, wanted: Sequence[Key]) -> int:
        """Put ``wanted`` into the primary, pin them and submit them as one store."""
        for k in wanted:
            self.parent.put(k)
        job = self.parent.store_job(wanted)
        self.submitted.add(job.job_id)
        self.tier.submit_store(TransferJob(job.job_id, job.keys, job.slots, ctx))
        return job.job_id

    def load(
        self, ctx: RequestContext, wanted: Sequence[Key], slots: Sequence[int] | None = None
    ) -> tuple[int, tuple[int, ...]]:
        """Submit a load of ``wanted`` into fresh (or the given) slots."""
        dest = tuple(slots) if slots is not None else self.load_slots(len(wanted))
        job_id = next(self.job_ids)
        self.submitted.add(job_id)
        self.tier.submit_load(TransferJob(job_id, tuple(wanted), dest, ctx))
        return job_id, dest

    def load_slots(self, count: int) -> tuple[int, ...]:
        """Slots from the top half of the region (the parent fills from slot 0 up)."""
        half = self.region.num_blocks // 2
        slots = []
        for _ in range(count):
            slots.append(self.region.num_blocks - 1 - self._next_load_slot % half)
            self._next_load_slot += 1
        return tuple(slots)

    def finish(self, ctx: RequestContext) -> None:
        self.tier.on_request_finished(ctx)

    def step(self) -> list[JobResult]:
        """One engine step; returns the job results it reported."""
        finished = self.tier.get_finished_jobs()
        self.record(finished)
        self.tier.serve_external_requests(self.parent)
        self.tier.on_schedule_end()
        return finished

    def record(self, finished: Sequence[JobResult]) -> None:
        for result in finished:
            job_id = result.job_id
            assert job_id not in self.results, f"{self.peer_id}: job {job_id} reported twice"
            serve_pin = job_id in self.parent.open_jobs and job_id not in self.submitted
            assert job_id in self.submitted or serve_pin, f"{self.peer_id}: unknown job {job_id}"
            self.results[job_id] = result.success
            self.reports[job_id] = result
            if job_id in self.parent.open_jobs:
                self.parent.job_finished(StoreFinished(job_id, result.success))

    # -- observations ------------------------------------------------------------------

    def outcome(self, job_id: int) -> bool | None:
        """The job's result, or None while it is still pending."""
        return self.results.get(job_id)

    def unreported(self) -> set[int]:
        return self.submitted - set(self.results)

    def stats(self) -> TierStatistics:
        return self.tier.statistics()

    def session(self, peer: TierNode) -> PeerSession:
        session = self.tier.session(peer.peer_id)
        assert session is not None, f"{self.peer_id} has no session toward {peer.peer_id}"
        return session

    def sent(self, to: TierNode | None = None) -> list[Message | UnknownMessage]:
        return [m for peer, m in self.control.log if to is None or peer == to.peer_id]

    def sent_of(self, kind: type[M], to: TierNode | None = None) -> list[M]:
        return [m for m in self.sent(to) if isinstance(m, kind)]

    def block(self, slot: int) -> bytes:
        return self.region.block(slot)


class Cluster:
    """Tier nodes on one in-memory control network and data fabric."""

    def __init__(self, clock: FakeClock | None = None) -> None:
        self.clock = clock or FakeClock()
        self.net = MemoryNetwork(self.clock)
        self.fabric = Fabric()
        self.job_ids = itertools.count(1)
        self.nodes: dict[str, TierNode] = {}
        self.sleeps = 0

    def add(
        self,
        host: str,
        port: int,
        config: Mapping[str, object] | None = None,
        *,
        auto_complete: bool = True,
        fake_sleep: bool = False,
    ) -> TierNode:
        """A new engine at ``host:port``; ``config`` holds extra TierConfig keys.

        With ``fake_sleep`` the tier's sleep advances the fake clock (drain_jobs).
        """
        cfg = TierConfig.from_dict({"host": host, "port": port, **(config or {})})
        region = Region(NUM_BLOCKS, BLOCK_LEN)
        plane = FakeDataPlane(self.fabric, cfg.peer_id, region, auto_complete=auto_complete)
        parent = FakeParent(region, self.job_ids)
        control = RecordingControl(self.net.attach(cfg.peer_id))
        held = None
        # The kit's nodes hold blocks only when asked (held_bytes given): its tests of the
        # serve-window way need nodes that hold nothing, as held_bytes 0 does.
        if cfg.held_bytes is not None and cfg.held_bytes >= BLOCK_LEN:  # fake plane: every peer
            held = HeldBlocks(memoryview(region.memory), NUM_BLOCKS, BLOCK_LEN, cfg.held_bytes,
                              serves=lambda peer_id: True)  # fmt: skip
            plane.held = held.view
        tier = Tier(
            cfg, control, plane, clock=self.clock, sleep=self._sleep if fake_sleep else None,
            held=held,
        )  # fmt: skip
        node = TierNode(cfg, region, plane, parent, control, tier, self.job_ids)
        self.nodes[cfg.peer_id] = node
        return node

    def _sleep(self, seconds: float) -> None:
        self.sleeps += 1
        assert self.sleeps <= SLEEP_BUDGET, "the tier keeps sleeping: an unbounded wait"
        self.clock.advance(seconds)

    def kill(self, node: TierNode) -> None:
        """The node vanishes: it takes no more steps and its links die."""
        self.net.kill(node.peer_id)
        del self.nodes[node.peer_id]

    def restart(self, node: TierNode) -> TierNode:
        """Kill ``node`` and bring up a new engine (new boot id) at the same address."""
        self.kill(node)
        return self.add(node.config.host, node.config.port)

    def step(self, rounds: int = 1) -> None:
        """Step every live node ``rounds`` times, in the order they were added."""
        for _ in range(rounds):
            for node in list(self.nodes.values()):
                node.step()

    def run(self, rounds: int = 8) -> None:
        """Enough steps for handshakes and a lookup or fetch round trip to settle."""
        self.step(rounds)

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` pass for live nodes: at every tier deadline before the end
        each node steps twice (a live node's driver answers pings meanwhile, so a
        waiting request is not given up for silence), then the clock moves to the
        end; what is due there is left to the caller's next step."""
        end = self.clock.now + seconds
        for _ in range(10_000):
            due = [
                d
                for node in self.nodes.values()
                if (d := node.tier.next_deadline()) is not None and self.clock.now < d < end
            ]
            if not due:
                break
            self.clock.advance(min(due) - self.clock.now)
            self.step(2)
        else:
            raise AssertionError("a tier keeps a deadline in the past")
        self.clock.advance(end - self.clock.now)
