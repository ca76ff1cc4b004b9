"""Decisions at fleet scale: the whole-fleet prefix walk and the bounded scoring answer
exactly what one walk per engine and one prediction per server and source answered.

The reference below is the decision core as it was before it was made to scale (every
server scored against every source that holds more, each engine's prefix walked on its
own), written against the public API. Random fleets exercise what can make the two
differ: learned lines of every shape, warm and cold pairs, busy sources, sources
serving held blocks, speculative entries, removals, cleared caches, resets and
restarts, pinned engines and sources, pulls off, and exploration.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

import pytest

from kvpeer.router.cost import CostModel, CostPriors
from kvpeer.router.decide import (
    GIVE_UP_FACTOR,
    MIN_GIVE_UP_S,
    DecideConfig,
    RouterPolicy,
)
from kvpeer.router.feed import StreamReset, StreamSynced
from kvpeer.router.index import MEDIUM_CPU, MEDIUM_GPU, PrefixIndex, PromptKeys
from kvpeer.router.kvevents import AllCleared, BlocksRemoved, BlocksStored, BlocksUnkeyable
from kvpeer.router.policy import EngineLoad, EngineSpec, Mode, Plan
from kvpeer.router.reasons import (
    REASON_CACHE,
    REASON_LOAD,
    REASON_NO_ENGINE,
    REASON_PULL,
    REASON_PULL_EXPLORE,
    REASON_PULL_PINNED,
    REASON_PULL_SLOWER,
)

BS = 4
MEDIA = (MEDIUM_GPU, MEDIUM_CPU)


class Fleet:
    """Engines whose events store and remove prefixes of a few prompts that share
    their openings, so that engines hold prefixes of many lengths."""

    def __init__(self, rng: random.Random, engines: int) -> None:
        self.rng = rng
        self.names = [f"e{i}" for i in range(engines)]
        openings = [[rng.randrange(50_000) for _ in range(BS * 12)] for _ in range(3)]
        self.prompts = [rng.choice(openings) + [rng.randrange(50_000) for _ in range(BS * 8)]
                        for _ in range(8)]  # fmt: skip
        self.index = PrefixIndex(BS, max_retired=64)
        self.salt = {name: i * 1_000_000 for i, name in enumerate(self.names)}
        self.held: dict[tuple[str, str], set[int]] = {}
        for name in self.names:
            self.index.apply(name, StreamSynced())

    def hashes(self, name: str, prompt: list[int]) -> list[int]:
        """The engine's own (salted) chained hashes of the prompt's blocks."""
        out, parent = [], self.salt[name]
        for start in range(0, len(prompt) - BS + 1, BS):
            parent = hash((parent, tuple(prompt[start : start + BS]))) & (2**63 - 1)
            out.append(parent)
        return out

    def churn(self, steps: int) -> None:
        rng = self.rng
        for _ in range(steps):
            name, medium = rng.choice(self.names), rng.choice(MEDIA)
            roll = rng.random()
            if roll < 0.55:
                prompt = rng.choice(self.prompts)
                hs = self.hashes(name, prompt)
                end = rng.randrange(1, len(hs) + 1)
                begin = rng.randrange(0, end)
                if begin and rng.random() < 0.7:
                    begin = 0  # mostly whole prefixes; sometimes a chunk after its parent
                self.index.apply(name, BlocksStored.of_ids(
                    medium, tuple(hs[begin:end]), hs[begin - 1] if begin else None,
                    tuple(prompt[begin * BS : end * BS]), BS))  # fmt: skip
                self.held.setdefault((name, medium), set()).update(hs[begin:end])
            elif roll < 0.9:
                known = sorted(self.held.get((name, medium), ()))
                gone = rng.sample(known, min(len(known), rng.randrange(1, 4)))
                self.index.apply(name, BlocksRemoved(medium, tuple(gone)))
            elif roll < 0.93:
                self.index.apply(name, BlocksUnkeyable((rng.randrange(10**9),), medium))
            elif roll < 0.95:
                self.index.apply(name, AllCleared())
            elif roll < 0.97:  # events lost: unlearned until the stream syncs again
                self.index.apply(name, StreamReset("gap", restarted=False))
                if rng.random() < 0.6:
                    self.index.apply(name, StreamSynced())
            elif roll < 0.98:  # the engine restarted and is relearned
                self.index.forget(name)
                self.index.apply(name, StreamSynced())
            else:
                prompt = rng.choice(self.prompts)
                now = rng.uniform(0.0, 20.0)
                self.index.speculate(name, self.index.keys(prompt), rng.choice(MEDIA), now,
                                     ttl=rng.uniform(1.0, 10.0))  # fmt: skip

    def query(self) -> list[int]:
        rng = self.rng
        prompt = rng.choice(self.prompts)
        cut = rng.randrange(1, len(prompt) + 1)
        return prompt[:cut] + [rng.randrange(50_000) for _ in range(rng.randrange(0, 9))]


def walked(index: PrefixIndex, name: str, keys: PromptKeys, medium: str, now: float) -> int:
    """The oracle: one engine's blocks present and unexpired speculative entries, walked
    key by key in the index's containers (no masks)."""
    state = index._engines.get(name)
    if state is None or not state.learned:
        return 0
    present = index._core._present[state.index].get(medium, {})
    speculative = index._core._speculative[state.index]
    blocks = 0
    for key in keys.keys:
        if key not in present and speculative.get((medium, key), now) <= now:
            break
        blocks += 1
    return blocks * keys.block_size


