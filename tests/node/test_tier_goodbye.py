"""Peer table invariants 2 and 3 (``kvpeer.node.peertable``) over a cluster: a
session's end reaches a peer that still reaches us, and refusing a peer does not loop.

Invariant 2: when our link to a peer breaks, the peer still hears that the session
ended (on a fresh link), so it stops using it at once.

A vLLM 0.32 peer never reads answers on its own connection and keeps a session until
it is told otherwise: without the goodbye it would send loads into the ended session,
wait out each one (30 s, then 10 s for an abort ack), and take our next ``connect`` for
a duplicate. The peer here is a kvpeer tier, which reacts to a ``disconnect`` the same
way vLLM does: its session ends and its loads fail.

Invariant 3: vLLM answers a ``disconnect`` on a session it already dropped with a new
session and the same ``connect``. When both sides refuse each other (a fingerprint
mismatch), opening a session for that connect would send our ``connect`` and goodbye
again, and so on, many times a second (seen with real engines). An identical connect
refused within ``handshake_timeout_s`` is refused without a session.
"""

from __future__ import annotations

from kvpeer.protocol import Codec, Connect, Disconnect
from kvpeer.testing.cluster import Cluster, TierNode, decoder, keys, prefiller
from kvpeer.testing.network import MemoryControlLink

KEYS = keys(1, 2, 3)


def break_link(node: TierNode, peer: TierNode) -> None:
    """``node``'s outbound link to ``peer`` breaks; ``peer``'s link to it still works."""
    (link,) = [x for x in node.control.inner.links if x.peer_id == peer.peer_id and not x.closed]
    link.closed = True


def test_a_lost_link_ends_the_session_and_the_peer_hears_it_at_once() -> None:
    cluster = Cluster()
    consumer, producer = cluster.add("a", 1), cluster.add("b", 2)
    producer.plane.auto_complete = False
    producer.store(producer.request("p", decoder("kv1")), KEYS)
    load, _ = consumer.load(consumer.request("c", prefiller("kv1", producer)), KEYS)
    cluster.run()
    assert consumer.outcome(load) is None  # the write is still in flight

    break_link(producer, consumer)
    cluster.run(2)  # no time passes: nothing may wait for a timeout

    (goodbye,) = producer.sent_of(Disconnect, to=consumer)
    assert goodbye.reason == "session ended: control link lost"
    assert consumer.outcome(load) is False
    assert (consumer.stats().sessions, producer.stats().sessions) == (0, 0)


def test_after_the_goodbye_a_new_request_opens_a_fresh_session_that_works() -> None:
    cluster = Cluster()
    consumer, producer = cluster.add("a", 1), cluster.add("b", 2)
    consumer.load(consumer.request("c0", prefiller("kv0", producer)), keys(9))
    cluster.run()
    break_link(producer, consumer)
    cluster.run(2)

    producer.store(producer.request("p", decoder("kv1")), KEYS)
    load, _ = consumer.load(consumer.request("c1", prefiller("kv1", producer)), KEYS)
    cluster.run()

    assert consumer.outcome(load) is True
    assert len(consumer.sent_of(Connect, to=producer)) == 2  # one per session
    assert len(producer.sent_of(Disconnect, to=consumer)) == 1  # said once


def mismatched_pair(cluster: Cluster) -> tuple[TierNode, TierNode]:
    """Two nodes whose config fingerprints differ: each refuses the other's connect."""
    a = cluster.add("a", 1, {"config_fingerprint": "model-x", "handshake_timeout_s": 30})
    b = cluster.add("b", 2, {"config_fingerprint": "model-y", "handshake_timeout_s": 30})
    return a, b


def reconnect(node: TierNode, peer: TierNode) -> MemoryControlLink:
    """What vLLM does after our goodbye: a new connection and the same ``connect``."""
    (hello,) = node.sent_of(Connect, to=peer)
    link = node.control.inner.connect(peer.peer_id)
    assert link.transmit(Codec().encode(hello))
    return link


def test_the_same_refused_connect_is_refused_without_a_session() -> None:
    cluster = Cluster()
    a, b = mismatched_pair(cluster)
    a.load(a.request("c", prefiller("kv1", b)), KEYS)
    cluster.run()
    assert len(b.sent_of(Connect, to=a)) == 1
    refused_before = b.stats().peers_refused

    reconnect(a, b)
    cluster.run(2)

    assert len(b.sent_of(Connect, to=a)) == 1  # no new session, no new connect from b
    assert b.stats().sessions == 0
    assert b.stats().peers_refused == refused_before + 1
    (*_, answer) = b.sent_of(Disconnect, to=a)
    assert answer.reason.endswith("(this connect was refused before)")


def test_a_refused_connect_counts_for_one_handshake_timeout() -> None:
    cluster = Cluster()
    a, b = mismatched_pair(cluster)
    a.load(a.request("c", prefiller("kv1", b)), KEYS)
    cluster.run()

    cluster.advance(30)
    reconnect(a, b)
    cluster.run(2)

    assert len(b.sent_of(Connect, to=a)) == 2  # a session again (and refused again)


def test_a_different_connect_from_the_same_address_opens_a_session() -> None:
    cluster = Cluster()
    a, b = mismatched_pair(cluster)
    a.load(a.request("c", prefiller("kv1", b)), KEYS)
    cluster.run()

    fixed = cluster.restart(a)  # its config fixed: no fingerprint of its own
    b.store(b.request("p", decoder("kv2")), KEYS)
    load, _ = fixed.load(fixed.request("c", prefiller("kv2", b)), KEYS)
    cluster.run()

    assert fixed.outcome(load) is True
