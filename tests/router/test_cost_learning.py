"""What each pull's residual teaches the cost model (router/cost.py's docstring): the
pooled pull line for sources with few pulls, busy costs per source, the cold penalty."""

from __future__ import annotations

import pytest

from kvpeer.router.cost import CostModel
from kvpeer.router.metrics import _policy_metrics
from kvpeer.router.policy import EngineLoad

IDLE = EngineLoad(healthy=True, in_flight=0, queued_prompt_tokens=0)
BUSY = EngineLoad(healthy=True, in_flight=1, queued_prompt_tokens=0)


def warm(cost: CostModel, engine: str, source: str) -> None:
    """The pair's first pull: it teaches the cold penalty only."""
    cost.observe_pull(engine, source, 100, IDLE, cost.pull_s(engine, source, 100, IDLE))


def test_a_source_with_few_pulls_is_quoted_the_fleets_pooled_pull_line() -> None:
    """In a fleet each source is pulled from rarely: a source is judged by every
    source's pulls until it has ``own_samples`` of its own."""
    cost = CostModel()
    prior = cost.pull_quote_s("never-pulled", 1000, IDLE)[0]
    warm(cost, "c", "s1")
    for i in range(40):
        n = 200 + 50 * i
        cost.observe_pull("c", "s1", n, IDLE, 0.05 + 2e-4 * n)  # 10x the prior's rate
    truth = 0.05 + 2e-4 * 1000
    learned = cost.pull_quote_s("s1", 1000, IDLE)[0]
    assert learned == pytest.approx(truth, rel=0.1)
    assert cost.pull_quote_s("never-pulled", 1000, IDLE)[0] == pytest.approx(learned)
    assert truth > 3 * prior
    # Once a source has its own history, its own line quotes it.
    warm(cost, "c", "s2")
    for i in range(cost.priors.own_samples):
        n = 200 + 50 * i
        cost.observe_pull("c", "s2", n, IDLE, 0.01 + 1e-5 * n)
    assert cost.pull_quote_s("s2", 1000, IDLE)[0] < 0.5 * truth
    assert "pull_base_s:*" in cost.rates()
    assert cost.pull_floor_s() <= cost.pull_quote_s("s2", 0, IDLE)[0]


def test_one_slow_busy_source_does_not_raise_the_busy_cost_of_sources_seen_busy() -> None:
    """docs/fleet.md finding 5: one holder's queued NIC taught a fleet-wide busy cost
    and turned every pull down. A source seen busy is quoted its own."""
    cost = CostModel()
    for source in ("slow", "fast"):
        warm(cost, "c", source)
    fast_quote = cost.pull_quote_s("fast", 500, BUSY)[0]
    cost.observe_pull("c", "fast", 500, BUSY, fast_quote)  # as quoted: nothing extra
    fast_before = cost.busy_s("fast")
    for _ in range(20):
        cost.observe_pull("c", "slow", 500, BUSY, 3.0)
    assert cost.busy_s("slow") > 2.0
    assert cost.busy_s("fast") == fast_before
    assert cost.pull_quote_s("fast", 500, BUSY)[0] == pytest.approx(fast_quote, abs=0.01)
    # A source never seen busy gets the fleet's, which did learn.
    assert cost.busy_s("unseen") == cost.rates()["source_busy_s"] > 1.0
    assert cost.rates()["source_busy_own_s:slow"] == cost.busy_s("slow")


def test_a_source_that_serves_without_its_engine_is_quoted_and_taught_by_its_line() -> None:
    """A held (or parked) pull from a busy source is quoted its line alone and teaches
    the line; a busy source that served with its engine teaches only the busy cost."""
    cost = CostModel()
    warm(cost, "c", "engine-bound")
    warm(cost, "c", "held")
    for _ in range(10):
        cost.observe_pull("c", "engine-bound", 800, BUSY, 2.0)
    assert "pull_base_s:engine-bound" not in cost.rates()  # the line learned nothing
    assert cost.busy_s("engine-bound") > 1.0
    for i in range(30):
        n = 200 + 60 * i
        cost.observe_pull("c", "held", n, BUSY, 0.02 + 1e-4 * n, held=True)
    assert "source_busy_own_s:held" not in cost.rates()
    for n in (300, 1000, 2000):
        idle_quote = cost.pull_quote_s("held", n, IDLE)[0]
        assert idle_quote == cost.pull_quote_s("held", n, BUSY, held=True)[0]
        assert idle_quote == pytest.approx(0.02 + 1e-4 * n, rel=0.2)
    parked = cost.pull_quote_s("held", 1000, BUSY, parked=True)[0]
    assert parked == cost.pull_quote_s("held", 1000, IDLE)[0]


