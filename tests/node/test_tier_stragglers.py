"""Tier, stragglers: frames of an ended session that land in the next one.

Control frames carry no session identity (vLLM's do not), so a frame the peer
sent in a session that has since ended can arrive after a new session toward
the same peer opened: the old incarnation of a restarted peer answered a
lookup just before it died, or the peer's goodbye crossed the connect of our
next session. Such a frame ending the new session sustained itself (the
simulation's seed 9794 on 562720b): the ending's goodbye crossed the next
connect, whose frames again landed in a session that had just ended, and the
two nodes ended each other's sessions every second or two for as long as both
had requests. Pins ``kvpeer.session.peer`` invariant 7: a pair converges once
the stale frames have arrived.
"""

from __future__ import annotations

import itertools

from kvpeer.protocol import Codec, LookupResponse
from kvpeer.testing.cluster import Cluster, TierNode, key, kv_source
from kvpeer.testing.network import MemoryNetwork
from kvpeer.transport.base import InboundFrame
from kvpeer.types import LookupResult, RequestContext

HIT, RETRY = LookupResult.HIT, LookupResult.RETRY
CODEC = Codec()
LATENCY_S = 0.2  # one way, every frame (nothing reorders on a link)
TICK_S = 0.05


class Prober:
    """A node that always has a symmetric request probing its peer, one after another."""

    def __init__(self, node: TierNode, peer: TierNode, wanted: int) -> None:
        self.node, self.peer, self.key = node, peer, key(wanted)
        self.ids = itertools.count()
        self.ctx: RequestContext | None = None
        self.hits = 0

    def tick(self) -> None:
        if self.ctx is None:
            n = next(self.ids)
            self.ctx = self.node.request(f"r{n}", kv_source(f"{self.node.peer_id}-{n}", self.peer))
        (answer,) = self.node.lookup(self.ctx, self.key)
        if answer is RETRY:
            return
        self.hits += answer is HIT
        self.node.finish(self.ctx)
        self.ctx = None


def ended(node: TierNode) -> int:
    return sum(node.stats().sessions_ended.values())


def latency_cluster() -> Cluster:
    cluster = Cluster()
    cluster.net = MemoryNetwork(cluster.clock, lambda sender, receiver: LATENCY_S)
    return cluster


def run(cluster: Cluster, probers: list[Prober], seconds: float) -> None:
    for _ in range(round(seconds / TICK_S)):
        for prober in probers:
            prober.tick()
        cluster.step()
        cluster.clock.advance(TICK_S)


def inject(node: TierNode, sender: TierNode, frame: bytes, now: float) -> None:
    """``frame`` from ``sender`` lands in ``node``'s inbox now (it was in flight)."""
    inbox = node.control.inner.inbox  # the in-memory network's delivery queue
    inbox.append((now, -1, InboundFrame(sender.peer_id, frame)))


def probing_pair() -> tuple[Cluster, TierNode, TierNode, list[Prober]]:
    """Nodes ``a`` and ``b``, each holding one key the other keeps probing, 2 s in."""
    cluster = latency_cluster()
    a, b = cluster.add("a", 1), cluster.add("b", 2)
    a.parent.put(key(1))
    b.parent.put(key(2))
    probers = [Prober(a, b, 2), Prober(b, a, 1)]
    run(cluster, probers, 2.0)
    return cluster, a, b, probers


class TestStaleFramesOfAnEndedSession:
    def test_a_restarted_peers_last_answer_does_not_start_a_loop(self) -> None:
        """The finding, as a cluster: the old incarnation of ``a`` answered ``b``'s lookup
        and died at once; ``b`` opened a new session toward the new ``a`` and the old
        answer landed in it. Both keep probing each other: after a few round trips the
        sessions stay up and every probe is answered HIT."""
        cluster, a, b, probers = probing_pair()
        assert probers[0].hits > 0, "setup: the pair works"
        assert probers[1].hits > 0, "setup: the pair works"
        (last_answer, *_) = reversed(a.sent_of(LookupResponse, to=b))
        a = cluster.restart(a)
        a.parent.put(key(1))
        probers = [Prober(a, b, 2), Prober(b, a, 1)]
        for _ in range(10):  # b's link to the old a died; its next probe dials the new a
            run(cluster, probers, TICK_S)
            if b.tier.session(a.peer_id) is not None:
                break
        assert b.session(a).peer_hello is None, "setup: the new a's connect is on its way"
        session = b.session(a)
        inject(b, a, CODEC.encode(last_answer), cluster.clock.now)
        run(cluster, probers, 2.0)  # a few round trips
        settled = (ended(a), ended(b), probers[0].hits, probers[1].hits)
        run(cluster, probers, 10.0)
        assert (ended(a), ended(b)) == settled[:2], "sessions still end each other"
        assert probers[0].hits > settled[2] + 10
        assert probers[1].hits > settled[3] + 10
        assert b.session(a) is session, "the session the old answer landed in lived on"
        # the old answer and any other straggler (the new a's first session was ended by
        # b's goodbye to the old a, which it took for its own): dropped and counted
        assert session.statistics().stale_frames >= 1

    def test_a_goodbye_crossing_traffic_does_not_start_a_loop(self) -> None:
        """A session ends while both sides have frames in flight (here: one garbage frame
        makes ``a`` end it with a goodbye). ``a``'s next probe opens a new session at
        once, and ``b``'s frames of the old session land in it; ``b``'s next session's
        connect crosses ``a``'s. One ending, then the pair stays up."""
        cluster, a, b, probers = probing_pair()
        assert (ended(a), ended(b)) == (0, 0), "setup: the pair works"
        inject(a, b, b"\xc1 not msgpack", cluster.clock.now)
        run(cluster, probers, 2.0)
        assert a.stats().sessions_ended == {"protocol_error": 1}
        settled = (ended(a), ended(b), probers[0].hits, probers[1].hits)
        run(cluster, probers, 10.0)
        assert (ended(a), ended(b)) == settled[:2], "sessions still end each other"
        assert probers[0].hits > settled[2] + 10
        assert probers[1].hits > settled[3] + 10