@pytest.mark.parametrize("seed", range(12))
def test_the_fleet_walk_answers_what_each_engines_walk_answers(seed: int) -> None:
    rng = random.Random(seed)
    fleet = Fleet(rng, engines=rng.randrange(1, 40))
    for _ in range(30):
        fleet.churn(rng.randrange(1, 40))
        keys = fleet.index.keys(fleet.query())
        now = rng.uniform(0.0, 25.0)
        for medium in MEDIA:
            one_by_one = {name: walked(fleet.index, name, keys, medium, now)
                          for name in fleet.names}  # fmt: skip
            assert one_by_one == {name: fleet.index.longest_prefix(name, keys, medium, now)
                                  for name in fleet.names}  # fmt: skip
            expected = {name: tokens for name, tokens in one_by_one.items() if tokens}
            assert fleet.index.prefixes(keys, medium, now) == expected


def test_the_fleet_walk_forgets_removed_blocks_and_lost_engines() -> None:
    fleet = Fleet(random.Random(3), engines=3)
    prompt = fleet.prompts[0]
    for name in fleet.names:
        hs = fleet.hashes(name, prompt)
        fleet.index.apply(name, BlocksStored.of_ids(MEDIUM_CPU, tuple(hs), None, tuple(prompt), BS))
    keys = fleet.index.keys(prompt)
    full = len(prompt) // BS * BS
    assert fleet.index.prefixes(keys, MEDIUM_CPU, 0.0) == dict.fromkeys(fleet.names, full)
    e0, e1, e2 = fleet.names
    fleet.index.apply(e0, BlocksRemoved(MEDIUM_CPU, (fleet.hashes(e0, prompt)[2],)))
    fleet.index.forget(e1)  # restarted: nothing until relearned
    fleet.index.apply(e2, StreamReset("gap", restarted=False))  # unlearned
    assert fleet.index.prefixes(keys, MEDIUM_CPU, 0.0) == {e0: 2 * BS}
    fleet.index.apply(e2, StreamSynced())  # learned again, holding what it re-announces
    assert fleet.index.prefixes(keys, MEDIUM_CPU, 0.0) == {e0: 2 * BS}
    assert fleet.index.prefixes(keys, MEDIUM_GPU, 0.0) == {}


def test_speculative_blocks_count_in_the_fleet_walk_until_they_expire() -> None:
    fleet = Fleet(random.Random(4), engines=2)
    prompt = fleet.prompts[1]
    keys = fleet.index.keys(prompt)
    e0, e1 = fleet.names
    hs = fleet.hashes(e0, prompt)
    fleet.index.apply(e0, BlocksStored.of_ids(MEDIUM_GPU, tuple(hs[:2]), None,
                                       tuple(prompt[: 2 * BS]), BS))  # fmt: skip
    fleet.index.speculate(e0, keys, MEDIUM_GPU, now=10.0, ttl=5.0)
    fleet.index.speculate(e1, fleet.index.keys(prompt[: 3 * BS]), MEDIUM_GPU, 12.0, 5.0)
    full = len(prompt) // BS * BS
    assert fleet.index.prefixes(keys, MEDIUM_GPU, 11.0) == {e0: full, e1: 3 * BS}
    assert fleet.index.prefixes(keys, MEDIUM_GPU, 16.0) == {e0: 2 * BS, e1: 3 * BS}
    assert fleet.index.prefixes(keys, MEDIUM_GPU, 17.0) == {e0: 2 * BS}


