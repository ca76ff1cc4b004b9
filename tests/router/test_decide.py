"""Decisions of the router's policy, from what engines hold and how loaded they are."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvpeer.router.cost import CostModel, CostPriors, Line
from kvpeer.router.decide import (
    GIVE_UP_FACTOR,
    MIN_GIVE_UP_S,
    DecideConfig,
    RouterPolicy,
)
from kvpeer.router.feed import StreamSynced
from kvpeer.router.index import MEDIUM_CPU, MEDIUM_GPU, PrefixIndex
from kvpeer.router.kvevents import BlocksStored
from kvpeer.router.policy import EngineLoad, EngineSpec, Mode, Outcome, Plan, Policy, Role
from kvpeer.router.reasons import (
    REASON_CACHE,
    REASON_LOAD,
    REASON_NO_ENGINE,
    REASON_PD,
    REASON_PD_CACHED,
    REASON_PD_NO_PREFILL,
    REASON_PULL,
    REASON_PULL_EXPLORE,
    REASON_PULL_PINNED,
    REASON_PULL_SLOWER,
)

BS = 16
PROMPT = [(7 * i) % 500 for i in range(1024)]
USABLE = 1008  # vLLM computes at least the last token: 63 full blocks of 64


def spec(name: str, role: Role = Role.BOTH) -> EngineSpec:
    return EngineSpec(name, f"http://{name}", "127.0.0.1", 5710, role=role)


def idle() -> EngineLoad:
    return EngineLoad(healthy=True, in_flight=0, queued_prompt_tokens=0)


def busy(queued: int = 4000, in_flight: int = 4) -> EngineLoad:
    return EngineLoad(healthy=True, in_flight=in_flight, queued_prompt_tokens=queued)


def down() -> EngineLoad:
    return EngineLoad(healthy=False, in_flight=0, queued_prompt_tokens=0)


def hold(index: PrefixIndex, engine: str, tokens: int, medium: str, salt: int = 0) -> None:
    """The engine's events say it holds the prompt's first ``tokens`` in ``medium``."""
    index.apply(engine, StreamSynced())
    blocks = tokens // BS
    hashes = tuple(salt * 10_000 + i for i in range(blocks))
    index.apply(engine, BlocksStored.of_ids(medium, hashes, None, tuple(PROMPT[:tokens]), BS))


def shared(*names: str, config: DecideConfig | None = None) -> tuple[RouterPolicy, PrefixIndex]:
    index = PrefixIndex(block_size=BS)
    return RouterPolicy([spec(n) for n in names], Mode.SHARED, index, config=config), index


def test_router_policy_satisfies_the_edge_contract() -> None:
    policy: Policy = shared("e0")[0]
    assert policy.plan("r", PROMPT, {"e0": idle()}, 0.0).engine == "e0"


def test_nothing_cached_goes_to_the_least_loaded_engine() -> None:
    policy, _ = shared("e0", "e1")
    plan = policy.plan("r1", PROMPT, {"e0": busy(), "e1": idle()}, 0.0)
    assert (plan.engine, plan.source, plan.reason) == ("e1", None, REASON_LOAD)
    assert plan.predicted_cached_tokens == 0
    assert plan.predicted_ttft_s is not None


def test_local_prefix_attracts_the_request() -> None:
    policy, index = shared("e0", "e1")
    hold(index, "e0", 1024, MEDIUM_GPU)
    plan = policy.plan("r1", PROMPT, {"e0": idle(), "e1": idle()}, 0.0)
    assert (plan.engine, plan.source, plan.reason) == ("e0", None, REASON_CACHE)
    assert plan.predicted_cached_tokens == USABLE


def test_longer_prefix_on_a_peer_busy_decoding_is_pulled() -> None:
    policy, index = shared("e0", "e1")
    hold(index, "e1", 1024, MEDIUM_CPU)
    hold(index, "e0", 64, MEDIUM_GPU, salt=1)
    # Forty requests decoding there: its serve windows come every decode step, but a
    # prefill there would share its steps with all forty.
    plan = policy.plan("r1", PROMPT, {"e0": idle(), "e1": busy(queued=0, in_flight=40)}, 0.0)
    assert (plan.engine, plan.source, plan.reason) == ("e0", "e1", REASON_PULL)
    assert plan.predicted_cached_tokens == USABLE
    assert plan.predicted_pulled_tokens == USABLE - 64
    # The consumer is told all the source holds, the prompt's last block included:
    # kvpeer's connector loads it too and computes the last token only.
    assert plan.source_held_tokens == 1024
    # ... and when to stop waiting for the pull: about what computing it would cost e0
    idle_compute = policy.cost.compute_s("e0", USABLE - 64, idle())
    assert plan.give_up_s == pytest.approx(max(MIN_GIVE_UP_S, GIVE_UP_FACTOR * idle_compute))
    local = policy.plan("r2", PROMPT, {"e0": idle(), "e1": idle()}, 0.0, serve_on="e0")
    assert local.source is None or local.give_up_s is not None
    assert policy.plan("r3", PROMPT, {"e0": idle(), "e1": idle()}, 0.0,
                       serve_on="e1").give_up_s is None  # e1 holds it: nothing to pull


def test_the_source_held_tokens_are_what_it_holds_of_a_partly_held_prompt() -> None:
    policy, index = shared("e0", "e1")
    hold(index, "e1", 512, MEDIUM_CPU)
    plan = policy.plan("r1", PROMPT, {"e0": idle(), "e1": idle()}, 0.0, serve_on="e0",
                       pull_from="e1")  # fmt: skip
    assert (plan.engine, plan.source) == ("e0", "e1")
    assert (plan.predicted_cached_tokens, plan.source_held_tokens) == (512, 512)
    plan = policy.plan("r2", PROMPT, {"e0": idle(), "e1": idle()}, 0.0, serve_on="e1")
    assert (plan.source, plan.source_held_tokens) == (None, 0)


def test_affinity_never_plans_a_pull_the_engines_could_not_make() -> None:
    """Policy ``affinity``: engines without a peer tier. The same case as above is placed
    by the engines' own caches and load; no plan names a source."""
    policy, index = shared("e0", "e1", config=DecideConfig(pulls=False))
    hold(index, "e1", 1024, MEDIUM_CPU)
    hold(index, "e0", 64, MEDIUM_GPU, salt=1)
    for load in (busy(queued=0, in_flight=40), idle()):
        plan = policy.plan("r1", PROMPT, {"e0": idle(), "e1": load}, 0.0)
        assert plan.source is None
        assert plan.reason in (REASON_CACHE, REASON_LOAD)
    plan = policy.plan("r2", PROMPT, {"e0": idle(), "e1": idle()}, 0.0)
    assert (plan.engine, plan.reason) == ("e1", REASON_CACHE)  # the holder, not a pull


