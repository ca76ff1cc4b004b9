"""Tier, renewal: a peer's next session meets our half-open one (simulation seed 1614).

With the twin fix (tier invariant 3) applied, CI's seed 1614 drew this world: a
partition cut n0 and n1 both ways for 1.1 s. n1 had a request waiting on n0, so
its session gave n0 up after ``peer_wait_s`` and said goodbye - on its link and
on a fresh one - but both goodbyes were held by the cut and dropped when n1
closed those links. n0 had nothing waiting on n1 and its link outlived the cut:
its session stayed ready, half-open. 6.6 s later n1 needed n0 again and opened
its next session: the same ``connect`` (same boot id) reached n0's old session,
which took it for a duplicate - a protocol error, whose goodbye ended n1's new
session too - and n0's PD request ``con225``, registered a moment before, was
turned away (MISS) on a path that had been healthy for 7.8 s.

Pins ``kvpeer.session.peer`` invariant 3 and tier invariant 4: a kvpeer peer's
``connect`` with the same boot id after it acknowledged ours is its next session
(``RENEWED``): the old one ends without a goodbye, a fresh one takes the frame,
and a request that had not yet used the old session is served by the fresh one.
"""

from __future__ import annotations

from kvpeer.protocol import Codec, Connect, ConnectAck, Disconnect
from kvpeer.session import CloseKind
from kvpeer.testing.cluster import Cluster, TierNode, decoder, key, keys, prefiller
from kvpeer.transport.base import InboundFrame
from kvpeer.types import LookupResult
from tests.node.test_tier_stragglers import (
    LATENCY_S,
    TICK_S,
    Prober,
    ended,
    inject,
    probing_pair,
    run,
)

HIT = LookupResult.HIT
CODEC = Codec()
KEYS_A = keys(1, 2)  # a produces these for b
KEYS_B = keys(3, 4, 5)  # b produces these for a


def lose_goodbyes(node: TierNode, sender: TierNode) -> int:
    """Drop every ``disconnect`` from ``sender`` waiting in ``node``'s inbox (a cut ate
    them); how many."""
    inbox = node.control.inner.inbox
    kept = [item for item in inbox if not _is_goodbye(item[2].frame, item[2].peer_id, sender)]
    lost = len(inbox) - len(kept)
    inbox.clear()
    inbox.extend(kept)
    return lost


def _is_goodbye(frame: bytes, peer_id: str, sender: TierNode) -> bool:
    return peer_id == sender.peer_id and isinstance(CODEC.decode(frame), Disconnect)


def half_open_pair() -> tuple[Cluster, TierNode, TierNode]:
    """``a`` and ``b`` pulled from each other; then ``b`` gave ``a`` up and its goodbyes
    were lost: ``a`` still holds a ready session that ``b`` forgot."""
    cluster = Cluster()
    a, b = cluster.add("a", 1), cluster.add("b", 2)
    b.store(b.request("pro-kv0", decoder("kv0")), KEYS_B)
    warm = a.request("con-kv0", prefiller("kv0", b))
    job, _ = a.load(warm, KEYS_B)
    cluster.run()
    assert a.outcome(job) is True, "setup: a pulls from b"
    a.finish(warm)
    cluster.run()
    b.session(a).close("nothing heard from the peer (pinged)", CloseKind.UNREACHABLE)
    b.step()  # reaped: a goodbye on the link and one on a fresh link
    assert lose_goodbyes(a, b) == 2, "setup: b said goodbye twice"
    assert b.tier.session(a.peer_id) is None
    assert a.session(b).ready, "setup: a's side is half-open"
    return cluster, a, b


def test_a_peers_next_session_renews_our_half_open_one() -> None:
    cluster, a, b = half_open_pair()
    old = a.session(b)
    # a's PD request naming b is registered (on the old session's peer entry)...
    a.store(a.request("pro-kv7", decoder("kv7")), KEYS_A)
    b.store(b.request("pro-kv9", decoder("kv9")), KEYS_B)
    con9 = a.request("con-kv9", prefiller("kv9", b))
    # ...when b needs a again: its next session's connect (same boot id) goes out.
    con7 = b.request("con-kv7", prefiller("kv7", a))
    assert b.lookup(con7, *KEYS_A) == [HIT] * 2
    job7, slots7 = b.load(con7, KEYS_A)
    cluster.run()
    connects = b.sent_of(Connect, to=a)
    assert len(connects) == 2, "b's next session greets a"
    first, second = (c.kvpeer for c in connects)
    assert first is not None
    assert second is not None
    assert first.boot_id == second.boot_id, "the same process"
    assert first.session is not None
    assert second.session is not None
    assert second.session > first.session, "its next session"
    assert not old.alive
    assert a.stats().sessions_ended == {"renewed": 1}
    assert a.sent_of(Disconnect, to=b) == [], "a renewal says no goodbye"
    assert b.stats().sessions_ended == {"unreachable": 1}, "b's next session lives"
    assert a.session(b).ready
    assert b.session(a).ready
    assert b.outcome(job7) is True
    assert [b.block(s) for s in slots7] == [a.parent.expected(k) for k in KEYS_A]
    # a's request had not used the old session: the fresh one serves it.
    assert a.lookup(con9, *KEYS_B) == [HIT] * 3
    job9, slots9 = a.load(con9, KEYS_B)
    cluster.run()
    assert a.outcome(job9) is True
    assert [a.block(s) for s in slots9] == [b.parent.expected(k) for k in KEYS_B]
    for node, ctx in ((a, con9), (b, con7)):
        node.finish(ctx)
    cluster.run()
    assert a.unreported() == set()
    assert b.unreported() == set()