# --- the decision core, against the per-source reference ----------------------------------


def reference_plan(
    specs: Mapping[str, EngineSpec], index: PrefixIndex, cost: CostModel,
    config: DecideConfig, prompt: Sequence[int], loads: Mapping[str, EngineLoad], now: float,
    *, serve_on: str | None, pull_from: str | None, explore_due: bool,
) -> Plan:
    """Rule 2 (and rule 6 when ``explore_due``) as one loop per server and source."""
    healthy = {n: load for n, load in loads.items() if n in specs and load.healthy}
    servers = [serve_on] if serve_on in healthy else list(healthy)
    pinned = pull_from if pull_from in healthy else None
    if not servers:
        return Plan(engine="", reason=REASON_NO_ENGINE)
    keys = index.keys(prompt)
    n = len(prompt)
    usable = ((n - 1) // BS) * BS if n > 0 else 0
    held: dict[str, tuple[int, int]] = {}
    options: dict[str, tuple[tuple[float, int, str | None],
                             tuple[float, int, str | None] | None, int]] = {}
    for name in healthy:
        gpu = index.longest_prefix(name, keys, MEDIUM_GPU, now)
        cpu = index.longest_prefix(name, keys, MEDIUM_CPU, now)
        held[name] = (min(max(gpu, cpu), usable), min(cpu, usable))
    for engine in servers:
        load, local = healthy[engine], held[engine][0]
        best: tuple[float, int, str | None] = (cost.compute_s(engine, n - local, load), local,
                                               None)
        rejected: tuple[float, int, str | None] | None = None
        for source, (_, cpu) in held.items():
            if not config.pulls or source == engine or cpu <= local:
                continue
            if pinned is not None and source != pinned:
                continue
            pull = cost.pull_s(
                engine, source, cpu - local, healthy[source], held=specs[source].serves_held
            )
            hidden = cost.pull_hidden_s(engine, load, ahead=specs[engine].pulls_ahead)
            ttft = cost.compute_s(engine, n - cpu, load) + max(0.0, pull - hidden) + (
                cost.consumer_steps_s(engine, load, sync=specs[engine].sync_pulls))
            if source == pinned or ttft + config.pull_margin_s < best[0]:
                best = (ttft, cpu, source)
            elif rejected is None or ttft < rejected[0]:
                rejected = (ttft, cpu, source)
        options[engine] = (best, rejected if best[2] is None else None, local)
    engine = min(servers, key=lambda e: (options[e][0][0], healthy[e].in_flight, e))
    (ttft, cached, chosen), rejected, local = options[engine]
    if explore_due and rejected is not None and (
        rejected[0] - ttft <= config.explore_max_loss_s
    ):
        ttft, cached, chosen = rejected
        reason = REASON_PULL_EXPLORE
    elif chosen is not None:
        reason = REASON_PULL_PINNED if chosen == pinned else REASON_PULL
    elif rejected is not None:
        reason = REASON_PULL_SLOWER
    else:
        reason = REASON_CACHE if cached > 0 else REASON_LOAD
    source_held = index.longest_prefix(chosen, keys, MEDIUM_CPU, now) if chosen else 0
    idle = EngineLoad(healthy=True, in_flight=0, queued_prompt_tokens=0)
    give_up = (max(MIN_GIVE_UP_S, GIVE_UP_FACTOR * cost.compute_s(engine, cached - local, idle))
               if chosen else None)  # fmt: skip
    return Plan(engine=engine, source=chosen, predicted_cached_tokens=cached,
                predicted_pulled_tokens=cached - local if chosen else 0,
                predicted_ttft_s=ttft, reason=reason,
                source_held_tokens=source_held, give_up_s=give_up,
                rejected_pull_ttft_s=(rejected[0] if reason == REASON_PULL_SLOWER
                                      and rejected is not None else None))  # fmt: skip


def random_priors(rng: random.Random) -> CostPriors:
    """Priors under which pulls win often, rarely, or never."""
    return CostPriors(
        prefill_s_per_token=rng.choice((2e-4, 2e-3, 1e-2)),
        pull_base_s=rng.choice((0.01, 0.001)),
        pull_s_per_token=rng.choice((2e-5, 1e-4)),
        cold_session_s=rng.choice((0.05, 0.0)),
        source_busy_s=rng.choice((0.02, 0.002)),
        step_tokens=rng.choice((2048, 16)),
    )


def learned_cost(rng: random.Random, names: Sequence[str]) -> CostModel:
    """A cost model that has seen outcomes: lines of their own for some engines and
    sources, warm pairs, a learned busy-source cost."""
    cost = CostModel(random_priors(rng))
    for name in names:
        if rng.random() < 0.5:
            rate, overhead = rng.uniform(5e-5, 5e-4), rng.uniform(0.0, 0.05)
            for _ in range(rng.choice((3, 8, 12))):
                tokens = rng.randrange(1, 4000)
                load = EngineLoad(True, rng.randrange(3), rng.randrange(3) * 700)
                seconds = overhead + rate * (tokens + load.queued_prompt_tokens)
                cost.observe_compute(name, tokens, load, seconds * rng.uniform(0.8, 1.2))
    for _ in range(rng.randrange(0, 3 * len(names))):
        engine, source = rng.choice(names), rng.choice(names)
        load = EngineLoad(True, rng.choice((0, 0, 1, 3)), rng.randrange(3) * 500)
        cost.observe_pull(engine, source, rng.randrange(16, 3000), load,
                          rng.uniform(0.005, 0.3))  # fmt: skip
    return cost


@pytest.mark.parametrize("seed", range(40))
def test_plans_are_those_of_one_prediction_per_server_and_source(seed: int) -> None:
    rng = random.Random(1000 + seed)
    fleet = Fleet(rng, engines=rng.randrange(1, 48))
    fleet.churn(rng.randrange(20, 400))
    specs = {name: EngineSpec(name, f"http://{name}", "127.0.0.1", 5710,
                              serves_held=rng.random() < 0.3,
                              sync_pulls=rng.random() < 0.3,
                              pulls_ahead=rng.random() < 0.3)
             for name in fleet.names}  # fmt: skip
    explore_every = rng.choice((0, 1))
    config = DecideConfig(pulls=rng.random() < 0.9, explore_every=explore_every,
                          explore_max_loss_s=rng.choice((0.05, 10.0)),
                          pull_margin_s=rng.choice((0.002, 0.03, 0.1)))  # fmt: skip
    cost = learned_cost(rng, fleet.names)
    policy = RouterPolicy(list(specs.values()), Mode.SHARED, fleet.index, cost=cost,
                          config=config)  # fmt: skip
    for i in range(25):
        loads = {name: EngineLoad(rng.random() < 0.9, rng.choice((0, 0, 1, 2, 4)),
                                  rng.choice((0, 0, 256, 512, 3000)))
                 for name in fleet.names}  # fmt: skip
        prompt = fleet.query()
        now = rng.uniform(0.0, 25.0)
        serve_on = rng.choice(fleet.names) if rng.random() < 0.1 else None
        pull_from = rng.choice(fleet.names) if rng.random() < 0.15 else None
        cost.relax(now)  # as plan() does first, so that both see one model
        expected = reference_plan(specs, fleet.index, cost, config, prompt, loads, now,
                                  serve_on=serve_on, pull_from=pull_from,
                                  explore_due=explore_every == 1)  # fmt: skip
        plan = policy.plan(f"r{i}", prompt, loads, now, serve_on=serve_on,
                           pull_from=pull_from)  # fmt: skip
        assert plan == expected, (i, plan, expected)
        if rng.random() < 0.2:
            fleet.churn(rng.randrange(1, 30))


def second_turn_reasons(seed: int) -> list[str]:
    """The shape that dominated decision time: one engine (or a few) holds a long
    prefix, half the others a short one, the rest nothing; idle or busy holders, cheap or
    dear pulls. Every plan must be the reference's; returns their reasons."""
    rng = random.Random(seed)
    fleet = Fleet(rng, engines=64)
    prompt = fleet.prompts[0]
    holders = fleet.names[: rng.choice((1, 2, 4, 6))]
    for holder in holders:
        hs = fleet.hashes(holder, prompt)
        for medium in MEDIA:
            fleet.index.apply(
                holder, BlocksStored.of_ids(medium, tuple(hs), None, tuple(prompt), BS)
            )
    for name in fleet.names[len(holders) :: 2]:  # half the rest hold the opening's start
        hs = fleet.hashes(name, prompt)[:3]
        fleet.index.apply(name, BlocksStored.of_ids(MEDIUM_CPU, tuple(hs), None,
                                             tuple(prompt[: 3 * BS]), BS))  # fmt: skip
    specs = {name: EngineSpec(name, f"http://{name}", "127.0.0.1", 5710)
             for name in fleet.names}  # fmt: skip
    config = DecideConfig(explore_every=0, pull_margin_s=rng.choice((0.002, 0.03, 0.1)))
    cost = CostModel(random_priors(rng))
    policy = RouterPolicy(list(specs.values()), Mode.SHARED, fleet.index, cost=cost,
                          config=config)  # fmt: skip
    reasons = []
    for i in range(40):
        loads = {name: EngineLoad(True, rng.randrange(4), rng.randrange(4) * 512)
                 for name in fleet.names}  # fmt: skip
        for holder in holders:
            loads[holder] = EngineLoad(True, rng.randrange(5), rng.choice((0, 600, 3000)))
        query = prompt + [rng.randrange(50_000) for _ in range(2 * BS)]
        expected = reference_plan(specs, fleet.index, cost, config, query, loads, 0.0,
                                  serve_on=None, pull_from=None, explore_due=False)
        plan = policy.plan(f"r{i}", query, loads, 0.0)
        assert plan == expected, (i, plan, expected)
        reasons.append(plan.reason)
    return reasons


def test_second_turns_are_planned_as_one_prediction_per_server_and_source_plans() -> None:
    reasons = [reason for seed in range(24) for reason in second_turn_reasons(seed)]
    # The mix is what makes the comparison worth something: holders serving, others
    # pulling from them, and pulls predicted slower than computing.
    assert {REASON_CACHE, REASON_PULL, REASON_PULL_SLOWER} <= set(reasons), set(reasons)


def test_a_pull_the_fast_core_did_not_predict_can_still_be_the_one_taken() -> None:
    """Rule 2 takes pulls in plan order, each only if it beats the pick so far by the
    margin: a short prefix's source met first can be taken and then keep a long
    prefix's busy holder, met later and better by less than the margin, from being
    taken. The fast core predicts the holder first; the short prefix's group, bounded
    above the holder's pull, must still be predicted, or the holder would be picked."""
    fleet = Fleet(random.Random(5), engines=3)
    server, short, holder = fleet.names
    prompt = fleet.prompts[0][: 11 * BS]
    for name, blocks in ((short, 5), (holder, 10)):
        hs = fleet.hashes(name, prompt)[:blocks]
        fleet.index.apply(name, BlocksStored.of_ids(MEDIUM_CPU, tuple(hs), None,
                                             tuple(prompt[: blocks * BS]), BS))  # fmt: skip
    specs = {name: EngineSpec(name, f"http://{name}", "127.0.0.1", 5710)
             for name in fleet.names}  # fmt: skip
    config = DecideConfig(explore_every=0, pull_margin_s=0.1)
    cost = CostModel(CostPriors(prefill_s_per_token=0.01))
    policy = RouterPolicy(list(specs.values()), Mode.SHARED, fleet.index, cost=cost,
                          config=config)  # fmt: skip
    loads = {server: EngineLoad(True, 0, 0), short: EngineLoad(True, 0, 0),
             holder: EngineLoad(True, 1, 8)}  # fmt: skip
    expected = reference_plan(specs, fleet.index, cost, config, prompt, loads, 0.0,
                              serve_on=server, pull_from=None, explore_due=False)
    assert (expected.source, expected.predicted_cached_tokens) == (short, 5 * BS)
    assert policy.plan("r", prompt, loads, 0.0, serve_on=server) == expected