def test_a_peer_busy_prefilling_is_not_pulled_from() -> None:
    """Its engine answers our lookup only after the step prefilling its queue: computing
    here is sooner (issue 14's busy producer, where such a lookup waited 8 s)."""
    policy, index = shared("e0", "e1")
    hold(index, "e1", 1024, MEDIUM_CPU)
    plan = policy.plan("r1", PROMPT, {"e0": idle(), "e1": busy(queued=4000)}, 0.0)
    assert (plan.engine, plan.source, plan.reason) == ("e0", None, REASON_PULL_SLOWER)
    # The serve wait is the source's predicted time through its queue.
    cost = policy.cost
    wait = cost.serve_wait_s("e1", busy(queued=4000))
    priors = CostPriors()
    # One step under way: at most the step's token budget, however long the queue.
    step = priors.overhead_s + priors.step_tokens * priors.prefill_s_per_token
    assert wait == pytest.approx(step)
    assert cost.serve_wait_s("e1", busy(queued=1000)) == pytest.approx(
        priors.overhead_s + 1000 * priors.prefill_s_per_token
    )
    assert wait > cost.serve_wait_s("e1", busy(queued=0)) > 0.0
    assert cost.serve_wait_s("e1", idle()) == 0.0


def test_a_pinned_source_is_pulled_from_even_when_computing_is_predicted_faster() -> None:
    """``pull_from`` (the client's ``X-Kvpeer-Source``, with allow_pinning) compares
    tiers, not decisions: the busy source above is pulled from all the same."""
    policy, index = shared("e0", "e1", "e2")
    hold(index, "e1", 1024, MEDIUM_CPU)
    hold(index, "e2", 512, MEDIUM_CPU, salt=2)
    loads = {"e0": idle(), "e1": busy(queued=4000), "e2": idle()}
    plan = policy.plan("r1", PROMPT, loads, 0.0, serve_on="e0")
    assert (plan.source, plan.reason) == ("e2", REASON_PULL)  # the idle one, not busy e1
    plan = policy.plan("r2", PROMPT, loads, 0.0, serve_on="e0", pull_from="e2")
    assert (plan.engine, plan.source, plan.reason) == ("e0", "e2", REASON_PULL_PINNED)
    assert plan.predicted_pulled_tokens == 512
    plan = policy.plan("r3", PROMPT, loads, 0.0, serve_on="e0", pull_from="e1")
    assert (plan.engine, plan.source, plan.reason) == ("e0", "e1", REASON_PULL_PINNED)
    assert plan.predicted_cached_tokens == USABLE
    # A pinned source holding no more than the server is not pulled from.
    plan = policy.plan("r4", PROMPT, loads, 0.0, serve_on="e1", pull_from="e2")
    assert (plan.engine, plan.source) == ("e1", None)


