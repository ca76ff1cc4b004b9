"""Tier invariant 8: when our link to a peer breaks, the peer still hears that the
session ended (on a fresh link), so it stops using it at once.

A vLLM 0.32 peer never reads answers on its own connection and keeps a session until
it is told otherwise: without the goodbye it would send loads into the ended session,
wait out each one (30 s, then 10 s for an abort ack), and take our next ``connect`` for
a duplicate. The peer here is a kvpeer tier, which reacts to a ``disconnect`` the same
way vLLM does: its session ends and its loads fail.
"""

from __future__ import annotations

from kvpeer.protocol import Connect, Disconnect
from tests.node.tierkit import Cluster, TierNode, decoder, keys, prefiller

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
