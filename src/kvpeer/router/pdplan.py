"""PD planning (rule 3 of kvpeer.router.decide): the prefill engine predicted to prefill
soonest, and the decode engine scored by its load and the pull of every block from it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

from kvpeer.router.cost import CostModel
from kvpeer.router.learning import Pending
from kvpeer.router.policy import EngineLoad, EngineSpec, Plan, Role
from kvpeer.router.reasons import REASON_PD, REASON_PD_CACHED, REASON_PD_NO_PREFILL

__all__ = ["NOTHING", "plan_pd"]

NOTHING: Final = (0, 0)  # (local, CPU tier) of an engine holding none of the prompt


def plan_pd(
    cost: CostModel,
    specs: Mapping[str, EngineSpec],
    prompt_tokens: int,
    usable: int,
    healthy: Mapping[str, EngineLoad],
    servers: Sequence[str],
    held: Mapping[str, tuple[int, int]],
) -> tuple[Plan, Pending]:
    """Plan a PD request of ``prompt_tokens`` (``usable`` of them cacheable) among the
    ``healthy`` engines, decode engines from ``servers``; ``held`` is each engine's
    (local prefix, CPU-tier prefix) of the prompt."""
    n = prompt_tokens
    decoders = [e for e in servers if specs[e].role in (Role.DECODE, Role.BOTH)]
    prefillers = [e for e in healthy if specs[e].role in (Role.PREFILL, Role.BOTH)]
    if not decoders:
        return Pending.no_engine(n, healthy)
    local = {e: held.get(e, NOTHING)[0] for e in healthy}
    # Prefill engines, soonest predicted prefill leg first.
    legs = sorted(
        (cost.compute_s(e, n - local[e], healthy[e]), healthy[e].in_flight, e)
        for e in prefillers
    )
    best: tuple[float, int, str] | None = None
    best_prefill: str | None = None
    for d in decoders:
        load = healthy[d]
        prefill = next(((t, e) for t, _, e in legs if e != d), None)
        chosen: str | None = None
        if prefill is None or (usable > 0 and local[d] >= usable):
            t = cost.compute_s(d, n - local[d], load)  # decode-only (rule 3)
        else:
            t, chosen = prefill
            # The decode engine pulls what it lacks, then computes the last tokens.
            t += cost.pull_s(d, chosen, usable - local[d], healthy[chosen], parked=True)
            t += cost.compute_s(d, n - usable, load)
        rank = (t, load.in_flight, d)
        if best is None or rank < best:
            best, best_prefill = rank, chosen
    assert best is not None
    ttft, _, decode = best
    prefill_engine = best_prefill
    if prefill_engine is None:
        others = [e for _, _, e in legs if e != decode]
        reason = REASON_PD_CACHED if others else REASON_PD_NO_PREFILL
        cached, pulled = local[decode], 0
    else:
        reason, cached, pulled = REASON_PD, usable, usable - local[decode]
    plan = Plan(
        engine=decode, prefill_engine=prefill_engine, predicted_cached_tokens=cached,
        predicted_pulled_tokens=pulled, predicted_ttft_s=ttft, reason=reason,
    )
    prefill_local = local[prefill_engine] if prefill_engine else 0
    return plan, Pending(plan, n, local[decode], prefill_local, dict(healthy))