def test_pull_predicted_slower_is_not_planned() -> None:
    policy, index = shared("e0", "e1")
    hold(index, "e1", 32, MEDIUM_CPU)  # a tiny prefix on a busy source
    plan = policy.plan("r1", PROMPT, {"e0": idle(), "e1": busy()}, 0.0)
    assert (plan.engine, plan.source, plan.reason) == ("e0", None, REASON_PULL_SLOWER)
    assert plan.predicted_cached_tokens == 0
    # the pull it passed over, as predicted (traced against the outcome by bench serve)
    assert plan.rejected_pull_ttft_s is not None
    assert plan.predicted_ttft_s is not None
    assert plan.rejected_pull_ttft_s >= plan.predicted_ttft_s
    assert plan.give_up_s is None


def test_gpu_blocks_are_not_a_pull_source() -> None:
    policy, index = shared("e0", "e1")
    hold(index, "e1", 1024, MEDIUM_GPU)  # kvpeer peers serve the CPU tier only
    plan = policy.plan("r1", PROMPT, {"e0": idle(), "e1": busy()}, 0.0)
    assert (plan.engine, plan.source) == ("e0", None)


def test_unlearned_engine_is_routed_by_load_only() -> None:
    policy, index = shared("e0", "e1")
    index.apply("e1", BlocksStored.of_ids(MEDIUM_CPU, (1,), None, tuple(PROMPT[:BS]), BS))
    index.apply("e0", StreamSynced())
    # e1 has not synced (router just restarted): its blocks neither attract nor source.
    plan = policy.plan("r1", PROMPT, {"e0": idle(), "e1": busy(queued=10)}, 0.0)
    assert (plan.engine, plan.source, plan.reason) == ("e0", None, REASON_LOAD)


def test_unhealthy_engines_are_excluded() -> None:
    policy, index = shared("e0", "e1")
    hold(index, "e1", 1024, MEDIUM_CPU)
    plan = policy.plan("r1", PROMPT, {"e0": busy(), "e1": down()}, 0.0)
    assert (plan.engine, plan.source) == ("e0", None)
    nobody = policy.plan("r2", PROMPT, {"e0": down(), "e1": down(), "x": idle()}, 0.0)
    assert (nobody.engine, nobody.reason) == ("", REASON_NO_ENGINE)


def test_engine_restart_forgets_its_affinity() -> None:
    policy, index = shared("e0", "e1")
    hold(index, "e1", 1024, MEDIUM_GPU)
    loads = {"e0": idle(), "e1": busy(queued=100, in_flight=1)}
    assert policy.plan("r1", PROMPT, loads, 0.0).engine == "e1"
    policy.on_engine_restart("e1", 1.0)
    assert policy.plan("r2", PROMPT, loads, 1.0).engine == "e0"


def test_speculative_entry_attracts_followers_until_it_expires() -> None:
    policy, index = shared("e0", "e1", config=DecideConfig(speculative_ttl_s=5.0))
    for name in ("e0", "e1"):
        index.apply(name, StreamSynced())
    plan = policy.plan("r1", PROMPT, {"e0": idle(), "e1": idle()}, 0.0)
    policy.on_sent("r1", plan, PROMPT, 0.0)
    sent_to = plan.engine
    other = "e1" if sent_to == "e0" else "e0"
    loads = {sent_to: busy(queued=100, in_flight=1), other: idle()}
    follower = policy.plan("r2", PROMPT, loads, 1.0)
    assert (follower.engine, follower.reason) == (sent_to, REASON_CACHE)
    assert policy.plan("r3", PROMPT, loads, 6.0).engine == other


