"""Request budgets toward unreachable peers, and their recovery (issue 11, item 1).

The world knows, for each consumer node C and peer P, whether P is reachable
from C (:class:`Reach`, updated once per tick after the faults):

- **refused**: P's process is down and nothing cuts the path (the connection is
  refused or reset): a request of C waiting on P ends within
  :attr:`Bounds.refused` (a tick or two);
- **silent**: the path is cut in either direction, P is frozen, or P's host does
  not exist: it ends within :attr:`Bounds.silent` - ``peer_wait_s`` plus the
  slack, counted from the last frame of P that reached C if that came later
  (the node cannot know a peer froze while its frames still arrive),
  whatever the session's state: before P ever answered, mid-handshake
  (P greeted us and never acknowledged), on a ready session (P stops answering
  pings) and on a session made ready by P's frames while our own link never
  connected (our pings never arrive) - and never waits out a session timeout
  or the transport's heartbeat.

Budgets run from the later of the moment the peer became unreachable (of that
kind) and the moment the request started waiting. What waits: an open load
job from P (judged every tick by :meth:`Reach.check_loads`), and a
symmetric request whose probes the tier keeps answering RETRY (judged at
each RETRY, :meth:`Reach.check_retry`).

Recovery: once the path between C and P has been healthy (both up and
stepping, not frozen, nothing cut) for :attr:`Bounds.recovery` - the last
failed attempt plus the longest back-off - a new PD request of C naming P is
not turned away: its first lookup answers HIT, not MISS
(:meth:`Reach.check_first_pd_lookup`). At the end of the run every session a
node still holds is ready, toward a live node that holds one toward it
(:meth:`Reach.check_sessions`): no half-open session outlives the faults.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvpeer.lab.sim.sim_network import SimNetwork
from kvpeer.lab.sim.timeouts import SimContext
from kvpeer.node.tier import Tier

__all__ = ["REFUSED", "SILENT", "Reach"]

REFUSED, SILENT = "refused", "silent"
_NEVER = float("-inf")


class Reach:
    """Reachability of every (consumer, peer) pair, as the world made it."""

    def __init__(self, ctx: SimContext, net: SimNetwork, nodes: list[str], ghost: str) -> None:
        self._ctx = ctx
        self._net = net
        self._nodes = nodes
        self._ghost = ghost
        self._state: dict[tuple[str, str], tuple[float, str]] = {}  # unreachable: since, kind
        self._disturbed: dict[tuple[str, str], float] = {}  # last time not healthy
        self._flagged: set[object] = set()

    # -- the world's view --------------------------------------------------------------

    def update(self, busy: Iterable[str]) -> None:
        """Record each pair's state now; ``busy``: nodes that do not step this tick."""
        now = self._ctx.clock.now
        net = self._net
        busy = set(busy)
        nodes = self._nodes
        state, disturbed = self._state, self._disturbed
        up = {node: net.is_up(node) for node in nodes}
        silent = {node: bool(net.frozen_since(node)) for node in nodes}
        if not (busy or state or net.cuts() or any(silent.values())) and all(up.values()):
            return  # every pair healthy and was: nothing to record (most ticks)
        for consumer in nodes:
            still = up[consumer] and consumer not in busy
            for peer in nodes:
                if peer == consumer:
                    continue
                pair = (consumer, peer)
                if silent[peer] or net.broken_since(consumer, peer) is not None:
                    kind: str | None = SILENT
                elif not up[peer]:
                    kind = REFUSED
                else:
                    kind = None
                if kind is None:
                    state.pop(pair, None)
                    if not still or peer in busy:
                        disturbed[pair] = now
                else:
                    # A consumer that does not step does not spend its budget (its
                    # own waits are shifted the same way when it resumes).
                    if state.get(pair, (0.0, None))[1] != kind or consumer in busy:
                        state[pair] = (now, kind)
                    disturbed[pair] = now

    def disturb(self, node: str) -> None:
        """``node`` booted, died or restarted: every pair with it starts over."""
        now = self._ctx.clock.now
        for other in self._nodes:
            if other != node:
                self._disturbed[(node, other)] = now
                self._disturbed[(other, node)] = now

    def unreachable(self, consumer: str, peer: str) -> tuple[float, str] | None:
        if peer == self._ghost:
            return (_NEVER, SILENT)
        return self._state.get((consumer, peer))

    def budget(self, kind: str) -> float:
        bounds = self._ctx.bounds
        return bounds.refused if kind == REFUSED else bounds.silent

    # -- checks ------------------------------------------------------------------------

    def overdue(
        self, tier: Tier, consumer: str, peer: str, waiting_since: float, what: object
    ) -> str | None:
        """Why a wait on ``peer`` since ``waiting_since`` is over budget now, or None."""
        state = self.unreachable(consumer, peer)
        if state is None:
            return None
        since, kind = state
        start = max(since, waiting_since)
        if kind == SILENT:
            start = max(start, self._net.last_arrival(peer, consumer) or _NEVER)
        budget = self.budget(kind)
        waited = self._ctx.clock.now - start
        if waited <= budget:
            return None
        t = self._ctx.bounds.timeouts
        return (
            f"waited {waited:.2f}s on {kind} peer {peer} (budget {budget:.2f}s: "
            f"peer_wait_s={t.peer_wait:.2f}; heartbeat {t.heartbeat_timeout:.2f}s, "
            f"handshake_timeout_s={t.handshake:g})"
        )

    def check_retry(
        self, tier: Tier, where: str, peer: str, req_id: str, streak_since: float
    ) -> None:
        """The tier answered RETRY for ``req_id``'s probes toward ``peer`` again."""
        problem = self.overdue(tier, tier.peer_id, peer, streak_since, (where, req_id))
        if problem is not None and ("retry", where, req_id) not in self._flagged:
            self._flagged.add(("retry", where, req_id))
            self._ctx.violate(where, f"request {req_id} still answered RETRY: {problem}")

    def check_load(
        self,
        tier: Tier,
        where: str,
        job_id: int,
        peer: str,
        kv_request_id: str | None,
        submitted: float,
    ) -> None:
        problem = self.overdue(tier, tier.peer_id, peer, submitted, (where, job_id))
        if problem is not None and ("load", where, job_id) not in self._flagged:
            self._flagged.add(("load", where, job_id))
            self._ctx.violate(where, f"load job {job_id} ({kv_request_id}) unreported: {problem}")

    def healthy_for(self, consumer: str, peer: str) -> float:
        if peer == self._ghost:
            return 0.0
        return self._ctx.clock.now - self._disturbed.get((consumer, peer), self._ctx.start)

    def check_first_pd_lookup(
        self, where: str, consumer: str, peer: str, req_id: str, hit: bool, started: float
    ) -> None:
        """The first answer the tier gave a fresh PD request of ``consumer`` naming
        ``peer``, which started at ``started``: judged only if the path was healthy
        from the recovery bound before its start until now (what befell an earlier
        session of the pair, a churn right after a heal, may decide its fate)."""
        if hit:
            return
        healthy = self.healthy_for(consumer, peer)
        if healthy - (self._ctx.clock.now - started) > self._ctx.bounds.recovery:
            self._ctx.violate(
                where,
                f"PD request {req_id} turned away (MISS) although the path to {peer} has "
                f"been healthy for {healthy:.2f}s (back-off and its last attempt take at "
                f"most {self._ctx.bounds.recovery:.2f}s)",
            )
