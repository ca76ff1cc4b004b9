"""Tier, grants: a node grants a peer id exactly while it holds a session with it.

The data plane hands things out on proof of identity (the shm plane: our region's
descriptor) only to granted peers, so the grant must be in place before our connect
(with our offers) reaches the peer, and gone once the session ended.
"""

from __future__ import annotations

from kvpeer.protocol import Connect
from kvpeer.testing.cluster import Cluster, keys, prefiller


def test_a_session_grants_its_peer_before_our_connect_leaves() -> None:
    cluster = Cluster()
    a, b = cluster.add("a", 1), cluster.add("b", 2)
    connects_sent_at_grant: list[int] = []
    grant = a.plane.grant

    def counting_grant(peer_id: str) -> None:
        connects_sent_at_grant.append(len(a.sent_of(Connect, to=b)))
        grant(peer_id)

    a.plane.grant = counting_grant  # type: ignore[method-assign]
    b.request("p", {"remote_decoder": {"kv_request_id": "kv1"}})
    a.load(a.request("c", prefiller("kv1", b)), keys(1))
    cluster.run()

    assert connects_sent_at_grant == [0]
    assert len(a.sent_of(Connect, to=b)) == 1
    assert a.plane.granted == {b.peer_id}
    assert b.plane.granted == {a.peer_id}  # the side that accepted grants too


def test_the_grant_ends_with_the_session() -> None:
    cluster = Cluster()
    a, b = cluster.add("a", 1), cluster.add("b", 2)
    b.request("p", {"remote_decoder": {"kv_request_id": "kv1"}})
    a.load(a.request("c", prefiller("kv1", b)), keys(1))
    cluster.run()
    assert a.plane.granted == {b.peer_id}

    cluster.kill(b)
    a.step()

    assert a.stats().sessions == 0
    assert a.plane.granted == set()