def test_compute_rates_converge_from_outcomes() -> None:
    policy, _ = shared("e0")
    true_overhead, true_rate = 0.05, 1e-4
    for i in range(200):
        n = 128 + (i * 389) % 3000
        prompt = [(i + j) % 500 for j in range(n)]
        plan = policy.plan(f"r{i}", prompt, {"e0": idle()}, float(i))
        policy.on_outcome(
            Outcome(f"r{i}", "e0", True, n, 0, true_overhead + true_rate * n), float(i)
        )
        assert plan.source is None
    rates = policy.stats()
    assert rates["rate:prefill_s_per_token:e0"] == pytest.approx(true_rate, rel=0.05)
    assert rates["rate:overhead_s:e0"] == pytest.approx(true_overhead, rel=0.1)


def test_pull_rates_and_cold_session_are_learned() -> None:
    policy, index = shared("e0", "e1")
    hold(index, "e1", 1024, MEDIUM_CPU)
    loads = {"e0": idle(), "e1": idle()}
    cost = policy.cost
    assert not cost.is_warm("e0", "e1")
    for i in range(100):
        plan = policy.plan(f"r{i}", PROMPT, loads, float(i), serve_on="e0")
        assert plan.source == "e1"
        compute = cost.compute_s("e0", 1024 - USABLE, loads["e0"])
        # r0 is both engines' first request (their warm-up: not learned from), r1 the
        # pair's first pull (a cold session).
        pull = 0.002 + 1e-6 * USABLE + {0: 5.0, 1: 0.3}.get(i, 0.0)
        policy.on_outcome(
            Outcome(f"r{i}", "e0", True, 1024, USABLE, compute + pull), float(i)
        )
    assert cost.is_warm("e0", "e1")
    rates = policy.stats()
    assert rates["rate:pull_s_per_token:e1"] < 1e-5  # learned down from the 2e-5 prior
    assert rates["rate:cold_session_s"] > CostPriors().cold_session_s
    assert rates["rate:cold_session_s"] < 0.3  # the 5 s warm-up taught it nothing
    assert rates["outcomes_warmup_total"] == 1
    policy.on_engine_restart("e1", 200.0)
    assert not cost.is_warm("e0", "e1")


def test_predicted_and_actual_cached_tokens_are_recorded() -> None:
    policy, index = shared("e0")
    hold(index, "e0", 1024, MEDIUM_GPU)
    plan = policy.plan("r1", PROMPT, {"e0": idle()}, 0.0)
    policy.on_outcome(Outcome("r1", "e0", True, 1024, 992, 0.1), 0.1)
    policy.on_outcome(Outcome("ghost", "e0", True, 1024, 0, 0.1), 0.1)
    stats = policy.stats()
    assert stats["predicted_cached_tokens_total"] == plan.predicted_cached_tokens == USABLE
    assert stats["actual_cached_tokens_total"] == 992
    assert stats["cached_tokens_abs_error_total"] == USABLE - 992
    assert stats["cached_tokens_error_bucket:le=-64"] == 0
    assert stats["cached_tokens_error_bucket:le=-1"] == 1
    assert stats["outcomes_unmatched_total"] == 1
    assert stats[f"plans_by_reason:{REASON_CACHE}"] == 1
    (record,) = policy.recent_predictions()
    assert (record.predicted_cached_tokens, record.actual_cached_tokens) == (USABLE, 992)


def test_pending_plans_are_bounded() -> None:
    policy, _ = shared("e0", config=DecideConfig(max_pending=3))
    for i in range(10):
        policy.plan(f"r{i}", PROMPT, {"e0": idle()}, 0.0)
    assert policy.stats()["pending_plans"] == 3


# --- pd -------------------------------------------------------------------------------------


def pd(*specs: EngineSpec) -> tuple[RouterPolicy, PrefixIndex]:
    index = PrefixIndex(block_size=BS)
    return RouterPolicy(list(specs), Mode.PD, index), index


