"""Tier: a peer's lookup is not kept waiting for a busy engine (tier invariant 8).

Producer ``b`` holds KEYS in its primary region but not in held blocks, so a peer's
lookup needs its serve window (or, in the last tests, only some of them in held blocks:
what a busy producer answers from its copy). The cluster's clock is fake; only the drivers poll
unless a test steps ``b``'s engine.
"""

from __future__ import annotations

from kvpeer.metrics import ThreadCpu, values
from kvpeer.metrics.reading import read_tier
from kvpeer.testing.cluster import BLOCK_LEN, Cluster, TierNode, keys, kv_source
from kvpeer.types import LookupResult, RequestContext

KEYS = keys(1, 2, 3)
WAIT = 0.25  # engine_wait_s default


def engine_waits(node: TierNode) -> float:
    series = values(read_tier(node.tier, ThreadCpu()))["timeouts_total"]
    return float(series[("engine_wait",)])  # type: ignore[arg-type]


def setup(config: dict[str, object] | None = None) -> tuple[Cluster, TierNode, TierNode]:
    cluster = Cluster()
    a = cluster.add("a", 1)
    b = cluster.add("b", 2, {"held_bytes": 0, **(config or {})})
    for key in KEYS:
        b.parent.put(key)
    cluster.run()
    return cluster, a, b


def poll(*nodes: TierNode, times: int = 4) -> None:
    for _ in range(times):
        for node in nodes:
            node.tier.poll()


def ask(a: TierNode, b: TierNode) -> RequestContext:
    """``a`` opens a request pulling from ``b`` and sends its lookup of KEYS."""
    ctx = a.request("c", kv_source("kv1", b))
    a.step()
    poll(a, b)
    assert a.lookup(ctx, *KEYS) == [LookupResult.RETRY] * 3
    a.step()
    poll(a, b)
    return ctx


def test_a_lookup_reaching_a_long_step_is_answered_miss_without_the_engine() -> None:
    cluster, a, b = setup()
    busy = b.request("busy")  # b's engine has a request: it is stepping
    b.step()
    cluster.clock.advance(1.0)  # ... and its current step has run for a second
    ctx = ask(a, b)
    a.step()
    assert a.lookup(ctx, *KEYS) == [LookupResult.MISS] * 3  # b never stepped
    assert engine_waits(b) == 1
    b.finish(busy)
    a.finish(ctx)
    cluster.run()
    assert b.stats().sessions == 1


def test_the_same_lookup_to_a_step_that_ends_in_time_is_served() -> None:
    cluster, a, b = setup()
    busy = b.request("busy")
    b.step()
    ctx = ask(a, b)
    cluster.clock.advance(WAIT / 2)
    b.step()  # the step ended: its window answers
    poll(a, b)
    a.step()
    assert a.lookup(ctx, *KEYS) == [LookupResult.HIT] * 3
    assert engine_waits(b) == 0
    b.finish(busy)
    a.finish(ctx)
    cluster.run()


def test_an_idle_engine_is_waited_for_then_answered_without() -> None:
    cluster, a, b = setup()
    cluster.clock.advance(10.0)  # idle: no request, no step for long
    ctx = ask(a, b)
    a.step()
    assert a.lookup(ctx, *KEYS) == [LookupResult.RETRY] * 3  # waits from its arrival
    cluster.clock.advance(WAIT)
    poll(a, b)  # the engine never woke: the wait ran out
    a.step()
    assert a.lookup(ctx, *KEYS) == [LookupResult.MISS] * 3
    assert engine_waits(b) == 1


def test_engine_wait_null_keeps_the_lookup_for_the_window() -> None:
    cluster, a, b = setup({"engine_wait_s": None})
    b.request("busy")
    b.step()
    cluster.clock.advance(1.0)
    ctx = ask(a, b)
    cluster.clock.advance(1.0)
    poll(a, b)
    a.step()
    assert a.lookup(ctx, *KEYS) == [LookupResult.RETRY] * 3
    b.step()
    poll(a, b)
    a.step()
    assert a.lookup(ctx, *KEYS) == [LookupResult.HIT] * 3
    assert engine_waits(b) == 0


# -- a busy producer's held prefix -------------------------------------------------------


def held_setup(held: tuple[bytes, ...]) -> tuple[Cluster, TierNode, TierNode]:
    """``b`` holds copies of ``held`` (stored by a local request) and has every key of
    KEYS in its engine's primary; its engine is then busy with a step a second old."""
    cluster = Cluster()
    a = cluster.add("a", 1)
    b = cluster.add("b", 2, {"held_bytes": 8 * BLOCK_LEN})
    cluster.run()
    local = b.request("local")
    job = b.store(local, held)
    b.step()
    assert b.outcome(job) is True
    b.finish(local)
    for key in KEYS:
        b.parent.put(key)
    return cluster, a, b


def test_a_busy_producer_answers_the_prefix_its_held_blocks_hold() -> None:
    cluster, a, b = held_setup(KEYS[:2])
    busy = b.request("busy")
    b.step()
    cluster.clock.advance(1.0)
    ctx = ask(a, b)  # not all held: it waits for the engine, which is mid-step
    a.step()
    assert a.lookup(ctx, *KEYS) == [LookupResult.HIT] * 2 + [LookupResult.MISS]
    assert engine_waits(b) == 1
    job_id, dest = a.load(ctx, KEYS[:2])
    poll(a, b)
    a.step()
    assert a.outcome(job_id) is True  # written from the copy, the engine still busy
    assert [a.block(slot) for slot in dest] == [b.parent.expected(k) for k in KEYS[:2]]
    held = b.tier.held()
    assert held is not None
    assert held.statistics().pinned_blocks == 0
    b.finish(busy)
    a.finish(ctx)
    cluster.run()


def test_held_blocks_past_the_prompts_head_are_not_hits() -> None:
    cluster, a, b = held_setup(KEYS[1:])  # the tail without its head serves nobody
    b.request("busy")
    b.step()
    cluster.clock.advance(1.0)
    ctx = ask(a, b)
    a.step()
    assert a.lookup(ctx, *KEYS) == [LookupResult.MISS] * 3
    held = b.tier.held()
    assert held is not None
    assert held.statistics().pinned_blocks == 0  # nothing pinned for a miss


def test_a_peer_that_never_fetches_its_held_prefixes_pins_nothing_for_long() -> None:
    """The attacker: many lookups to a busy producer, each answered with a held prefix,
    none fetched. They pin only the held rows of the prefix (counted once per row) and
    expire with ``store_timeout_s``."""
    cluster, a, b = held_setup(KEYS[:2])
    b.request("busy")
    b.step()
    cluster.clock.advance(1.0)
    contexts = []
    for n in range(6):
        ctx = a.request(f"c{n}", kv_source(f"kv{n}", b))
        a.step()
        poll(a, b)
        a.lookup(ctx, *KEYS)
        a.step()
        poll(a, b)
        a.step()
        assert a.lookup(ctx, *KEYS) == [LookupResult.HIT] * 2 + [LookupResult.MISS]
        contexts.append(ctx)
    held = b.tier.held()
    assert held is not None
    stats = held.statistics()
    assert stats.pinned_blocks == 2  # the same two rows, pinned once per lookup
    cluster.clock.advance(30.0 + 1)  # store_timeout_s
    poll(a, b)
    assert held.statistics().pinned_blocks == 0
