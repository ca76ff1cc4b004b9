"""After the faults: every live node pulls from every other one again.

Once the quiet phase ended (every partition healed, every frozen node running,
every back-off long over), each live node P computes one fresh block, and
each other live node C asks P for it with a symmetric request. Pairs whose
sessions were left half-open (C holds a ready session toward P, P holds none
toward C) go first and alone, so the stale side speaks first: traffic the
other way would mend the pair before the case is tried. Writes complete
and nothing fails on purpose any more. A pair passes when one of
:data:`ATTEMPTS` requests in a row is served from P (its load succeeds); the
first may fail, if it is what tells C that its session toward P was
stale (its peer forgot it), but it must fail fast - every attempt ends within
:data:`ATTEMPT_TICKS` steps. A pair that never serves again is a violation:
that is how a session left half-open by a partition shows (each request
would wait out its timeouts, forever).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpeer.lab.sim.node import SimNode, SimRequest
from kvpeer.lab.sim.prompts import chain
from kvpeer.lab.sim.timeouts import PORT
from kvpeer.types import RequestContext

if TYPE_CHECKING:
    from kvpeer.lab.sim.world import World

__all__ = ["ATTEMPTS", "ATTEMPT_TICKS", "reunite"]

ATTEMPTS = 2
ATTEMPT_TICKS = 12  # a lookup round trip and a load take a few; timeouts take more
TICK = 0.5


def reunite(world: World, tick: int) -> int:
    """Run the reunion from ``tick``; returns the next tick."""
    live = [node for node in world.nodes if node.live is not None]
    for node in live:
        node.fail_p = 0.0
        node.busy_p = 0.0
        node.complete_p = 1.0
        assert node.live is not None
        node.live.plane.fail_next_writes = 0
    pairs = [(c, p) for c in live for p in live if c is not p]
    world.reunion_pairs = len(pairs)  # the storm budget allows their pulls
    half_open = [(c, p) for c, p in pairs if _half_open(c, p)]
    for pair in half_open:
        tick = _pull(world, tick, [pair])
    return _pull(world, tick, [pair for pair in pairs if pair not in half_open])


def _half_open(consumer: SimNode, producer: SimNode) -> bool:
    assert consumer.live is not None
    assert producer.live is not None
    ours = consumer.live.tier.session(producer.peer_id)
    theirs = producer.live.tier.session(consumer.peer_id)
    return ours is not None and ours.ready and (theirs is None or not theirs.ready)


def _pull(world: World, tick: int, pairs: list[tuple[SimNode, SimNode]]) -> int:
    """Each consumer pulls a fresh block from its producer, up to ATTEMPTS times."""
    pending = pairs
    for attempt in range(1, ATTEMPTS + 1):
        # A block only the producer holds: a consumer that computed the last one
        # itself would find it at home.
        blocks = {}
        for producer in {p.peer_id: p for _, p in pending}.values():
            if producer.live is None:
                continue
            key = chain(None, f"reunion:{tick}:{attempt}:{producer.peer_id}".encode())
            blocks[producer.peer_id] = key
            _start(producer, f"reunion-{attempt}-compute-{producer.name}", (key,), None)
        tick = _run(world, tick, 2)
        requests: dict[tuple[str, str], tuple[SimNode, SimRequest, int]] = {}
        for consumer, producer in pending:
            if consumer.live is None or producer.peer_id not in blocks:
                continue
            kv_request_id = f"reunion-{attempt}-{consumer.name}-{producer.name}"
            params: dict[str, object] = {
                "remote_kv_source": {
                    "kv_request_id": kv_request_id,
                    "remote_host": producer.name,
                    "remote_port": PORT,
                }
            }
            before = consumer.live.probe.loads_ok_sym
            request = _start(consumer, kv_request_id, (blocks[producer.peer_id],), params)
            requests[(consumer.peer_id, producer.peer_id)] = (consumer, request, before)
        start = tick
        while any(not r.done for _, r, _ in requests.values()) and tick - start < ATTEMPT_TICKS:
            tick = _run(world, tick, 1)
        still: list[tuple[SimNode, SimNode]] = []
        for (consumer_id, producer_id), (consumer, request, before) in requests.items():
            if not request.done:
                world.ctx.violate(
                    consumer.name,
                    f"reunion: request {request.req_id} toward {producer_id} still open after "
                    f"{ATTEMPT_TICKS} steps of a healthy network",
                )
                continue
            live_consumer = consumer.live
            served = live_consumer is not None and live_consumer.probe.loads_ok_sym > before
            if not served:
                producer = next(n for n in world.nodes if n.peer_id == producer_id)
                still.append((consumer, producer))
                if attempt == ATTEMPTS:
                    world.ctx.violate(
                        consumer.name,
                        f"reunion: {consumer_id} is not served by {producer_id} in "
                        f"{ATTEMPTS} requests after every fault healed",
                    )
        pending = still
        if not pending:
            break
    return tick


def _start(
    node: SimNode, req_id: str, keys: tuple[bytes, ...], params: dict[str, object] | None
) -> SimRequest:
    request = SimRequest(
        req_id=req_id,
        ctx=RequestContext(req_id, params),
        keys=keys,
        cuts=(len(keys),),
        linger=0,
    )
    node.start(request)
    return request


def _run(world: World, tick: int, steps: int) -> int:
    for _ in range(steps):
        tick += 1
        world.clock.advance(TICK)
        world.complete_writes()
        world.step(tick, full_check=False)
    return tick