def test_pd_picks_least_loaded_prefill_and_decode_engines() -> None:
    policy, _ = pd(spec("p0", Role.PREFILL), spec("p1", Role.PREFILL), spec("d0", Role.DECODE),
                   spec("d1", Role.DECODE))
    loads = {"p0": busy(), "p1": idle(), "d0": busy(queued=0, in_flight=8), "d1": idle()}
    plan = policy.plan("r1", PROMPT, loads, 0.0)
    assert (plan.engine, plan.prefill_engine, plan.source, plan.reason) == (
        "d1", "p1", None, REASON_PD,
    )
    assert plan.predicted_cached_tokens == plan.predicted_pulled_tokens == USABLE


def test_pd_prefers_the_prefill_engine_holding_the_prefix() -> None:
    policy, index = pd(spec("p0", Role.PREFILL), spec("p1", Role.PREFILL), spec("d0", Role.DECODE))
    hold(index, "p0", 1024, MEDIUM_GPU)
    plan = policy.plan("r1", PROMPT, {"p0": idle(), "p1": idle(), "d0": idle()}, 0.0)
    assert plan.prefill_engine == "p0"


def test_pd_without_a_healthy_prefill_engine_is_decode_only() -> None:
    policy, _ = pd(spec("p0", Role.PREFILL), spec("d0", Role.DECODE))
    plan = policy.plan("r1", PROMPT, {"p0": down(), "d0": idle()}, 0.0)
    assert (plan.engine, plan.prefill_engine, plan.reason) == ("d0", None, REASON_PD_NO_PREFILL)


def test_pd_decode_engine_holding_everything_skips_the_prefill_leg() -> None:
    policy, index = pd(spec("p0", Role.PREFILL), spec("d0", Role.DECODE))
    hold(index, "d0", 1024, MEDIUM_GPU)
    plan = policy.plan("r1", PROMPT, {"p0": idle(), "d0": idle()}, 0.0)
    assert (plan.engine, plan.prefill_engine, plan.reason) == ("d0", None, REASON_PD_CACHED)
    assert plan.predicted_cached_tokens == USABLE


def test_pd_learns_the_prefill_leg_and_survives_a_failed_one() -> None:
    policy, _ = pd(spec("p0", Role.PREFILL), spec("d0", Role.DECODE))
    loads = {"p0": idle(), "d0": idle()}
    for i in range(80):
        n = 64 + (i * 211) % 2000
        prompt = [(i + j) % 500 for j in range(n)]
        plan = policy.plan(f"r{i}", prompt, loads, 0.0)
        assert plan.prefill_engine == "p0"
        leg = 0.01 + 5e-5 * n
        cached = plan.predicted_cached_tokens
        policy.on_outcome(Outcome(f"r{i}", "d0", True, n, cached, leg + 0.05, leg), 0.0)
    assert policy.stats()["rate:prefill_s_per_token:p0"] == pytest.approx(5e-5, rel=0.1)
    # The intercept is an extrapolation: the prior (0.02) still weighs on it after 80.
    assert policy.stats()["rate:overhead_s:p0"] == pytest.approx(0.01, abs=0.008)
    policy.plan("failed", PROMPT, loads, 0.0)
    policy.on_outcome(Outcome("failed", "d0", True, 1024, 0, 0.3, None), 0.0)
    assert policy.stats()["outcomes_failed_total"] == 0


def test_failed_outcomes_do_not_teach() -> None:
    policy, _ = shared("e0")
    policy.plan("r1", PROMPT, {"e0": idle()}, 0.0)
    before = policy.cost.compute_s("e0", 1024, idle())
    policy.on_outcome(Outcome("r1", "e0", False, 1024, None, None), 0.0)
    assert policy.cost.compute_s("e0", 1024, idle()) == before
    assert policy.stats()["outcomes_failed_total"] == 1


def test_line_fit_stays_non_negative() -> None:
    line = Line(0.02, 2e-4, x_ref=1024, weight=4, half_life=50)
    for x in range(100):
        line.observe(1000 + x, 0.0)  # an engine that reports zero time
    a, b = line.params
    assert a >= 0
    assert b > 0
    assert CostModel().pull_s("e0", "e1", 0, idle()) > 0


SANS_IO_MODULES = (
    "events", "feed", "index", "indexcore", "indexloops", "cost", "decide", "policy",
)
IO_MODULES = frozenset({"zmq", "asyncio", "time", "threading", "socket", "select", "os"})


@pytest.mark.parametrize("module", SANS_IO_MODULES)
def test_decision_core_is_sans_io(module: str) -> None:
    """Only the subscriber touches sockets or the clock; the core takes ``now``."""
    source = Path(__file__).resolve().parents[2] / "src" / "kvpeer" / "router" / f"{module}.py"
    imported: set[str] = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & IO_MODULES


