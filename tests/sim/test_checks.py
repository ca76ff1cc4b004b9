"""The simulation's rule on consumer session entries against what a real tier holds.

Seeds 18006 and 20991 of the 100k run (commit 562720b) reported "2 consumer session
entries but only 1 ids are open or finished within the abort_ack timeouts" on a node
without any fault: a request pulling id ``kv8`` from peer n1 finished with its load
aborted, so the session toward n1 kept ``kv8``'s entry for the ack owed (consumer
invariant 8); the router then reused ``kv8`` for a request pulling from n0, whose
session opened its own entry. Two sessions, one entry each, both within their
timeouts: the rule counted entries over all sessions against distinct ids. It now
counts per session (:func:`~kvpeer.lab.sim.checks.unexplained_consumer_entries`).
"""

from __future__ import annotations

from kvpeer.lab.sim.checks import unexplained_consumer_entries
from kvpeer.testing.cluster import Cluster, TierNode, decoder, keys, prefiller

KEYS = keys(1, 2, 3)
ABORT_ACK_S = 1.0


def entries(node: TierNode, *peers: TierNode) -> dict[str, int]:
    """Consumer entries of ``node``'s session toward each of ``peers``."""
    return {p.peer_id: node.session(p).statistics().consumer.requests for p in peers}


def test_an_id_reused_toward_another_peer_while_an_ack_is_owed() -> None:
    cluster = Cluster()
    config = {"abort_ack_timeout_s": ABORT_ACK_S}
    c = cluster.add("c", 5710, config)
    n1 = cluster.add("n1", 5710, config)
    n0 = cluster.add("n0", 5710, config)

    # First use of kv8: a decode leg on c pulling from n1, whose prefill never
    # stored; the fetch waits there until the request finishes and aborts it.
    first = c.request("con1", prefiller("kv8", n1))
    first_job, _ = c.load(first, KEYS)
    cluster.run()
    assert c.outcome(first_job) is None
    c.finish(first)
    cluster.run()
    assert c.outcome(first_job) is False
    finished_at = cluster.clock.now

    # kv8 reused (every request that used it finished) for a pull from n0.
    prefill = n0.request("pro2", decoder("kv8"))
    n0.store(prefill, KEYS)
    second = c.request("con2", prefiller("kv8", n0))
    second_job, _ = c.load(second, KEYS)
    cluster.run()
    assert c.outcome(second_job) is True

    # One id open, two sessions holding an entry for it: n1's for the owed ack.
    assert c.stats().consumer_ids == 1
    assert entries(c, n1, n0) == {n1.peer_id: 1, n0.peer_id: 1}
    assert cluster.clock.now - finished_at < ABORT_ACK_S
    pulling = {(n0.peer_id, "kv8")}
    recently_finished = {(n1.peer_id, "kv8")}
    assert unexplained_consumer_entries(entries(c, n1, n0), pulling | recently_finished) == []
    # The rule is per session: kv8's entry toward n1 is explained only by a request
    # that pulled kv8 from n1, not by the open request pulling it from n0.
    assert unexplained_consumer_entries(entries(c, n1, n0), pulling) == [
        f"1 consumer session entries toward {n1.peer_id} but only 0 ids pulled from it "
        "are open or finished within the abort_ack timeouts"
    ]

    # The entry toward n1 lives no longer than the ack's timeout after its load
    # settled (the bound the simulation allows: two abort_ack timeouts after finish).
    cluster.advance(ABORT_ACK_S)
    cluster.step(2)
    assert entries(c, n1, n0) == {n1.peer_id: 0, n0.peer_id: 1}
    assert unexplained_consumer_entries(entries(c, n1, n0), pulling) == []
    c.finish(second)
    cluster.run()
    assert entries(c, n1, n0) == {n1.peer_id: 0, n0.peer_id: 0}
    assert c.unreported() == set()
