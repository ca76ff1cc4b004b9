"""The router's decisions: which engine serves a request, and whether it pulls a prefix.

:class:`RouterPolicy` implements :class:`kvpeer.router.policy.Policy` on top of a
:class:`~kvpeer.router.index.PrefixIndex` (what each engine holds) and a
:class:`~kvpeer.router.cost.CostModel` (how long things take). Rules:

1. Only engines whose load says ``healthy`` appear in a plan; an engine the index has not
   learned counts as holding nothing (load-only for it) and is never a pull source.
2. ``shared``: every candidate engine is scored by its predicted TTFT -- compute what it
   lacks locally (its GPU or CPU tier), or pull the longer prefix another engine holds
   in its CPU tier and compute the rest, whichever is predicted faster. The engine with
   the lowest prediction serves; ties go to fewer requests in flight, then the name.
3. ``pd``: the prefill engine is the one predicted to prefill soonest; the decode engine
   pulls every block from it, so decode engines are scored by their load and the pull.
   Decode-only only when no other prefill engine is healthy, or when the decode engine
   already holds every usable block (a prefill leg would only add latency). Operators
   choose PD to keep prefill off decode engines, so it is not traded for TTFT.
4. The predicted cached tokens never exceed the prompt's full blocks that vLLM can use:
   the last prompt token is always computed. What a pull source holds is told to the
   consumer uncapped (``Plan.source_held_tokens``): kvpeer's connector loads the
   prompt's last block too and computes only its last token.
5. Every plan, prediction and outcome is counted in :class:`DecisionStats`; nothing here
   raises on engine data, and every table is bounded.
6. Bounded exploration: a pull the model predicts slower, but by no more than
   ``explore_max_loss_s``, is planned anyway once every ``explore_every`` plans (reason
   ``pull: exploring``), so a pessimistic estimate is put to the test instead of keeping
   pulls away for good; its outcome is learned like any other. Nothing else is traded for
   learning: a pull predicted to lose more is never explored, and the client's pinned
   engine or source always wins.
7. Estimates go stale: what a busy source costs is learned only from pulls from busy
   sources, so it relaxes toward its prior as time passes without one
   (:meth:`CostModel.relax`), and no decision rests on an old bad experience alone.
8. A pull is bounded: a shared plan that pulls tells the engine when to give up
   (``Plan.give_up_s``: twice its compute of the pulled tokens, idle, at least
   :data:`MIN_GIVE_UP_S`), so a pull the model got wrong (a source busier than it
   looked, blocks no longer held) costs at most about three times computing them.
9. A source's pulls queue on its link: each shared pull planned is booked on its source
   (:meth:`CostModel.reserve_pull`), and later quotes from that source wait for it.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Final

from kvpeer.router.cost import CostModel
from kvpeer.router.decisionstats import DecisionStats, PredictionRecord
from kvpeer.router.index import MEDIUM_CPU, MEDIUM_GPU, PrefixIndex, PromptKeys
from kvpeer.router.learning import Pending, learn
from kvpeer.router.pdplan import NOTHING, plan_pd
from kvpeer.router.policy import EngineLoad, EngineSpec, Mode, Outcome, Plan
from kvpeer.router.reasons import (
    REASON_CACHE,
    REASON_LOAD,
    REASON_PULL,
    REASON_PULL_EXPLORE,
    REASON_PULL_PINNED,
    REASON_PULL_SLOWER,
)

__all__ = [
    "GIVE_UP_FACTOR",
    "MIN_GIVE_UP_S",
    "DecideConfig",
    "RouterPolicy",
]

#: The least ``Plan.give_up_s``: a pull is never abandoned sooner (a short prompt's
#: compute is quick, but a first pull's session set-up on a loaded host is not, and the
#: compute line is a prior until it has learned the engine).
MIN_GIVE_UP_S: Final = 1.0
#: ``Plan.give_up_s`` is this many times the predicted compute of the pulled tokens: a
#: pull gives up once waiting has cost what computing would have, with room for the
#: prediction being low (a pull that lands late still beats computing from then on).
GIVE_UP_FACTOR: Final = 2.0
_TOP_QUOTES: Final = 4  # at most this many holders of the longest prefix: quote them first


@dataclass(frozen=True, slots=True)
class DecideConfig:
    speculative_ttl_s: float = 10.0  # until the engine's events say what it holds
    pull_margin_s: float = 0.002  # a pull must win by this much (no coin flips)
    max_pending: int = 10_000  # plans awaiting their outcome
    recent_records: int = 256
    pulls: bool = True  # False: the engines have no peer tier (policy "affinity")
    explore_every: int = 16  # at most one exploring pull per this many plans (0: never)
    explore_max_loss_s: float = 0.05  # only pulls predicted to lose at most this much


@dataclass(frozen=True, slots=True)
class _Option:
    ttft_s: float
    cached: int
    source: str | None = None
    pulled: int = 0
    pull_rejected: bool = False  # a source held more, but pulling was predicted slower
    #: the best rejected pull (``pull_rejected``): tried now and then (rule 6)
    rejected: _Option | None = None


@dataclass(slots=True)
class _Pool:
    """One decision's pull sources: in plan order, by the prefix they hold, and what was
    quoted and located for them so far."""

    groups: dict[int, list[str]] = field(default_factory=dict)  # by prefix, plan order
    places: dict[int, list[int]] = field(default_factory=dict)  # their places in plan order
    lengths: list[int] = field(default_factory=list)  # the groups' prefixes, longest first
    quotes: dict[tuple[str, int], tuple[float, float]] = field(default_factory=dict)
    unseen: dict[tuple[int, int], list[int]] = field(default_factory=dict)

    def interleaved(
        self, predicted: Sequence[tuple[int, str, int, float]], at: int, local: int
    ) -> list[tuple[str, int, float | None]]:
        """Rule 2's candidates for an engine holding ``local`` that predicted the groups
        before ``lengths[at]`` (``predicted``: place, source, prefix, prediction), in
        plan order, each run of sources it did not predict as one ``None``: the pick
        treats every one of a run alike (its pick so far cannot change within the run),
        so it walks the few predicted sources, not the fleet (a second turn's holder
        and the hundreds of engines holding its system prompt: 110 sources walked per
        pulling engine made the slowest decisions of ``kvpeer bench router-scale``)."""
        unseen = self.unseen.get((at, local))
        if unseen is None:
            runs = [self.places[cpu] for cpu in self.lengths[at:] if cpu > local]
            unseen = runs[0] if len(runs) == 1 else sorted(chain.from_iterable(runs))
            self.unseen[(at, local)] = unseen
        out: list[tuple[str, int, float | None]] = []
        after = 0  # the first place a run may start at
        for place, source, cpu, ttft in sorted(predicted):
            i = bisect_left(unseen, after)
            if i < len(unseen) and unseen[i] < place:
                out.append(("", 0, None))
            out.append((source, cpu, ttft))
            after = place + 1
        if bisect_left(unseen, after) < len(unseen):
            out.append(("", 0, None))
        return out


class RouterPolicy:
    """The decision core (module docstring). Implements ``policy.Policy``."""

    def __init__(
        self,
        engines: Sequence[EngineSpec],
        mode: Mode,
        index: PrefixIndex,
        *,
        cost: CostModel | None = None,
        config: DecideConfig | None = None,
    ) -> None:
        names = [spec.name for spec in engines]
        if len(set(names)) != len(names):
            raise ValueError(f"engine names must be unique: {names}")
        self._specs = {spec.name: spec for spec in engines}
        self._mode = mode
        self._index = index
        self.cost = cost or CostModel()
        self._config = config or DecideConfig()
        self._pending: OrderedDict[str, Pending] = OrderedDict()
        self._stats = DecisionStats(self._config.recent_records)
        # Engines whose first request since (re)start has not finished: that request
        # pays the engine's warm-up (seconds here) and would teach the model nonsense.
        self._warming: set[str] = set(self._specs)
        self._since_explore = 0  # plans since the last exploring pull (rule 6)
        # Some engine lands pulls without extra steps: a bound shared by engines alike in
        # load cannot count the steps a pull costs the others.
        self._sync_pulls = any(spec.sync_pulls for spec in engines)
        self._pulls_ahead = any(spec.pulls_ahead for spec in engines)

    # --- Policy -----------------------------------------------------------------------

    def plan(
        self,
        request_id: str,
        prompt: Sequence[int],
        loads: Mapping[str, EngineLoad],
        now: float,
        *,
        serve_on: str | None = None,
        pull_from: str | None = None,
    ) -> Plan:
        healthy = {
            name: load for name, load in loads.items() if name in self._specs and load.healthy
        }
        # Engines that may serve: all healthy ones, or the pinned one (sources stay all).
        servers = [serve_on] if serve_on in healthy else list(healthy)
        keys = self._index.keys(prompt)
        usable = _usable_tokens(len(prompt), keys.block_size)
        self.cost.relax(now)
        self._since_explore += 1
        if self._mode is Mode.PD:
            held, _ = self._held(keys, usable, now)
            plan, pending = plan_pd(self.cost, self._specs, len(prompt), usable, healthy,
                                    servers, held)
        else:
            pinned = pull_from if pull_from in healthy else None
            plan, pending = self._plan_shared(prompt, keys, usable, healthy, servers, now, pinned)
        self._stats.planned(plan)
        if plan.engine:
            self._pending[request_id] = pending
            self._pending.move_to_end(request_id)
            while len(self._pending) > self._config.max_pending:
                self._pending.popitem(last=False)
                self._stats.add("pending_dropped_total")
        return plan

    def on_sent(self, request_id: str, plan: Plan, prompt: Sequence[int], now: float) -> None:
        keys = self._index.keys(prompt)
        ttl = self._config.speculative_ttl_s
        for engine in (plan.engine, plan.prefill_engine):
            if engine:
                self._index.speculate(engine, keys, MEDIUM_GPU, now, ttl)

    def on_outcome(self, outcome: Outcome, now: float) -> None:
        self._stats.add("outcomes_total")
        pending = self._pending.pop(outcome.request_id, None)
        if pending is None:
            self._stats.add("outcomes_unmatched_total")
            return
        plan = pending.plan
        self._stats.finished(
            PredictionRecord(
                outcome.request_id, outcome.engine, plan.predicted_cached_tokens,
                outcome.cached_tokens, plan.predicted_ttft_s, outcome.ttft_s,
            )
        )
        if not outcome.ok or outcome.ttft_s is None or outcome.engine != plan.engine:
            self._stats.add("outcomes_failed_total")
            return
        involved = {plan.engine, plan.source, plan.prefill_engine} & self._warming
        if involved:
            self._warming -= involved
            self._stats.add("outcomes_warmup_total")
            return
        learn(self.cost, self._specs, self._stats, pending, outcome)

    def on_engine_restart(self, engine: str, now: float) -> None:
        self._index.forget(engine)
        self.cost.forget_sessions(engine)
        if engine in self._specs:
            self._warming.add(engine)

    # --- exports ----------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Plain numbers: counters, plans by reason, the error histogram, learned rates."""
        out = self._stats.snapshot()
        out.update({f"rate:{name}": value for name, value in self.cost.rates().items()})
        out["pending_plans"] = float(len(self._pending))
        return out

    def recent_predictions(self) -> tuple[PredictionRecord, ...]:
        """The last finished requests: predicted vs actual cached tokens and TTFT."""
        return self._stats.recent()

    # --- shared -----------------------------------------------------------------------

    def _plan_shared(
        self,
        prompt: Sequence[int],
        keys: PromptKeys,
        usable: int,
        healthy: Mapping[str, EngineLoad],
        servers: Sequence[str],
        now: float,
        pull_from: str | None = None,
    ) -> tuple[Plan, Pending]:
        """Rule 2, at a cost that grows with the fleet once, not with servers x sources
        (``kvpeer bench router-scale``: 25 ms a decision at 256 engines when every
        server predicted every source).

        Servers alike in prefix held and load share a lower bound of their prediction:
        the cost model's floor lines (:meth:`CostModel.compute_floor_s`,
        :meth:`CostModel.pull_floor_s`, and the quotes of the longest prefix's few
        holders). They are predicted exactly in the order of their bound until the bound
        passes the best prediction so far, so a server is skipped only when it cannot
        win. A server's pulls are predicted per prefix length its sources hold, longest
        first, and each source's pull once per prefix the pulling servers hold
        (:meth:`CostModel.pull_quote_s`). Sums are formed as ``pull_s`` and the old
        per-source loop formed them, so the plan is the same to the last bit
        (``tests/router/test_decide_scale.py`` checks it against that loop).
        """
        n = len(prompt)
        if not servers:
            return Pending.no_engine(n, healthy)
        cost = self.cost
        held, in_cpu = self._held(keys, usable, now)
        sources: list[tuple[str, int]] = []  # (name, CPU-tier prefix), in plan order
        if self._config.pulls:
            for name in healthy if pull_from is None else (pull_from,):
                cpu = held.get(name, NOTHING)[1]
                if cpu > 0:
                    sources.append((name, cpu))
        pool = _Pool()
        for place, (source, cpu) in enumerate(sources):
            pool.groups.setdefault(cpu, []).append(source)
            pool.places.setdefault(cpu, []).append(place)
        lengths = pool.lengths = sorted(pool.groups, reverse=True)
        top = lengths[0] if lengths else 0
        floor = cost.pull_floor_s() if sources else 0.0
        # Every server's least possible prediction (the cost model's floor lines: one
        # per prefix held and load, shared by the servers alike in both), then exact
        # predictions, most promising first, until no server left can beat the best.
        alike: dict[tuple[int, int, int], list[str]] = {}
        for name in servers:
            load = healthy[name]
            local = held[name][0] if name in held else 0
            key = (local, load.queued_prompt_tokens, load.in_flight)
            group = alike.get(key)
            if group is None:
                alike[key] = [name]
            else:
                group.append(name)
        top_floor, second = self._top_floor(pool, held, healthy, floor)
        entries: list[tuple[float, int, int, int]] = []
        for (local, queued, in_flight), names in alike.items():
            load = healthy[names[0]]
            bound = cost.compute_floor_s(n - local, load)
            if local < top:  # a source holds more: a pull may be faster (sources != name)
                steps = 0.0 if self._sync_pulls else cost.consumer_steps_floor_s(load)
                # a pull ahead may hide behind the queue wait: no pull cost is certain
                ahead = self._pulls_ahead and any(self._specs[x].pulls_ahead for x in names)
                lowest, least = (0.0, 0.0) if ahead else (top_floor, floor)
                bound = min(bound, cost.compute_floor_s(n - top, load) + lowest + steps)
                if local < second:
                    bound = min(bound, cost.compute_floor_s(n - second, load) + least + steps)
            entries.append((bound, local, queued, in_flight))
        entries.sort()
        best: tuple[float, int, str] | None = None
        option = _Option(0.0, 0)
        for bound, local, queued, in_flight in entries:
            if best is not None and bound > best[0]:
                break  # sorted: no later one can win either
            for name in alike[(local, queued, in_flight)]:
                alone = cost.compute_s(name, n - local, healthy[name])
                found: _Option | None = _Option(alone, local)
                if local < top:
                    found = self._best_option(
                        name, n, local, alone, pool, healthy, floor, best, pull_from
                    )
                    if found is None:
                        continue
                assert found is not None
                rank = (found.ttft_s, in_flight, name)
                if best is None or rank < best:
                    best, option = rank, found
        assert best is not None
        engine = best[2]
        explore = self._explorable(option)
        if explore is not None:
            option = explore
        if explore is not None:
            reason = REASON_PULL_EXPLORE
        elif option.source is not None:
            reason = REASON_PULL if option.source != pull_from else REASON_PULL_PINNED
        elif option.pull_rejected:
            reason = REASON_PULL_SLOWER
        elif option.cached > 0:
            reason = REASON_CACHE
        else:
            reason = REASON_LOAD
        plan = Plan(
            engine=engine, source=option.source, predicted_cached_tokens=option.cached,
            predicted_pulled_tokens=option.pulled, predicted_ttft_s=option.ttft_s,
            reason=reason,
            source_held_tokens=in_cpu.get(option.source, 0) if option.source else 0,
            give_up_s=self._give_up_s(engine, option.pulled) if option.source else None,
            rejected_pull_ttft_s=(option.rejected.ttft_s if reason == REASON_PULL_SLOWER
                                  and option.rejected is not None else None),
        )
        local = held.get(engine, NOTHING)[0]
        wait = cost.reserve_pull(option.source, option.pulled) if option.source else 0.0
        return plan, Pending(plan, n, local, 0, dict(healthy), wait)

    def _best_option(
        self,
        engine: str,
        prompt_tokens: int,
        local: int,
        alone: float,
        pool: _Pool,
        healthy: Mapping[str, EngineLoad],
        floor: float,
        best: tuple[float, int, str] | None,
        pull_from: str | None,
    ) -> _Option | None:
        """Compute locally (``alone``), or pull from the best source (rule 2); from
        ``pull_from`` whenever it holds more, if the client pinned it. None: ``engine``
        cannot beat ``best`` (a lower bound per prefix length the sources hold says so)."""
        cost = self.cost
        load = healthy[engine]
        steps = cost.consumer_steps_s(engine, load, sync=self._specs[engine].sync_pulls)
        hidden = cost.pull_hidden_s(engine, load, ahead=self._specs[engine].pulls_ahead)
        floor = max(0.0, floor - hidden)
        predicted: list[tuple[int, str, int, float]] = []  # (place, source, prefix, ttft)
        least = alone
        quotes = pool.quotes
        # A group's pulls take at least its compute of the rest + the floor: longest
        # prefix first (the lowest bound), stopping once nothing left can beat ``best``,
        # or once the groups left, all above the best pull so far, cannot change the
        # pick (a long prefix's holder beats the many holders of a short one).
        for at, cpu in enumerate(pool.lengths):
            if cpu <= local:
                break
            compute = cost.compute_s(engine, prompt_tokens - cpu, load)
            bound = compute + floor + steps
            if best is not None and min(least, bound) > best[0]:
                return None
            if predicted and pull_from is None and bound > least:
                candidates = pool.interleaved(predicted, at, local)
                option = self._pick(local, alone, candidates, bound, pull_from)
                if option is not None:
                    return option
            for source, place in zip(pool.groups[cpu], pool.places[cpu], strict=True):
                quote = quotes.get((source, local))
                if quote is None:
                    spec = self._specs[source]
                    quote = quotes[(source, local)] = cost.pull_quote_s(
                        source, cpu - local, healthy[source],
                        held=spec.held_share(healthy[source]), bounded=spec.serves_held,
                    )
                pull = quote[0] if cost.is_warm(engine, source) else quote[1]
                ttft = compute + max(0.0, pull - hidden) + steps  # as pull_s summed
                predicted.append((place, source, cpu, ttft))
                least = min(least, ttft)
        if best is not None and least > best[0]:
            return None
        predicted.sort()
        candidates = [(source, cpu, ttft) for _, source, cpu, ttft in predicted]
        option = self._pick(local, alone, candidates, None, pull_from)
        assert option is not None  # every candidate predicted: nothing is uncertain
        return option

    def _pick(
        self,
        local: int,
        alone: float,
        candidates: Iterable[tuple[str, int, float | None]],
        unknown: float | None,
        pull_from: str | None,
    ) -> _Option | None:
        """Rule 2's pick: in plan order, a pull is taken when it beats the pick so far by
        the margin (a pinned source always). ``candidates`` are the sources holding more
        than ``local``, in plan order, with their predictions; those not predicted
        (``None``: one or more in a row, :meth:`_Pool.interleaved`) take at least
        ``unknown``; None when one of them could change the pick. While one of them may
        have been taken, the pick so far is only known to lie in ``[low, ttft]``."""
        margin = self._config.pull_margin_s
        ttft, cached, chosen = alone, local, None
        low: float | None = None
        rejected: tuple[float, int, str] | None = None
        unpredicted = False
        for source, cpu, candidate in candidates:
            if candidate is None:
                assert unknown is not None
                unpredicted = True
                if unknown + margin < ttft:  # it may be taken
                    low = unknown if low is None else min(low, unknown)
                continue
            if low is None:
                taken = source == pull_from or candidate + margin < ttft
            elif candidate + margin < low:
                taken, low = True, None
            elif candidate + margin >= ttft:
                taken = False
            else:
                return None
            if taken:
                ttft, cached, chosen = candidate, cpu, source
            elif rejected is None or candidate < rejected[0]:
                rejected = (candidate, cpu, source)
        if low is not None:
            return None
        if chosen is not None:
            return _Option(ttft, cached, chosen, cached - local)
        if rejected is None and not unpredicted:
            return _Option(ttft, cached)
        if rejected is None or (unknown is not None and unpredicted and rejected[0] >= unknown):
            return None  # the least rejected pull may be one not predicted
        tried = _Option(rejected[0], rejected[1], rejected[2], rejected[1] - local)
        return _Option(ttft, cached, pull_rejected=True, rejected=tried)

    def _top_floor(
        self,
        pool: _Pool,
        held: Mapping[str, tuple[int, int]],
        healthy: Mapping[str, EngineLoad],
        floor: float,
    ) -> tuple[float, int]:
        """The least pull from the sources holding the longest prefix, and the next
        length (0: none): a second turn's one holder is typically busy, and its pulls
        then cost far more than the floor, so others' bounds should say so."""
        lengths = pool.lengths
        if not lengths:
            return floor, 0
        top, second = lengths[0], lengths[1] if len(lengths) > 1 else 0
        sources = pool.groups[top]
        if len(sources) > _TOP_QUOTES:
            return floor, second
        # Whoever pulls from them pulls at least this many tokens (a pull grows with them).
        fewest = top - max((local for local, _ in held.values() if local < top), default=0)
        cost = self.cost
        quotes = []
        for source in sources:
            spec = self._specs[source]
            warm, cold = cost.pull_quote_s(source, fewest, healthy[source],
                                           held=spec.held_share(healthy[source]),
                                           bounded=spec.serves_held)  # fmt: skip
            # No session with it is warm: whoever pulls from it pays the cold one.
            quotes.append(warm if cost.warm_source(source) else cold)
        return min(quotes), second

    def _give_up_s(self, engine: str, pulled_tokens: int) -> float:
        """When a pull into ``engine`` stops paying: :data:`GIVE_UP_FACTOR` times its
        compute of the pulled tokens, idle (rule 2's alternative, started late), at least
        :data:`MIN_GIVE_UP_S`."""
        idle = EngineLoad(healthy=True, in_flight=0, queued_prompt_tokens=0)
        return max(MIN_GIVE_UP_S,
                   GIVE_UP_FACTOR * self.cost.compute_s(engine, pulled_tokens, idle))

    def _explorable(self, option: _Option) -> _Option | None:
        """The rejected pull of ``option``, if it is time to try one (rule 6)."""
        every = self._config.explore_every
        tried = option.rejected
        if not every or tried is None or self._since_explore < every:
            return None
        if tried.ttft_s - option.ttft_s > self._config.explore_max_loss_s:
            return None
        self._since_explore = 0
        self._stats.add("explorations_total")
        return tried

    def _held(
        self, keys: PromptKeys, usable: int, now: float
    ) -> tuple[dict[str, tuple[int, int]], dict[str, int]]:
        """(local prefix in either medium, prefix in the CPU tier), capped (rule 4), of
        every engine holding some of the prompt (any other engine holds ``NOTHING``);
        and each one's CPU-tier prefix uncapped."""
        gpu = self._index.prefixes(keys, MEDIUM_GPU, now)
        cpu = self._index.prefixes(keys, MEDIUM_CPU, now)
        if max(gpu.values(), default=0) > usable or max(cpu.values(), default=0) > usable:
            return {
                name: (min(max(gpu.get(name, 0), cpu.get(name, 0)), usable),
                       min(cpu.get(name, 0), usable))
                for name in gpu.keys() | cpu.keys()
            }, cpu  # fmt: skip
        # Nothing to cap (the usual case: rule 4 caps only a prompt held whole).
        held = {name: (local, 0) for name, local in gpu.items()}
        for name, in_cpu in cpu.items():
            local = gpu.get(name, 0)
            held[name] = (local if local > in_cpu else in_cpu, in_cpu)
        return held, cpu

def _usable_tokens(prompt_tokens: int, block_size: int) -> int:
    """Full blocks vLLM can take from a cache: at least the last token is computed."""
    if block_size <= 0 or prompt_tokens <= 0:
        return 0
    return ((prompt_tokens - 1) // block_size) * block_size
