"""The fleet model's event loop: a trace's requests through a policy to simulated engines.

Rules:

1. Policies ``load``, ``affinity`` and ``kvpeer`` are the router's own objects, as
   ``kvpeer router --policy load|affinity|pull`` builds them (``router.app``):
   :class:`~kvpeer.router.loadonly.LoadOnlyPolicy`, or
   :class:`~kvpeer.router.decide.RouterPolicy` over a
   :class:`~kvpeer.router.index.PrefixIndex` and a
   :class:`~kvpeer.router.cost.CostModel` with the product's priors (only
   ``step_tokens`` set, as ``--engine-step-tokens`` sets it). The model calls
   ``plan``, ``on_sent`` and ``on_outcome`` as the router's edge does, with the loads
   the edge would report, and feeds the index the engines' KV events ``event_delay_s``
   after they happen. Nothing of the decision is re-implemented here.
2. A pull is the tier's: the consumer asks the named source when the request reaches
   the head of its queue; the source answers at its next step boundary with what its
   CPU tier holds *then*; the blocks cross the network (:class:`Network`, queued per
   NIC), land in the consumer's CPU tier, are loaded over PCIe, and the request waits
   out :data:`~kvpeer.router.cost.CONSUMER_PULL_STEPS` of the consumer's steps. With
   ``held_sync`` (tiers serving held blocks, engines running kvpeer's connector) the
   source answers at once and the consumer waits out no step.
2a. Pulling ahead (``ahead``, the router's default for a kvpeer tier:
   ``EngineSpec.pulls_ahead``, ``kvpeer.router.ahead``, ``kvpeer.node.ahead``): when
   the router sends a request with a source, the consumer's tier asks the source *then*
   for the blocks it holds beyond the consumer's own prefix at that moment (the source
   answering as in rule 2), and stages them as they land. When the request reaches the
   head of its queue its lookup takes the staged blocks: at once if they have landed,
   else when they land (it is parked meanwhile); they are copied in (a load) with no
   step of the consumer's. A prefix the consumer came to hold itself meanwhile is not
   taken from staging (the bytes were moved all the same). Staging is not bounded.
3. Bounds: ``infinite`` and ``pooled`` place by load (the router's load policy) and
   look every prompt up in one cache shared by the fleet (infinite, or all engines'
   CPU tiers pooled, LRU); a hit costs only its transfer and PCIe load (no queueing,
   no engine cache, no step): the most any placement and tier could realise.
4. Deterministic: the same trace, spec and seed give the same result, except the
   measured router CPU time.
4a. A request reaches its engine ``GpuModel.request_overhead_s`` after the router
   placed it (the HTTP hops, the engine's tokenisation), and that is part of its TTFT.
4b. With ``GpuModel.host_cores`` set, every engine shares one host's cores with the
   front end (:mod:`~kvpeer.lab.fleet.hostcpu`): its steps stretch with what else runs,
   and a request first spends ``frontend_s_per_request`` of CPU in its engine's front
   end (one at a time per engine), then the overhead of 4a.
5. Diagnostics read the router's own view and change nothing: for each plan, what its
   index said the best CPU-tier holder had (asked outside the timed decision, after it)
   against the reuse the request realised, grouped by the plan's reason.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from random import Random

from kvpeer.lab.fleet.engine import PULL_STEPS, EngineHost, Fetched, Job, SimEngine
from kvpeer.lab.fleet.hostcpu import FrontEnd, HostCpu
from kvpeer.lab.fleet.link import Network
from kvpeer.lab.fleet.lru import BlockLru
from kvpeer.lab.fleet.params import LINKS, GpuModel
from kvpeer.lab.trace.mooncake import TraceRequest
from kvpeer.lab.trace.tokens import BlockTokens
from kvpeer.router.cost import CostModel, CostPriors
from kvpeer.router.decide import DecideConfig, RouterPolicy
from kvpeer.router.feed import StreamSynced
from kvpeer.router.index import MEDIUM_CPU, PrefixIndex
from kvpeer.router.kvevents import KVEvent
from kvpeer.router.loadonly import LoadOnlyPolicy
from kvpeer.router.policy import EngineLoad, EngineSpec, Mode, Outcome, Policy

__all__ = ["BOUNDS", "POLICIES", "FleetResult", "FleetSpec", "engine_names", "run_fleet"]

POLICIES = ("load", "affinity", "kvpeer")
BOUNDS = ("pooled", "infinite")


@dataclass(frozen=True, slots=True)
class FleetSpec:
    engines: int = 8
    policy: str = "kvpeer"
    link: str = "rdma"
    seed: int = 0
    slo_s: float = 2.0  # TTFT service-level objective for goodput
    event_delay_s: float = 0.01  # ASSUMPTION: engine step -> router index
    #: every tier serves held blocks and every engine runs kvpeer's connector: a pull
    #: waits for no step of its source and costs its consumer none (EngineSpec's
    #: ``serves_held`` and ``sync_pulls``, told to the router as an operator would)
    held_sync: bool = False
    #: the consumer's tier pulls ahead (rule 2a): the router's prefetch starts a pull
    #: when it sends the request (``EngineSpec.pulls_ahead``)
    ahead: bool = False
    gpu: GpuModel = field(default_factory=GpuModel)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES + BOUNDS:
            raise ValueError(f"policy {self.policy!r} is not one of {POLICIES + BOUNDS}")
        if self.link not in LINKS:
            raise ValueError(f"link {self.link!r} is not one of {tuple(LINKS)}")
        if self.engines < 1:
            raise ValueError(f"engines must be >= 1, not {self.engines}")


@dataclass(frozen=True, slots=True)
class FleetResult:
    spec: FleetSpec
    requests: int
    ttfts: tuple[float, ...]  # per request, in trace order
    blocks: int  # full prompt blocks over every request
    local_blocks: int  # found in the serving engine's own GPU cache or CPU tier
    fetched_blocks: int  # pulled from a peer, or from a bound's pool
    bytes_moved: int
    pulls: int
    duration_s: float  # first arrival to last finish
    router_cpu_s: float  # process CPU in plan/on_sent/on_outcome
    decisions: int
    plan_reasons: dict[str, float]
    #: per plan reason: plans, mean predicted and actual TTFT, and the blocks a peer's
    #: CPU tier held (as the router's index saw it at the decision) beyond what the
    #: request then reused (rule 6)
    by_reason: dict[str, dict[str, float]] = field(default_factory=dict)
    cost_rates: dict[str, float] = field(default_factory=dict)  # the learned model, at the end

    @property
    def reuse(self) -> float:
        return (self.local_blocks + self.fetched_blocks) / self.blocks if self.blocks else 0.0


@dataclass(frozen=True, slots=True)
class _Staged:
    """A pull ahead under way or landed (rule 2a)."""

    held: int  # prefix blocks in all once it is in
    local: int  # what the consumer held itself when it started
    arrives: float


def engine_names(engines: int) -> list[str]:
    """The engines' names, ``e000`` on (the seed shuffles their order, rule 4)."""
    return [f"e{i:03d}" for i in range(engines)]


