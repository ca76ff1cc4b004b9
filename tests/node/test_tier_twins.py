"""Twins (two requests on one node pulling the same id from the same peer, as in
parallel sampling) toward a peer that never answers.

Seed 21361 of the 100k run (commit 562720b): request ``sym68`` on n0 and its twin
``twin69`` probed kv67 at n1, cut off (nothing n0 sent reached n1, nothing came
back). The twin finished 1.1 s later; the tier finishes the id's consumer state
on any request's finish, so sym68's waiting probes went too, nobody waited on n1
any more and the session was no longer given up ``peer_wait_s`` after it started
(only its handshake deadline was left). sym68 meanwhile waited on two blocks of
its own primary that another request's load was writing (4.7 s, until that load
timed out), then asked the tier again 6.24 s after its first RETRY: its probe
landed on the session silent since it started and was answered RETRY once more
(the session was ended at the same tick's poll, after the answer). The checker
counts the RETRY streak from the first answer: 6.24 s against a 2.88 s budget.
Pings do not change this (the peer was never heard from). The tier now finishes
an id's consumer state only when the last request pulling it from that peer
finishes (kvpeer.node.tier invariant 3).
"""

from __future__ import annotations

from kvpeer.protocol import AbortFetch, Fetch
from kvpeer.testing.cluster import Cluster, decoder, keys, prefiller
from kvpeer.types import LookupResult

HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY
KEYS = keys(1, 2, 3)
PEER_WAIT_S = 2.0


def ghost(kv_id: str) -> dict[str, object]:
    """A ``remote_kv_source`` naming a peer nobody runs (its frames are dropped)."""
    return {"remote_kv_source": {"kv_request_id": kv_id, "remote_host": "b", "remote_port": 2}}


def test_a_probe_on_a_session_silent_past_peer_wait_s_is_not_answered_retry() -> None:
    cluster = Cluster()
    a = cluster.add("a", 1, {"peer_wait_s": PEER_WAIT_S})
    first = a.request("sym68", ghost("kv67"))
    twin = a.request("twin69", ghost("kv67"))
    assert a.lookup(first, *KEYS) == [RETRY] * 3
    assert a.lookup(twin, *KEYS) == [RETRY] * 3
    cluster.run(3)
    a.finish(twin)
    cluster.run(3)
    # sym68 does not ask the tier meanwhile (its engine waits on its own primary).
    cluster.advance(3 * PEER_WAIT_S)
    cluster.step()
    assert a.lookup(first, *KEYS) == [MISS] * 3


def test_a_twins_finish_does_not_abort_its_siblings_load() -> None:
    cluster = Cluster()
    a = cluster.add("a", 1)
    b = cluster.add("b", 2, auto_complete=False)
    b.store(b.request("pro", decoder("kv1")), KEYS)
    sibling = a.request("con1", prefiller("kv1", b))
    twin = a.request("twin2", prefiller("kv1", b))
    job, slots = a.load(sibling, KEYS)
    cluster.run()
    assert a.sent_of(Fetch, to=b)
    assert a.outcome(job) is None  # b's write is under way
    a.finish(twin)  # its own loads (none) are done: the engine finishes it
    cluster.run()
    assert a.sent_of(AbortFetch, to=b) == []
    b.plane.complete_all()
    cluster.run()
    assert a.outcome(job) is True
    assert [a.block(slot) for slot in slots] == [b.parent.expected(k) for k in KEYS]
    a.finish(sibling)
    cluster.run()
    assert a.session(b).statistics().consumer.requests == 0
    assert a.unreported() == set()
