"""``LoadOnlyPolicy``: route by load alone; the policy the router runs until it knows more.

It is what the edge falls back to when the decision core is absent, raises, or returns a
plan that names an engine it may not use — and what a restarted router effectively
does until the index is re-learned: it never names a KV source, so it can never send an
engine to pull from a peer on stale affinity.

Choice: the healthy engine with the fewest requests in flight, then the fewest queued
prompt tokens; ties rotate so equal engines share the work. In PD mode the decode engine
is chosen among decode-capable engines and the prefill engine among prefill-capable ones,
never the same engine (a tier that names itself computes locally anyway).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvpeer.router.policy import EngineLoad, EngineSpec, Mode, Outcome, Plan, Role

__all__ = ["LoadOnlyPolicy", "LoadOnlyStatistics"]

PREFILL_ROLES = (Role.PREFILL, Role.BOTH)
DECODE_ROLES = (Role.DECODE, Role.BOTH)


@dataclass(frozen=True, slots=True)
class LoadOnlyStatistics:
    plans: int
    decode_only_plans: int  # PD plans without a prefill engine (none healthy)
    outcomes: int
    restarts_seen: int


class LoadOnlyPolicy:
    """Least in-flight, then least queued prompt tokens, ties rotated."""

    def __init__(self, engines: Sequence[EngineSpec], mode: Mode) -> None:
        self._engines = tuple(engines)
        self._mode = mode
        self._turn = 0
        self._plans = 0
        self._decode_only = 0
        self._outcomes = 0
        self._restarts = 0

    def _least(
        self, loads: Mapping[str, EngineLoad], roles: tuple[Role, ...], avoid: str | None = None
    ) -> str | None:
        candidates = [
            spec.name
            for spec in self._engines
            if spec.role in roles
            and spec.name != avoid
            and (load := loads.get(spec.name)) is not None
            and load.healthy
        ]
        if not candidates:
            return None
        best = min((loads[n].in_flight, loads[n].queued_prompt_tokens) for n in candidates)
        tied = [
            n for n in candidates if (loads[n].in_flight, loads[n].queued_prompt_tokens) == best
        ]
        return tied[self._turn % len(tied)]

    def plan(
        self,
        request_id: str,
        prompt: Sequence[int],
        loads: Mapping[str, EngineLoad],
        now: float,
        *,
        serve_on: str | None = None,
        pull_from: str | None = None,  # load only: never pulls
    ) -> Plan:
        self._plans += 1
        self._turn += 1
        if self._mode is Mode.SHARED:
            engine = serve_on or self._least(loads, (Role.BOTH, Role.PREFILL, Role.DECODE))
            return Plan(engine=engine or self._engines[0].name, reason="load only")
        decode = serve_on or self._least(loads, DECODE_ROLES)
        if decode is None:  # the edge does not ask then; answer something valid-shaped
            return Plan(engine=self._engines[0].name, reason="load only: no decode engine")
        prefill = self._least(loads, PREFILL_ROLES, avoid=decode)
        if prefill is None:
            self._decode_only += 1
            return Plan(engine=decode, reason="load only: no prefill engine, decode-only")
        return Plan(engine=decode, prefill_engine=prefill, reason="load only")

    def on_sent(self, request_id: str, plan: Plan, prompt: Sequence[int], now: float) -> None:
        pass

    def on_outcome(self, outcome: Outcome, now: float) -> None:
        self._outcomes += 1

    def on_engine_restart(self, engine: str, now: float) -> None:
        self._restarts += 1

    def statistics(self) -> LoadOnlyStatistics:
        return LoadOnlyStatistics(self._plans, self._decode_only, self._outcomes, self._restarts)