def test_an_engine_without_its_own_history_is_predicted_by_the_fleets_rates() -> None:
    cost = CostModel()
    load = EngineLoad(healthy=True, in_flight=0, queued_prompt_tokens=0)
    prior = cost.compute_s("pulls-only", 1000, load)
    for i in range(40):
        n = 200 + 37 * i
        cost.observe_compute("computes", n, load, 0.05 + 1e-3 * n)
    # The engine that only pulled so far is judged by what its fleet measured, not the
    # optimistic prior (which would make every pull look slower than computing).
    assert cost.compute_s("pulls-only", 1000, load) == pytest.approx(
        cost.compute_s("computes", 1000, load), rel=0.05)
    assert cost.compute_s("pulls-only", 1000, load) > 3 * prior


def test_a_source_whose_pulls_are_slow_while_it_is_busy_is_not_pulled_from_when_busy() -> None:
    """Where engines share cores, a busy source serves pulls slowly: the router learns
    what a busy source costs and stops choosing it then, while it still pulls from the
    same source when idle."""
    policy, index = shared("e0", "e1")
    hold(index, "e1", 1024, MEDIUM_CPU)
    cost = policy.cost
    for i in range(40):
        loads = {"e0": idle(), "e1": busy(queued=0, in_flight=1) if i % 2 else idle()}
        plan = policy.plan(f"r{i}", PROMPT, loads, float(i), serve_on="e0")
        if plan.source is None:
            continue
        compute = cost.compute_s("e0", 1024 - USABLE, loads["e0"])
        pull = 0.002 + 1e-6 * USABLE + (2.0 if i % 2 else 0.0)  # busy: 2 s more
        policy.on_outcome(Outcome(f"r{i}", "e0", True, 1024, USABLE, compute + pull), float(i))
    # Learned until pulling from it busy no longer paid (then it stops being tried).
    assert policy.stats()["rate:source_busy_s"] > 10 * CostPriors().source_busy_s
    busy_plan = policy.plan("busy", PROMPT, {"e0": idle(), "e1": busy(queued=0, in_flight=1)},
                            50, serve_on="e0")
    idle_plan = policy.plan("idle", PROMPT, {"e0": idle(), "e1": idle()}, 51, serve_on="e0")
    assert busy_plan.source is None
    assert idle_plan.source == "e1"


def test_a_pd_pull_does_not_wait_for_the_prefill_engines_steps() -> None:
    """PD supply is parked by the prefill leg and served by the source's driver, so a
    busy prefill engine adds no serve wait to the decode engine's pull."""
    cost = CostModel()
    loaded = busy(queued=4000)
    symmetric = cost.pull_s("d", "p", 512, loaded)
    parked = cost.pull_s("d", "p", 512, loaded, parked=True)
    assert symmetric - parked == pytest.approx(cost.serve_wait_s("p", loaded) + cost.busy_s("p"))
    assert parked == pytest.approx(cost.pull_s("d", "p", 512, busy(queued=0), parked=True))


def test_a_pull_predicted_a_little_slower_is_explored_now_and_then() -> None:
    """Rule 6: a pessimistic estimate is put to the test, at most once every
    ``explore_every`` plans and only where the predicted loss is small."""
    policy, index = shared("e0", "e1", config=DecideConfig(explore_every=4))
    hold(index, "e1", 1024, MEDIUM_CPU)
    near = {"e0": idle(), "e1": busy(queued=500, in_flight=1)}  # pulling loses a little
    # A second apart: an explored pull books the source's link for its transfer.
    plans = [policy.plan(f"r{i}", PROMPT, near, float(i), serve_on="e0") for i in range(12)]
    assert [p.reason for p in plans] == ([REASON_PULL_SLOWER] * 3 + [REASON_PULL_EXPLORE]) * 3
    computed, explored = plans[0], plans[3]
    assert (computed.source, explored.source) == (None, "e1")
    assert explored.predicted_cached_tokens == USABLE
    assert explored.predicted_ttft_s is not None
    assert computed.predicted_ttft_s is not None
    loss = explored.predicted_ttft_s - computed.predicted_ttft_s
    assert 0 < loss <= DecideConfig().explore_max_loss_s
    assert policy.stats()["explorations_total"] == 3
    # A source so busy that pulling loses more is never tried; neither is one with
    # exploring off.
    far = {"e0": idle(), "e1": busy(queued=4000, in_flight=4)}
    assert all(policy.plan(f"f{i}", PROMPT, far, 0.0, serve_on="e0").source is None
               for i in range(12))  # fmt: skip
    never, index = shared("e0", "e1", config=DecideConfig(explore_every=0))
    hold(index, "e1", 1024, MEDIUM_CPU)
    assert all(never.plan(f"n{i}", PROMPT, near, 0.0, serve_on="e0").source is None
               for i in range(40))  # fmt: skip


