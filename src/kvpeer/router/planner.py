"""The policy, guarded: a valid plan over the engines the health filter lets through, or none.

The edge's step 2 (:mod:`kvpeer.router.app`). The request path
(:class:`kvpeer.router.forward.Forwarder`) asks :meth:`Planner.plan` for each attempt
and tells it what was sent and how it went; nothing here calls back into the edge.

Rules:

1. A policy that raises, or names a serving engine it may not use (not among the
   health filter's servers, or not the pinned one), costs the request nothing: the plan
   is the load-only fallback's (counted in ``kvpeer_router_policy_errors_total``).
2. A source or prefill engine the plan may not name (unknown, unhealthy, the serving
   engine itself, or in PD not a prefill role) is dropped; one whose peer name never
   resolved is dropped too, the request computing locally (an engine must not be told
   to dial a name).
3. With no engine to serve, the last resort (:meth:`Candidates.last_resort`): by load,
   computing locally, no pull named (its cache may be gone); None when there is none.
4. A plan names either a source (shared mode) or a prefill engine (PD), never both.
5. ``on_sent``, ``on_outcome`` and ``on_engine_restart`` of the policy never raise
   into the router: a failure is logged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

from kvpeer.router.candidates import Candidates
from kvpeer.router.config import RouterConfig
from kvpeer.router.loadonly import PREFILL_ROLES, LoadOnlyPolicy
from kvpeer.router.metrics import RouterMetrics
from kvpeer.router.peeraddr import PeerAddresses
from kvpeer.router.policy import EngineLoad, Mode, Outcome, Plan, Policy
from kvpeer.router.routed import RoutedRequest

__all__ = ["REASON_LAST_RESORT", "Planner"]

log = logging.getLogger("kvpeer.router.app")  # the edge's log, as before the split

REASON_LAST_RESORT = "last resort: no healthy engine"  # rule 3


class Planner:
    """Plans each attempt of a request with the policy, guarded (rules 1-5)."""

    def __init__(
        self,
        config: RouterConfig,
        policy: Policy,
        fallback: LoadOnlyPolicy,
        candidates: Candidates,
        peers: Callable[[], PeerAddresses],
        metrics: RouterMetrics,
        counts: dict[str, int],
    ) -> None:
        """``peers`` is read when used (the edge's, which a test may replace)."""
        self._config = config
        self._policy = policy
        self._fallback = fallback
        self._candidates = candidates
        self._peers = peers
        self._metrics = metrics
        self._counts = counts

    def plan(self, ctx: RoutedRequest, exclude: set[str]) -> Plan | None:
        """A valid plan over healthy engines not in ``exclude``, or None if none can serve."""
        loads = self._candidates.loads(exclude)
        servers = self._candidates.servers(loads)
        if not servers:
            return self._last_resort(ctx, exclude, loads)
        pd = self._config.mode is Mode.PD
        now = time.monotonic()
        serve_on = ctx.serve_on if ctx.serve_on in servers else None
        try:
            plan = self._policy.plan(
                ctx.request_id, ctx.tokens, loads, now, serve_on=serve_on, pull_from=ctx.pull_from
            )
        except Exception:
            log.exception("policy.plan failed for %s: routing by load", ctx.request_id)
            self._policy_error("raised")
            return self._fallback.plan(ctx.request_id, ctx.tokens, loads, now, serve_on=serve_on)
        if plan.engine not in servers or (serve_on is not None and plan.engine != serve_on):
            log.warning("plan for %s names %r, not a healthy serving engine: load only",
                        ctx.request_id, plan.engine)
            self._policy_error("invalid_engine")
            return self._fallback.plan(ctx.request_id, ctx.tokens, loads, now, serve_on=serve_on)
        other = plan.prefill_engine if pd else plan.source
        if other is not None and not (
            self._config.has(other)
            and loads[other].healthy
            and other != plan.engine
            and (not pd or self._config.entry(other).spec.role in PREFILL_ROLES)
        ):
            log.warning("plan for %s names %r as its %s: dropped", ctx.request_id, other,
                        "prefill engine" if pd else "source")
            self._policy_error("invalid_peer")
            plan = replace(plan, prefill_engine=None, source=None)
        elif other is not None and self._peers().dialable(self._config.entry(other).spec) is None:
            # Its peer name never resolved: an engine must not be told to dial a name.
            log.debug("plan for %s: %s has no peer address yet, computing locally",
                      ctx.request_id, other)
            plan = replace(
                plan, prefill_engine=None, source=None, predicted_pulled_tokens=0,
                predicted_cached_tokens=plan.predicted_cached_tokens - plan.predicted_pulled_tokens,
            )
        return replace(plan, source=None) if pd else replace(plan, prefill_engine=None)

    def _last_resort(
        self, ctx: RoutedRequest, exclude: set[str], loads: dict[str, EngineLoad]
    ) -> Plan | None:
        """Rule 3: no engine is healthy, so try one that is down but not known to be gone,
        by load, computing locally (no pull is named: its cache may be gone). A check
        missed under load must not turn every request into a 503 while the request path's
        own retries can find out whether it answers."""
        reachable = self._candidates.last_resort(exclude)
        if not reachable:
            return None
        as_up = {name: replace(loads[name], healthy=name in reachable) for name in loads}
        plan = self._fallback.plan(ctx.request_id, ctx.tokens, as_up, time.monotonic())
        if plan.engine not in reachable:
            return None
        self._metrics.last_resort.inc()
        log.warning("request %s: no healthy engine, trying %s (down, not known gone)",
                    ctx.request_id, plan.engine)
        return replace(plan, source=None, prefill_engine=None, predicted_pulled_tokens=0,
                       source_held_tokens=0, reason=REASON_LAST_RESORT)

    def _policy_error(self, kind: str) -> None:
        self._counts["policy_errors"] += 1
        self._metrics.policy_errors.labels(kind).inc()

    def sent(self, ctx: RoutedRequest, plan: Plan) -> None:
        try:
            self._policy.on_sent(ctx.request_id, plan, ctx.tokens, time.monotonic())
        except Exception:
            log.exception("policy.on_sent failed")

    def outcome(self, outcome: Outcome) -> None:
        try:
            self._policy.on_outcome(outcome, time.monotonic())
        except Exception:
            log.exception("policy.on_outcome failed")

    def engine_restarted(self, name: str) -> None:
        try:
            self._policy.on_engine_restart(name, time.monotonic())
        except Exception:
            log.exception("policy.on_engine_restart(%s) failed", name)