def test_a_first_pull_teaches_the_cold_penalty_and_not_the_line() -> None:
    cost = CostModel()
    cost.observe_pull("c", "s", 1000, IDLE, 1.5)
    assert "pull_base_s:s" not in cost.rates()
    assert cost.rates()["cold_session_s"] > cost.priors.cold_session_s
    assert cost.is_warm("c", "s")
    warm_quote, cold_quote = cost.pull_quote_s("s", 1000, IDLE)
    assert cold_quote - warm_quote == pytest.approx(cost.rates()["cold_session_s"])


def test_every_sources_busy_cost_relaxes_toward_the_prior_at_one_half_life() -> None:
    cost = CostModel()
    prior = cost.priors.source_busy_s
    half = cost.priors.stale_half_life_s
    for source in ("a", "b"):
        warm(cost, "c", source)
    for _ in range(20):
        cost.observe_pull("c", "a", 100, BUSY, 2.0)
        cost.observe_pull("c", "b", 100, BUSY, 1.0)
    a, b = cost.busy_s("a"), cost.busy_s("b")
    cost.relax(0.0)  # the clock starts
    cost.relax(half)
    assert cost.busy_s("a") == pytest.approx(prior + (a - prior) / 2)
    assert cost.busy_s("b") == pytest.approx(prior + (b - prior) / 2)
    for step in range(2, 80):  # far past the scale's renormalisation (2**-30 < 1e-9)
        cost.relax(step * half)
    assert cost.busy_s("a") == pytest.approx(prior)
    # Learning after the renormalisation still moves a source's own cost.
    cost.observe_pull("c", "a", 100, BUSY, 2.0)
    assert cost.busy_s("a") > prior + 0.2


def test_the_per_source_busy_costs_and_the_pooled_line_are_exported_as_gauges() -> None:
    cost = CostModel()
    warm(cost, "c", "s")
    cost.observe_pull("c", "s", 100, BUSY, 1.0)
    cost.observe_pull("c", "s", 100, IDLE, 0.05)
    numbers = {"plans_total": 1.0} | {f"rate:{k}": v for k, v in cost.rates().items()}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in _policy_metrics(numbers) for s in family.samples}  # fmt: skip
    own = ("kvpeer_router_policy_source_busy_own_seconds", (("source", "s"),))
    assert samples[own] == pytest.approx(cost.busy_s("s"))
    assert cost.busy_s("s") > 0.1
    pooled = ("kvpeer_router_policy_pull_base_seconds", (("source", "*"),))
    assert samples[pooled] == pytest.approx(cost.rates()["pull_base_s:*"])


def test_pulls_booked_on_a_source_make_the_next_quote_wait_until_its_link_is_free() -> None:
    """docs/fleet.md finding 5: pulls from a popular holder queue on its NIC. The wait
    is the source's, not the fleet's; it drains with time; a pull's residual is learned
    net of the wait it was quoted; a restarted source's bookings are gone."""
    cost = CostModel()
    cost.relax(10.0)
    alone = cost.pull_quote_s("hot", 2000, IDLE)[0]
    transfer = alone - cost.queue_s("hot")
    assert cost.reserve_pull("hot", 2000) == 0.0
    assert cost.queue_s("hot") == pytest.approx(transfer)
    assert cost.pull_quote_s("hot", 2000, IDLE)[0] == pytest.approx(alone + transfer)
    assert cost.pull_quote_s("other", 2000, IDLE)[0] == pytest.approx(alone)
    assert cost.reserve_pull("hot", 2000) == pytest.approx(transfer)  # second in line
    cost.relax(10.0 + transfer)
    assert cost.queue_s("hot") == pytest.approx(transfer)  # the first is done
    cost.relax(11.0 + 2 * transfer)
    assert cost.queue_s("hot") == 0.0
    # Learning: a pull that took its quoted wait plus the line's time teaches the line
    # its time only.
    warm(cost, "c", "hot")
    for _ in range(30):
        cost.observe_pull("c", "hot", 2000, IDLE, transfer + 5.0, queued_s=5.0)
    assert cost.pull_quote_s("hot", 2000, IDLE)[0] == pytest.approx(transfer, rel=0.05)
    cost.reserve_pull("hot", 2000)
    assert cost.queue_s("hot") > 0.0
    cost.forget_sessions("hot")
    assert cost.queue_s("hot") == 0.0