def test_a_learned_busy_source_cost_relaxes_toward_its_prior_without_new_evidence() -> None:
    """Rule 7: a bad experience with a busy source is not believed for ever."""
    cost = CostModel()
    prior = cost.priors.source_busy_s
    load = busy(queued=0, in_flight=1)
    cost.observe_pull("e0", "e1", 100, idle(), 0.01)  # warms the pair
    for _ in range(20):
        cost.observe_pull("e0", "e1", 100, load, 2.0)
    learned = cost.rates()["source_busy_s"]
    assert learned > 1.0
    cost.relax(10.0)
    assert cost.rates()["source_busy_s"] == learned  # the clock starts at the first call
    cost.relax(10.0 + cost.priors.stale_half_life_s)
    assert cost.rates()["source_busy_s"] == pytest.approx(prior + (learned - prior) / 2)
    cost.relax(10.0 + 20 * cost.priors.stale_half_life_s)
    assert cost.rates()["source_busy_s"] == pytest.approx(prior, abs=1e-4)


def test_a_pull_costs_a_busy_consumer_two_of_its_steps_and_an_idle_one_nothing() -> None:
    """The trace of real chat turns: pulls were predicted well on idle consumers and
    under-predicted on busy ones, whose extra engine steps (promote, then load) are each
    a step of someone else's prefill. Those steps are now part of the prediction."""
    policy, index = shared("e0", "e1")
    hold(index, "e1", 1024, MEDIUM_CPU)
    cost = policy.cost
    idle_plan = policy.plan("r0", PROMPT, {"e0": idle(), "e1": idle()}, 0.0, serve_on="e0")
    assert cost.consumer_steps_s("e0", idle()) == 0.0
    assert (idle_plan.source, idle_plan.reason) == ("e1", REASON_PULL)
    busy_consumer = busy(queued=1500, in_flight=2)
    steps = cost.consumer_steps_s("e0", busy_consumer)
    assert steps == pytest.approx(2 * cost.serve_wait_s("e0", busy_consumer))
    assert steps > 0.2  # two steps of a 1,500-token queue at the prior rates
    cost.relax(1.0)  # as plan() does first; r0's pull, booked on e1's link, is over
    pulled = cost.pull_s("e0", "e1", USABLE, idle())
    plan = policy.plan("r1", PROMPT, {"e0": busy_consumer, "e1": idle()}, 1.0,
                       serve_on="e0", pull_from="e1")  # fmt: skip
    computed = cost.compute_s("e0", 1024 - USABLE, busy_consumer)
    assert plan.predicted_ttft_s == pytest.approx(computed + pulled + steps)
    # Learning takes the steps out again, so the pull line keeps the transfer's cost. The
    # engines' first outcomes are their warm-up and the pair's first pull its cold start:
    # neither teaches the line.
    for i in range(2):
        at = 2.0 + i  # a second apart: no pull waits for another on e1's link
        warm = policy.plan(f"w{i}", PROMPT, {"e0": idle(), "e1": idle()}, at, serve_on="e0")
        assert warm.predicted_ttft_s is not None
        policy.on_outcome(Outcome(f"w{i}", "e0", True, 1024, USABLE, warm.predicted_ttft_s),
                          at)  # fmt: skip
    heavy = busy(queued=4000, in_flight=2)
    steps = cost.consumer_steps_s("e0", heavy)
    assert steps > 0.5
    plan = policy.plan("r2", PROMPT, {"e0": heavy, "e1": idle()}, 4.0, serve_on="e0",
                       pull_from="e1")  # fmt: skip
    assert plan.predicted_ttft_s is not None
    before = cost.rates()["pull_base_s:*"]  # the pooled line: e1 is quoted it so far
    policy.on_outcome(Outcome("r2", "e0", True, 1024, USABLE, plan.predicted_ttft_s), 5.0)
    assert abs(cost.rates()["pull_base_s:*"] - before) < 0.05  # not +steps/5 (0.1 s)
    assert abs(cost.rates()["pull_base_s:e1"] - before) < 0.05