class _World(EngineHost):
    def __init__(self, spec: FleetSpec, requests: Sequence[TraceRequest],
                 policy: Policy | None = None) -> None:  # fmt: skip
        self.spec = spec
        self.requests = requests
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[float], None]]] = []
        self._seq = 0
        gpu = spec.gpu
        bt = requests[0].block_tokens if requests else 512
        self._bt = bt
        self._tokens = BlockTokens(bt, seed=spec.seed)
        names = engine_names(spec.engines)
        Random(spec.seed).shuffle(names)  # which engine wins a tie is the seed's
        bound = spec.policy in BOUNDS
        self.index: PrefixIndex | None = None
        specs = [EngineSpec(n, f"http://{n}:8000", n, 5710, serves_held=spec.held_sync,
                            sync_pulls=spec.held_sync, pulls_ahead=spec.ahead)
                 for n in names]  # fmt: skip
        self.policy: Policy
        if spec.policy in ("affinity", "kvpeer"):
            self.index = PrefixIndex(block_size=bt)
            for n in names:
                self.index.apply(n, StreamSynced())
            self.policy = RouterPolicy(
                specs, Mode.SHARED, self.index,
                cost=CostModel(CostPriors(step_tokens=gpu.step_tokens)),
                config=DecideConfig(pulls=spec.policy == "kvpeer"),
            )
        else:
            self.policy = LoadOnlyPolicy(specs, Mode.SHARED)
        if policy is not None:  # a test's scripted decisions
            self.policy = policy
        self._staged: dict[str, _Staged] = {}
        self.cpu: HostCpu | None = None
        if gpu.host_cores > 0:  # rule 4b
            self.cpu = HostCpu(gpu.host_cores, gpu.frontend_s_per_token, gpu.co_run_slowdown,
                               gpu.scheduler_cores)
        self.engines = {
            n: SimEngine(n, gpu, self, block_tokens=bt, local_caches=not bound,
                         events=self.index is not None, cpu=self.cpu)
            for n in names
        }
        self._front: dict[str, FrontEnd] = {}
        if self.cpu is not None and gpu.frontend_s_per_request > 0:
            self._front = {n: FrontEnd(self.cpu, gpu.frontend_s_per_request, self.schedule)
                           for n in names}  # fmt: skip
        cpu_blocks = int(gpu.cpu_tier_bytes // (gpu.kv_bytes_per_token * bt))
        self.pool: BlockLru | None = None
        if bound:
            self.pool = BlockLru(None if spec.policy == "infinite" else cpu_blocks * spec.engines)
        self.network = Network(LINKS[spec.link])
        self._in_flight = dict.fromkeys(names, 0)
        self._queued = dict.fromkeys(names, 0)
        self.loads = {n: EngineLoad(True, 0, 0) for n in names}
        self.ttft: dict[str, float] = {}
        self.jobs: list[Job] = []
        self.router_cpu_s = 0.0
        self.pulls = 0
        self.last_finish = 0.0
        self.plans: dict[str, tuple[str, float, int]] = {}  # reason, predicted TTFT, held

    # --- EngineHost ---------------------------------------------------------------------

    def schedule(self, at: float, action: Callable[[float], None]) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (at, self._seq, action))

    def block_tokens(self, block: int) -> tuple[int, ...]:
        return self._tokens.block(block)

    def publish(self, engine: str, events: list[KVEvent]) -> None:
        index = self.index
        if index is None or not events:
            return

        def deliver(_: float) -> None:
            for event in events:
                index.apply(engine, event)

        self.schedule(self.now + self.spec.event_delay_s, deliver)

    def fetch(self, engine: SimEngine, job: Job, local: int, now: float) -> Fetched:
        blocks = job.request.full_blocks
        usable = max(0, job.prompt - 1) // self._bt
        kv = self.spec.gpu.kv_bytes_per_token * self._bt
        if self.pool is not None:  # rule 3
            hit = self.pool.prefix(blocks, usable)
            if hit <= 0:
                return Fetched(0, now)
            self.pool.touch(blocks[:hit])
            self.network.bytes_moved += hit * kv
            ready = (now + self.network.link.transfer_s(hit * kv)
                     + self.spec.gpu.load_s(hit * self._bt))
            return Fetched(hit, ready)
        staged = self._staged.pop(job.rid, None)
        if staged is not None:  # rule 2a
            if staged.held <= local:
                return Fetched(local, now)
            landed = max(now, staged.arrives)
            pulled = blocks[: staged.held]
            self.schedule(landed, lambda _: engine.stored_pulled(pulled))
            return Fetched(staged.held,
                           landed + self.spec.gpu.load_s((staged.held - local) * self._bt))
        source = self.engines.get(job.source or "")
        if source is None or source is engine:
            return Fetched(local, now)
        held = source.cpu_tier.prefix(blocks, usable)
        if held <= local:
            return Fetched(local, now)
        source.cpu_tier.touch(blocks[:held])
        tokens = (held - local) * self._bt
        window = now if self.spec.held_sync else source.next_window(now)
        arrived = self.network.transfer(source.name, engine.name, tokens * kv // self._bt,
                                        window)
        self.pulls += 1
        pulled = blocks[:held]
        self.schedule(arrived, lambda _: engine.stored_pulled(pulled))
        steps = 0 if self.spec.held_sync else PULL_STEPS
        return Fetched(held, arrived + self.spec.gpu.load_s(tokens), steps)

    def _pull_ahead(self, job: Job, now: float) -> None:
        """Rule 2a: the router's prefetch, sent with the request."""
        engine = self.engines[job.engine]
        source = self.engines.get(job.source or "")
        if source is None or source is engine:
            return
        blocks = job.request.full_blocks
        usable = max(0, job.prompt - 1) // self._bt
        local = max(engine.gpu_cache.prefix(blocks, usable), engine.cpu_tier.prefix(blocks, usable))
        held = source.cpu_tier.prefix(blocks, usable)
        if held <= local:
            return
        source.cpu_tier.touch(blocks[:held])
        kv = self.spec.gpu.kv_bytes_per_token * self._bt
        window = now if self.spec.held_sync else source.next_window(now)
        arrives = self.network.transfer(source.name, engine.name, (held - local) * kv, window)
        self.pulls += 1
        self._staged[job.rid] = _Staged(held, local, arrives)

    def first_token(self, job: Job, now: float) -> None:
        self.ttft[job.rid] = now - job.arrival
        self._queued[job.engine] -= job.prompt
        self._load(job.engine)
        if self.pool is not None:
            self.pool.insert(job.request.full_blocks)

    def finished(self, job: Job, now: float) -> None:
        self._in_flight[job.engine] -= 1
        self._load(job.engine)
        self.last_finish = max(self.last_finish, now)
        if self.spec.policy in BOUNDS:
            return
        outcome = Outcome(job.rid, job.engine, True, job.prompt, job.cached_tokens,
                          self.ttft[job.rid])
        started = time.process_time()
        self.policy.on_outcome(outcome, now)
        self.router_cpu_s += time.process_time() - started

    # --- the loop -----------------------------------------------------------------------

    def _load(self, engine: str) -> None:
        self.loads[engine] = EngineLoad(True, self._in_flight[engine], self._queued[engine])

    def _arrive(self, i: int, now: float) -> None:
        request = self.requests[i]
        rid = f"r{i}"
        prompt = self._tokens.prompt(request) if self.index is not None else ()
        started = time.process_time()
        plan = self.policy.plan(rid, prompt, self.loads, now)
        self.policy.on_sent(rid, plan, prompt, now)
        self.router_cpu_s += time.process_time() - started
        job = Job(rid, request, now, plan.engine, source=plan.source)
        self.jobs.append(job)
        held = 0
        if self.index is not None:
            keys = self.index.keys(prompt)
            usable = max(0, request.input_length - 1) // self._bt
            held = min(usable, max(self.index.prefixes(keys, MEDIUM_CPU, now).values(),
                                   default=0) // self._bt)
        self.plans[rid] = (plan.reason, plan.predicted_ttft_s or 0.0, held)
        self._in_flight[plan.engine] += 1
        self._queued[plan.engine] += request.input_length
        self._load(plan.engine)
        if self.spec.ahead and self.pool is None:
            self._pull_ahead(job, now)
        engine = self.engines[plan.engine]
        overhead = self.spec.gpu.request_overhead_s  # rule 4a

        def queue(t: float) -> None:
            if overhead > 0:
                self.schedule(t + overhead, lambda t: engine.submit(job, t))
            else:
                engine.submit(job, t)

        front = self._front.get(plan.engine)
        if front is not None:  # rule 4b
            front.submit(queue, now)
        else:
            queue(now)

    def run(self) -> None:
        for i, request in enumerate(self.requests):
            self.schedule(request.timestamp_ms / 1000.0, partial(self._arrive, i))
        heap = self._heap
        while heap:
            at, _, action = heapq.heappop(heap)
            self.now = at
            action(at)


def run_fleet(spec: FleetSpec, requests: Sequence[TraceRequest], *,
              policy: Callable[[Sequence[str]], Policy] | None = None) -> FleetResult:
    """Send ``requests`` (timestamps already scaled) through ``spec``'s fleet.

    ``policy`` (tests only): made from the engines' names, it decides instead of the
    policy ``spec`` names (the index, events and engines are ``spec``'s)."""
    scripted = None if policy is None else policy(engine_names(spec.engines))
    world = _World(spec, requests, scripted)
    world.run()
    jobs = world.jobs
    reasons: dict[str, float] = {}
    rates: dict[str, float] = {}
    if isinstance(world.policy, RouterPolicy):
        reasons = {k.split(":", 1)[1]: v for k, v in world.policy.stats().items()
                   if k.startswith("plans_by_reason:") and v}
        rates = _summarised(world.policy.cost.rates())
    first = requests[0].timestamp_ms / 1000.0 if requests else 0.0
    return FleetResult(
        spec=spec,
        requests=len(jobs),
        ttfts=tuple(world.ttft[job.rid] for job in jobs),
        blocks=sum(len(job.request.full_blocks) for job in jobs),
        local_blocks=sum(job.local_blocks for job in jobs),
        fetched_blocks=sum(job.fetched_blocks for job in jobs),
        bytes_moved=world.network.bytes_moved,
        pulls=world.pulls,
        duration_s=world.last_finish - first,
        router_cpu_s=world.router_cpu_s,
        decisions=len(jobs),
        plan_reasons=reasons,
        by_reason=_by_reason(world),
        cost_rates=rates,
    )


def _by_reason(world: _World) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for job in world.jobs:
        plan = world.plans.get(job.rid)
        if plan is None or not plan[0]:
            continue
        reason, predicted, held = plan
        row = out.setdefault(reason, {"plans": 0.0, "predicted_ttft_s": 0.0,
                                      "actual_ttft_s": 0.0, "unused_held_blocks": 0.0})
        row["plans"] += 1
        row["predicted_ttft_s"] += predicted
        row["actual_ttft_s"] += world.ttft[job.rid]
        row["unused_held_blocks"] += max(0, held - job.local_blocks - job.fetched_blocks)
    for row in out.values():
        row["predicted_ttft_s"] /= row["plans"]
        row["actual_ttft_s"] /= row["plans"]
    return out


def _summarised(rates: dict[str, float]) -> dict[str, float]:
    """The fleet-wide lines, and the mean of the per-source pull lines."""
    out = {k: v for k, v in rates.items() if ":" not in k or k.endswith(":*")}
    for name in ("pull_base_s", "pull_s_per_token"):
        values = [v for k, v in rates.items() if k.startswith(name + ":")]
        if values:
            out[name + ":mean"] = sum(values) / len(values)
    return out

