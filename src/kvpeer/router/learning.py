"""Learning from outcomes: what a plan assumed (:class:`Pending`), and how a finished
request's TTFT is split into what the cost model learns (:func:`learn`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvpeer.router.cost import CostModel
from kvpeer.router.decisionstats import DecisionStats
from kvpeer.router.policy import EngineLoad, EngineSpec, Outcome, Plan
from kvpeer.router.reasons import REASON_NO_ENGINE

__all__ = ["Pending", "learn"]


@dataclass(frozen=True, slots=True)
class Pending:
    """What the plan assumed, so its outcome can be split into what to learn."""

    plan: Plan
    prompt_tokens: int
    local_cached: int  # the serving engine's own prefix
    prefill_local_cached: int  # PD: the prefill engine's own prefix
    loads: Mapping[str, EngineLoad]
    queued_s: float = 0.0  # shared: the wait for the source's booked pulls it was quoted

    @staticmethod
    def no_engine(prompt_tokens: int, loads: Mapping[str, EngineLoad]) -> tuple[Plan, Pending]:
        """The plan when no engine may serve (answer 503), and its memo."""
        plan = Plan(engine="", reason=REASON_NO_ENGINE)
        return plan, Pending(plan, prompt_tokens, 0, 0, dict(loads))


def learn(
    cost: CostModel,
    specs: Mapping[str, EngineSpec],
    stats: DecisionStats,
    pending: Pending,
    outcome: Outcome,
) -> None:
    """Split a finished request's TTFT into what its plan assumed and teach ``cost`` the
    parts: the compute of what it computed, the pull of what it pulled (net of the
    consumer's extra steps, of a pull ahead's hidden wait and of the wait for the
    source's booked pulls), the prefill leg of a PD plan."""
    plan, loads = pending.plan, pending.loads
    assert outcome.ttft_s is not None
    engine_load = loads[plan.engine]
    cached = outcome.cached_tokens
    if cached is None:  # the engine does not report it: trust the prediction
        cached = plan.predicted_cached_tokens
    cached = max(0, min(cached, outcome.prompt_tokens))
    computed = outcome.prompt_tokens - cached
    ttft = outcome.ttft_s
    source = plan.source or plan.prefill_engine
    if plan.prefill_engine is not None:
        leg = outcome.prefill_leg_s
        if leg is None:  # the prefill leg failed: the decode engine computed alone
            cost.observe_compute(plan.engine, computed, engine_load, ttft)
            return
        cost.observe_compute(
            plan.prefill_engine,
            pending.prompt_tokens - pending.prefill_local_cached,
            loads[plan.prefill_engine],
            leg,
        )
        ttft = max(0.0, ttft - leg)
    pulled = cached - pending.local_cached
    if source is None or pulled <= 0:
        if source is not None:
            stats.add("pulls_missed_total")
        cost.observe_compute(plan.engine, computed, engine_load, ttft)
        return
    residual = ttft - cost.compute_s(plan.engine, computed, engine_load)
    if plan.prefill_engine is None:  # shared mode: the consumer's own extra steps
        spec = specs[plan.engine]
        residual -= cost.consumer_steps_s(plan.engine, engine_load, sync=spec.sync_pulls)
        hidden = cost.pull_hidden_s(plan.engine, engine_load, ahead=spec.pulls_ahead)
        if hidden > 0.0:
            if residual <= 0.0:  # the pull hid behind the queue wait: its length is unseen
                stats.add("pulls_hidden_total")
                return
            residual += hidden
    cost.observe_pull(plan.engine, source, pulled, loads[source], residual,
                      parked=plan.prefill_engine is not None,
                      held=specs[source].held_share(loads[source]),
                      queued_s=pending.queued_s)  # fmt: skip
    stats.add("pulled_tokens_observed_total", pulled)