def test_a_source_that_serves_held_blocks_makes_no_pull_wait_for_its_engine() -> None:
    """Issue 27: a kvpeer tier with held blocks answers a peer from its own thread, so a
    pull from it waits for no engine step however busy it is; the same source without
    held blocks costs a pull one of its steps."""
    def plan_with(held: bool) -> Plan:
        specs = [spec("e0"), EngineSpec("e1", "http://e1", "10.0.0.2", 5710, serves_held=held)]
        index = PrefixIndex()
        policy = RouterPolicy(specs, Mode.SHARED, index)
        hold(index, "e1", 1024, MEDIUM_CPU)
        loads = {"e0": idle(), "e1": busy(queued=2000, in_flight=2)}
        return policy.plan("r", PROMPT, loads, 0.0, serve_on="e0", pull_from="e1")

    cost = CostModel()
    wait = cost.serve_wait_s("e1", busy(queued=2000, in_flight=2))
    held, waits = plan_with(True), plan_with(False)
    assert held.predicted_ttft_s is not None
    assert waits.predicted_ttft_s is not None
    assert wait > 0.3
    # ... and no busy-source cost either: that is what a busy engine adds to its pulls.
    extra = wait + cost.busy_s("e1")
    assert waits.predicted_ttft_s - held.predicted_ttft_s == pytest.approx(extra)


def test_a_consumer_running_kvpeers_connector_pays_no_extra_steps_for_a_pull() -> None:
    """Issue 27 item 4: an engine with kvpeer's manager and connector (``sync_pulls``)
    lands a pull in the step that looked it up, so a pull into it, busy or idle, is
    predicted without the two steps; learning takes none out of the residual either."""

    def plan_with(sync: bool) -> tuple[Plan, RouterPolicy]:
        consumer = EngineSpec("e0", "http://e0", "10.0.0.1", 5710, sync_pulls=sync)
        index = PrefixIndex()
        policy = RouterPolicy([consumer, spec("e1")], Mode.SHARED, index)
        hold(index, "e1", 1024, MEDIUM_CPU)
        loads = {"e0": busy(queued=1500, in_flight=2), "e1": idle()}
        return policy.plan("r", PROMPT, loads, 0.0, serve_on="e0", pull_from="e1"), policy

    (sync_plan, policy), (steps_plan, _) = plan_with(True), plan_with(False)
    busy_consumer = busy(queued=1500, in_flight=2)
    steps = policy.cost.consumer_steps_s("e0", busy_consumer)
    assert steps > 0.2
    assert policy.cost.consumer_steps_s("e0", busy_consumer, sync=True) == 0.0
    assert sync_plan.predicted_ttft_s is not None
    assert steps_plan.predicted_ttft_s is not None
    assert steps_plan.predicted_ttft_s - sync_plan.predicted_ttft_s == pytest.approx(steps)


def test_two_requests_at_once_for_one_holders_prefix_queue_on_its_link() -> None:
    """Rule 9: the second of two simultaneous pulls from one source is quoted the first's
    transfer as a wait; a second later the link is free again."""
    policy, index = shared("e0", "e1", "e2")
    hold(index, "e2", 1024, MEDIUM_CPU)
    loads = {"e0": idle(), "e1": idle(), "e2": idle()}
    first = policy.plan("a", PROMPT, loads, 5.0, serve_on="e0")
    assert (first.source, first.reason) == ("e2", REASON_PULL)
    wait = policy.cost.queue_s("e2")
    assert wait > 0.0
    second = policy.plan("b", PROMPT, loads, 5.0, serve_on="e1")
    assert first.predicted_ttft_s is not None
    assert second.predicted_ttft_s is not None
    assert second.source == "e2"  # still faster than computing: it waits its turn
    assert second.predicted_ttft_s == pytest.approx(first.predicted_ttft_s + wait)
    later = policy.plan("c", PROMPT, loads, 5.0 + 3 * wait + 1.0, serve_on="e1")
    assert later.source == "e2"
    assert later.predicted_ttft_s == pytest.approx(first.predicted_ttft_s)