def test_a_request_that_used_the_half_open_session_computes_locally() -> None:
    """What the old session held is gone on the peer's side: a load sent into the
    half-open session fails at the renewal (not at a timeout), and its request's
    later lookups answer MISS."""
    cluster, a, b = half_open_pair()
    b.store(b.request("pro-kv9", decoder("kv9")), KEYS_B)
    con9 = a.request("con-kv9", prefiller("kv9", b))
    job9, _ = a.load(con9, KEYS_B)  # its fetch reaches b, which holds no session: dropped
    a.step()
    b.step()
    assert b.tier.session(a.peer_id) is None, "setup: b drops a's fetch as a straggler"
    a.store(a.request("pro-kv7", decoder("kv7")), KEYS_A)
    con7 = b.request("con-kv7", prefiller("kv7", a))
    b.lookup(con7, *KEYS_A)
    b.load(con7, KEYS_A)
    cluster.run()
    assert a.stats().sessions_ended == {"renewed": 1}
    assert a.outcome(job9) is False
    assert a.lookup(con9, *KEYS_B) == [LookupResult.MISS] * 3


def test_a_vllm_style_connect_after_the_handshake_is_still_a_protocol_error() -> None:
    """vLLM's connect carries no boot id: nothing changes for it (docs/protocol.md §3.4)."""
    cluster, a, b = half_open_pair()
    hello = b.sent_of(Connect, to=a)[0]
    vllm_hello = Connect(
        peer_id=hello.peer_id,
        agent_metadata=hello.agent_metadata,
        base_addr=hello.base_addr,
        num_blocks=hello.num_blocks,
        block_len=hello.block_len,
        config_fingerprint=hello.config_fingerprint,
        hash_seed=hello.hash_seed,
    )
    inbound = InboundFrame(b.peer_id, CODEC.encode(vllm_hello))
    a.control.inner.inbox.append((cluster.clock.now, -1, inbound))
    a.step()
    assert a.stats().sessions_ended == {"protocol_error": 1}


def test_crossing_fresh_sessions_settle_instead_of_renewing_each_other() -> None:
    """Seed 2758: ``a`` restarted while ``b``'s answer to its old incarnation's connect -
    ``b``'s connect and its ack of that old connect - was in flight, and it landed in the
    new ``a``. The new ``a`` opens a session from ``b``'s connect; ``b`` takes the new
    ``a``'s connect for a restart and opens a fresh session from it; each one's next
    connect meets a session of the other that nobody acknowledged yet. Taking the old
    ack as the ack of the new ``a``'s connect, and renewing on the next connect, made
    the two renew each other's sessions every round trip for ever. Now the old ack is a
    straggler (it echoes another session number) and the unacknowledged session adopts
    the next connect: a few endings, then the pair stays up and serves both ways."""
    cluster, a, b, probers = probing_pair()
    session_of_b = b.session(a)
    assert session_of_b.ready, "setup: the pair works"
    b.session(a).close("forgotten", CloseKind.LOCAL)  # b will greet a again
    b.step()
    lose_goodbyes(a, b)
    a.session(b).close("forgotten", CloseKind.LOCAL)
    a.step()
    lose_goodbyes(b, a)
    # a's next probe opens a session toward b: its connect goes out...
    run(cluster, probers, TICK_S)
    # ...and b's answer (its connect, its ack of that connect) is in flight when a restarts.
    run(cluster, probers, LATENCY_S + 2 * TICK_S)
    assert [type(m) for m in b.sent(to=a)[-2:]] == [Connect, ConnectAck], "setup: b answered"
    hello, ack = b.sent_of(Connect, to=a)[-1], b.sent_of(ConnectAck, to=a)[-1]
    a = cluster.restart(a)
    a.parent.put(key(1))
    inject(a, b, CODEC.encode(hello), cluster.clock.now)
    inject(a, b, CODEC.encode(ack), cluster.clock.now)
    probers = [Prober(a, b, 2), Prober(b, a, 1)]
    run(cluster, probers, 3.0)  # a few round trips
    settled = (ended(a), ended(b), probers[0].hits, probers[1].hits)
    run(cluster, probers, 10.0)
    assert (ended(a), ended(b)) == settled[:2], "sessions still end each other"
    assert probers[0].hits > settled[2] + 10
    assert probers[1].hits > settled[3] + 10
