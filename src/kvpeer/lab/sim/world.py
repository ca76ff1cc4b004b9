"""A deterministic world of K engines sharing KV through kvpeer tiers.

One :class:`World` per seed. ``random.Random(seed)`` decides everything (no
other randomness, no real time, no threads): the pool geometry, the fault
profile, which requests arrive when and where (:mod:`kvpeer.lab.sim.scenarios`),
when requests finish, which transfers complete, fail or hang.

Each seed also draws the request budgets the tiers get (``peer_wait_s``,
``peer_retry_max_s``) and the transport's heartbeat (:meth:`Timeouts.drawn`),
and, from a generator of its own, which nodes keep held blocks and how many
(:mod:`kvpeer.lab.sim.held`).

Faults, each present in a seed or not, at a rate the seed picks: control
delays per link (0-0.3 s, with hiccups); slow producers, whose writes
complete only with some probability per tick, some of them *busy* (a cancel
cannot stop them); transfers that fail once started or cannot start; nodes
that die (connections to them refused) and come back later, at once on the
same address (a restart) or never; engines that stall (take no step, their
transport answers) for up to 24 ticks; partitions of one direction or both
between two nodes, for 1-40 ticks; frozen processes (SIGSTOP: no step and
no transport answer) for 1-30 ticks. What each network fault shows a node is
:mod:`kvpeer.lab.sim.sim_network`; the budgets it must keep, :mod:`kvpeer.lab.sim.budgets`.

Each tick advances the shared fake clock by 0.05-0.5 s, applies faults,
starts the requests due, then steps every live node in a random order (the
scheduler's lookups, computes and finishes, then ``TieringHost.step``), and
runs the checks of :mod:`kvpeer.lab.sim.checks`. After the last tick every fault
heals, every open request finishes and time runs on, in ticks, past every
timeout; then every live node must be empty (a session left half-open by a
partition is judged after the next phase), every live node must pull from
every other one again (:mod:`kvpeer.lab.sim.reunion`), and every session left
must be ready at both ends. Any exception a node raises, or ERROR it logs, is a
violation (a raising node is treated as crashed). A control-frame storm (far
more frames than a healthy world sends) is a violation that ends the run.

The result is deterministic for a given seed and interpreter hash seed (the
tier iterates some sets of strings); the CLI pins ``PYTHONHASHSEED``.
"""

from __future__ import annotations

import logging
import random
import traceback
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, astuple, dataclass

from kvpeer.host import SlotState
from kvpeer.lab.sim.ahead import AheadCounts, PrefetchSource, TokenBook, draw_ahead
from kvpeer.lab.sim.budgets import Reach
from kvpeer.lab.sim.checks import Checker
from kvpeer.lab.sim.held import WatchedHeld, draw_held
from kvpeer.lab.sim.node import SimNode, TierProbe
from kvpeer.lab.sim.prompts import Blocks, PromptBook
from kvpeer.lab.sim.reunion import reunite
from kvpeer.lab.sim.scenarios import GHOST_PEER, Planned, Router
from kvpeer.lab.sim.sim_network import Heartbeat, SimNetwork
from kvpeer.lab.sim.timeouts import Bounds, SimContext, Timeouts
from kvpeer.testing.clock import FakeClock
from kvpeer.testing.dataplane import Fabric

__all__ = ["HeldCounts", "SeedResult", "World", "run_seed"]

MIN_TICK, MAX_TICK = 0.05, 0.5
LONG_QUIET_TICK = 2.0  # once every job is past its deadline, only expiries are left
FULL_CHECK_EVERY = 8  # ticks between the (costlier) tier-statistics checks
SETTLE_TICKS = 10  # after the reunion: its last jobs report
# A healthy world sends at most ~2 control frames per node and tick, over 20 ticks.
STORM_WINDOW, STORM_FRAMES_PER_NODE_AND_TICK = 20, 5
# ...plus, while the reunion runs, one pull per ordered pair of live nodes at once:
# connect, connect_ack, lookup, lookup_resp, fetch, transfer_done and a ping/pong each.
# Pairs grow as nodes squared, so a per-node budget alone called a 32-node reunion
# (992 pulls in one tick) a storm.
STORM_FRAMES_PER_REUNION_PAIR = 8


class _Stopped(Exception):
    """The world is beyond repair (a control-frame storm): stop, report what was found."""


@dataclass(frozen=True, slots=True)
class SeedResult:
    seed: int
    nodes: int
    ticks: int
    violations: tuple[str, ...]
    jobs: int
    loads_ok_pd: int
    loads_ok_sym: int
    loads_failed: int
    requests: int
    deaths: int
    partitions: int = 0
    freezes: int = 0
    restarts: int = 0
    held: HeldCounts | None = None  # the world's nodes kept held blocks
    ahead: AheadCounts | None = None  # the world's nodes pulled ahead

    @property
    def loads_ok(self) -> int:
        return self.loads_ok_pd + self.loads_ok_sym

    def summary(self) -> str:
        line = (
            f"seed={self.seed} violations={len(self.violations)} jobs={self.jobs} "
            f"loads_ok={self.loads_ok} (pd={self.loads_ok_pd} sym={self.loads_ok_sym}) "
            f"loads_failed={self.loads_failed} requests={self.requests} deaths={self.deaths} "
            f"partitions={self.partitions} freezes={self.freezes} restarts={self.restarts}"
        )
        if self.held is not None:
            line = f"{line} held: {self.held.summary()}"
        return line if self.ahead is None else f"{line} ahead: {self.ahead.summary()}"


@dataclass(frozen=True, slots=True)
class HeldCounts:
    """What the held copies of one world did (``HeldStatistics``, summed over every
    incarnation of its held nodes), and the blocks written to peers from them."""

    nodes: int = 0
    kept: int = 0
    released: int = 0
    skipped: int = 0
    served: int = 0  # held rows pinned for a peer's lookup or resolve fetch
    written: int = 0  # blocks a peer received from held rows

    def __add__(self, other: HeldCounts) -> HeldCounts:
        return HeldCounts(
            *(a + b for a, b in zip(astuple(self), astuple(other), strict=True))
        )

    def summary(self) -> str:
        return " ".join(f"{name}={value}" for name, value in asdict(self).items())


class _ErrorLog(logging.Handler):
    """An ERROR logged by kvpeer during a run is a finding (WARNINGs are expected)."""

    def __init__(self, ctx: SimContext) -> None:
        super().__init__(logging.ERROR)
        self._ctx = ctx

    def emit(self, record: logging.LogRecord) -> None:
        self._ctx.violate(record.name, f"logged an error: {record.getMessage()}")


@contextmanager
def _errors_are_findings(ctx: SimContext) -> Iterator[None]:
    logger = logging.getLogger("kvpeer")
    handler = _ErrorLog(ctx)
    level = logger.level
    logger.setLevel(logging.ERROR)  # the tier's warnings are expected, and costly here
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


class World:
    """Several engines, one in-memory network and data fabric, one seed."""

    def __init__(
        self,
        seed: int,
        nodes: int = 3,
        ticks: int = 200,
        *,
        soak: bool = False,
        corrupt_loads: bool = False,
        leak_pin: bool = False,
        timeouts: Timeouts | None = None,
        tier_overrides: dict[str, float] | None = None,
        held: bool | None = None,
        held_type: type[WatchedHeld] = WatchedHeld,
        ahead: bool | None = None,
    ) -> None:
        """``ahead``: the world's nodes pull ahead (True), not (False), or as its seed
        draws it (None; kvpeer.lab.sim.ahead). ``tier_overrides``: config keys the
        tiers get instead of the seed's (a negative control: the checker still expects
        the seed's budgets). ``held``: the world keeps held blocks (True), not (False),
        or as its seed draws it (None); ``held_type``: what its nodes keep them in (a
        negative control)."""
        if nodes < 2:
            raise ValueError(f"a world needs at least 2 nodes, got {nodes}")
        self.seed = seed
        self.ticks = ticks
        self.soak = soak
        self.leak_pin = leak_pin
        self.rng = rng = random.Random(seed)
        self.clock = FakeClock()
        # Fault profile of this seed.
        self.max_delay = rng.choice((0.0, 0.02, 0.1, 0.3))
        answer = Bounds(Timeouts(), self.max_delay, MAX_TICK).answer
        # drawn even when given: the seed stays the same
        drawn = Timeouts.drawn(rng, answer, MAX_TICK)
        self.timeouts = (timeouts or drawn).overridden(**(tier_overrides or {}))
        self._pair_delay = {
            (f"n{a}:5710", f"n{b}:5710"): rng.uniform(0.0, self.max_delay)
            for a in range(nodes)
            for b in range(nodes)
            if a != b
        }
        self.death_rate = (rng.random() < (0.8 if soak else 0.4)) * rng.uniform(0.003, 0.02)
        self.fail_rate = (rng.random() < (0.7 if soak else 0.5)) * rng.uniform(0.01, 0.08)
        self.stall_rate = (rng.random() < (0.6 if soak else 0.3)) * rng.uniform(0.005, 0.03)
        self.partition_rate = (rng.random() < (0.7 if soak else 0.5)) * rng.uniform(0.01, 0.05)
        self.freeze_rate = (rng.random() < (0.5 if soak else 0.3)) * rng.uniform(0.003, 0.015)
        self.restart_rate = (rng.random() < (0.5 if soak else 0.3)) * rng.uniform(0.002, 0.01)
        self.arrival_rate = rng.uniform(0.25, 0.7)
        block_len = rng.choice((64, 128, 256))
        num_blocks = rng.randint(48, 128)
        bounds = Bounds(self.timeouts, self.max_delay, MAX_TICK)
        self.ctx = SimContext(
            self.clock, Blocks(block_len), bounds, self.clock.now, corrupt_loads=corrupt_loads
        )
        heartbeat = Heartbeat(self.timeouts.heartbeat_interval, self.timeouts.heartbeat_timeout)
        self.net = SimNetwork(self.clock, self._delay, heartbeat, random.Random(rng.random()))
        self.fabric = Fabric()
        self.nodes = [
            SimNode(i, self.ctx, self.net, self.fabric, self.timeouts, num_blocks, block_len)
            for i in range(nodes)
        ]
        for node in self.nodes:
            if rng.random() < (0.5 if soak else 0.3):
                node.slow = True
                node.complete_p = rng.uniform(0.15, 0.8)
                node.busy_p = rng.choice((0.0, 0.0, 0.1))
            node.fail_p = self.fail_rate * rng.random()
        if held is not False:
            peer_ids = [node.peer_id for node in self.nodes]
            profiles = draw_held(seed, peer_ids, block_len, always=held is True)
            for node in self.nodes:
                node.held = profiles.get(node.peer_id)
                node.held_type = held_type
        self.held_copies: list[WatchedHeld] = []  # of every incarnation
        self.prefetches: PrefetchSource | None = None
        self._prefetched: set[str] = set()  # requests the prefetching router has seen
        if ahead is not False:
            profiles_ahead = draw_ahead(seed, [n.peer_id for n in self.nodes], always=ahead is True)
            if profiles_ahead:
                book = TokenBook()
                self.prefetches = PrefetchSource(self.net, seed, book)
                for node in self.nodes:
                    node.ahead = profiles_ahead.get(node.peer_id)
                    node.tokens = book
        self.peer_ids = [node.peer_id for node in self.nodes] + [GHOST_PEER]
        self.reach = Reach(self.ctx, self.net, self.peer_ids[:-1], GHOST_PEER)
        self._others = [[p for p in self.peer_ids if p != node.peer_id] for node in self.nodes]
        self.ctx.reach = self.reach
        self._cuts: dict[tuple[str, str], int] = {}  # (from, to) -> tick it heals
        self.router = Router(rng, self.nodes, PromptBook(rng, max_blocks=min(16, num_blocks // 4)))
        self.checker = Checker(self.ctx)
        self.probes: list[TierProbe] = []
        self._planned: list[Planned] = []
        self._restarts: dict[int, int] = {}  # node index -> tick it boots again
        self._leaked = False
        self._frames: deque[int] = deque()  # frames sent per tick, last STORM_WINDOW ticks
        self.reunion_pairs = 0  # ordered pairs the reunion pulls between (set by it)
        self.requests = 0
        self.deaths = 0
        self.partitions = 0
        self.freezes = 0
        self.restarts = 0

    # -- the run ---------------------------------------------------------------------

    def run(self) -> SeedResult:
        with _errors_are_findings(self.ctx):
            for node in self.nodes:
                self._boot(node)
            total = self.ticks * (10 if self.soak else 1)
            try:
                for tick in range(total):
                    self.clock.advance(self.rng.uniform(MIN_TICK, MAX_TICK))
                    self._faults(tick)
                    self._arrivals(tick)
                    self.step(tick, full_check=tick % FULL_CHECK_EVERY == 0)
                self._quiesce(total)
            except _Stopped:
                pass
        return self._result()

    def _result(self) -> SeedResult:
        return SeedResult(
            seed=self.seed,
            nodes=len(self.nodes),
            ticks=self.ticks,
            violations=tuple(self.ctx.violations),
            jobs=sum(p.jobs for p in self.probes),
            loads_ok_pd=sum(p.loads_ok_pd for p in self.probes),
            loads_ok_sym=sum(p.loads_ok_sym for p in self.probes),
            loads_failed=sum(p.loads_failed for p in self.probes),
            requests=self.requests,
            deaths=self.deaths,
            partitions=self.partitions,
            freezes=self.freezes,
            restarts=self.restarts,
            held=self._held_counts(),
            ahead=self._ahead_counts(),
        )

    def _ahead_counts(self) -> AheadCounts | None:
        if self.prefetches is None:
            return None
        source = self.prefetches
        counts = AheadCounts(nodes=sum(node.ahead is not None for node in self.nodes),
                             sent=source.sent, refused=source.refused)  # fmt: skip
        for probe in self.probes:
            counts += AheadCounts.of(probe.tier.counters().ahead)
        return counts

    def _held_counts(self) -> HeldCounts | None:
        nodes = sum(node.held is not None for node in self.nodes)
        if not nodes:
            return None
        counts = HeldCounts(nodes=nodes)
        for copy in self.held_copies:
            stats = copy.statistics()
            counts += HeldCounts(
                0, stats.kept, stats.released, stats.skipped, stats.served, copy.written
            )
        return counts

    def step(self, tick: int, full_check: bool) -> None:
        self.net.update()
        if self.prefetches is not None:
            self.prefetches.drain()
        self.reach.update(node.peer_id for node in self.nodes if node.stalled_until > tick)
        frames = self.net.frames_sent
        live = [node for node in self.nodes if node.live is not None]
        self.rng.shuffle(live)
        for node in live:
            if node.stalled_until > tick:
                if not node.frozen and node.live is not None:
                    # A busy engine neither steps nor is judged, but its node's driver
                    # thread runs on: frames, timers, pings (not the parent's calls).
                    try:
                        node.live.tier.poll()
                    except Exception as exc:
                        self._crashed(node, f"driver poll of tick {tick}", exc)
                continue
            if node.stalled_until == tick:
                node.resume()
            try:
                node.run_requests(tick)
                assert node.live is not None
                node.live.host.step()
            except Exception as exc:
                self._crashed(node, f"step of tick {tick}", exc)
        window = self._frames
        window.append(self.net.frames_sent - frames)
        if len(window) > STORM_WINDOW:
            window.popleft()
        budget = STORM_WINDOW * STORM_FRAMES_PER_NODE_AND_TICK * len(self.nodes)
        budget += STORM_FRAMES_PER_REUNION_PAIR * self.reunion_pairs
        if sum(window) > budget:
            self.ctx.violate(
                "network",
                f"control-frame storm: {sum(window)} frames in {len(window)} ticks, "
                f"{window[-1]} in the last (the run stops here)",
            )
            raise _Stopped
        for node in self.nodes:
            if node.live is not None and node.stalled_until <= tick:
                self.checker.running(node, self._peers_of(node), full_check)

    def _quiesce(self, tick: int) -> None:
        """Finish everything, bring dead nodes back (or not), let every timeout pass."""
        for plan in self._planned:
            plan.request.done = True
        self._planned.clear()
        for sender, receiver in self._cuts:
            self.net.heal(sender, receiver)
        self._cuts.clear()
        for node in self.nodes:
            if node.live is not None and node.stalled_until >= tick:
                node.resume()  # the engine is done with its busy spell
                node.stalled_until = -1
            if node.live is not None:
                try:
                    node.finish_all()
                except Exception as exc:
                    self._crashed(node, "finish of the quiet phase", exc)
            elif self.rng.random() < 0.5:
                self._boot(node)
        bounds = self.ctx.bounds
        start = self.clock.now
        end = start + self.timeouts.settle_time() + 2 * bounds.slack
        while self.clock.now < end:
            tick += 1
            if self.clock.now < start + bounds.producer_store:
                self.clock.advance(MAX_TICK)
            else:  # every job's deadline has passed: coarser steps, looser expiry checks
                self.ctx.bounds = Bounds(self.timeouts, self.max_delay, LONG_QUIET_TICK)
                self.clock.advance(LONG_QUIET_TICK)
            self.complete_writes()
            self.step(tick, full_check=tick % FULL_CHECK_EVERY == 0)
        stale = self.checker.half_open(self.nodes)
        for node in self.nodes:
            if node.live is not None:
                self.checker.quiet(node, self._peers_of(node), stale[node.peer_id])
        tick = reunite(self, tick)
        if any(stale.values()):  # what the half-open sessions held must be gone now
            for _ in range(SETTLE_TICKS):
                if not any(n.live is not None and n.live.probe.open_jobs for n in self.nodes):
                    break
                tick += 1
                self.clock.advance(MAX_TICK)
                self.step(tick, full_check=False)
            for node in self.nodes:
                if node.live is not None:
                    self.checker.quiet(node, self._peers_of(node))
        self.checker.sessions(self.nodes, GHOST_PEER)

    # -- nodes -----------------------------------------------------------------------

    def _boot(self, node: SimNode) -> None:
        live = node.boot(self.rng.getrandbits(128).to_bytes(16, "big"))
        self.probes.append(live.probe)
        if live.held is not None:
            self.held_copies.append(live.held)
        self.reach.disturb(node.peer_id)

    def _kill(self, node: SimNode) -> None:
        node.kill()
        self.reach.disturb(node.peer_id)

    def _crashed(self, node: SimNode, during: str, exc: Exception) -> None:
        frames = traceback.extract_tb(exc.__traceback__)[-3:]
        where = " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in frames)
        self.ctx.violate(node.name, f"{type(exc).__name__} during {during}: {exc} [{where}]")
        self._kill(node)

    def _peers_of(self, node: SimNode) -> list[str]:
        return self._others[node.index]

    def _delay(self, sender: str, receiver: str) -> float:
        if not self.max_delay:
            return 0.0
        if self.rng.random() < 0.05:  # a hiccup on the link
            return self.max_delay
        return self._pair_delay.get((sender, receiver), 0.0)

    # -- faults ------------------------------------------------------------------------

    def _faults(self, tick: int) -> None:
        rng = self.rng
        for index, when in list(self._restarts.items()):
            if when <= tick:
                del self._restarts[index]
                self._boot(self.nodes[index])
        self._network_faults(tick)
        live = [node for node in self.nodes if node.live is not None]
        if len(live) > 1 and rng.random() < self.death_rate:
            victim = rng.choice(live)
            self._kill(victim)
            self.deaths += 1
            roll = rng.random()
            if roll < 0.25:  # a bounce: back before its peers noticed it was gone
                self._boot(victim)
            elif roll < 0.85:
                self._restarts[victim.index] = tick + rng.randint(3, 40)
        if live and rng.random() < self.stall_rate:
            sleeper = rng.choice(live)
            if sleeper.live is not None and sleeper.stalled_until < tick:  # resumed already
                sleeper.stalled_until = tick + rng.randint(2, 24)
                sleeper.stalled_at = self.clock.now
        if live and rng.random() < self.freeze_rate:
            frozen = rng.choice(live)
            if frozen.live is not None and frozen.stalled_until < tick:
                # SIGSTOP: some shorter than the heartbeat, some far longer.
                frozen.stalled_until = tick + rng.choice((rng.randint(1, 3), rng.randint(2, 30)))
                frozen.stalled_at = self.clock.now
                frozen.frozen = True
                self.net.freeze(frozen.peer_id)
                self.freezes += 1
        live = [node for node in self.nodes if node.live is not None]
        if live and rng.random() < self.restart_rate:
            restarted = rng.choice(live)  # the same address, a new process, at once
            self._kill(restarted)
            self._boot(restarted)
            self.restarts += 1
        if self.fail_rate and rng.random() < self.fail_rate:
            target = rng.choice(self.nodes).live
            if target is not None:
                target.plane.fail_next_writes += 1
        self.complete_writes()
        if self.leak_pin and not self._leaked and tick >= self.ticks // 2:
            self._leak_a_pin()

    def _network_faults(self, tick: int) -> None:
        """Partitions heal when due; a new one cuts one direction or both between
        two nodes (up or down), now and then for less than the heartbeat notices."""
        rng = self.rng
        for cut, heals in list(self._cuts.items()):
            if heals <= tick:
                del self._cuts[cut]
                self.net.heal(*cut)
        if not (self.partition_rate and rng.random() < self.partition_rate):
            return
        a, b = (node.peer_id for node in rng.sample(self.nodes, 2))
        roll = rng.random()
        directions = [(a, b)] if roll < 0.3 else [(b, a)] if roll < 0.6 else [(a, b), (b, a)]
        heals = tick + rng.choice((rng.randint(1, 3), rng.randint(2, 40)))
        for cut in directions:
            self._cuts[cut] = max(heals, self._cuts.get(cut, 0))
            self.net.cut(*cut)
        self.partitions += 1

    def complete_writes(self) -> None:
        rng = self.rng
        for node in self.nodes:
            live = node.live
            if live is None or not (node.slow or live.plane.pending):
                continue
            plane = live.plane
            try:
                for transfer_id, write in list(plane.pending.items()):
                    if transfer_id not in plane.pending:
                        continue
                    if not self.net.carries(node.peer_id, write.peer_id):
                        continue  # stalled by a partition or a frozen end
                    roll = rng.random()
                    if roll < node.fail_p:
                        plane.fail(transfer_id)
                    elif roll < node.fail_p + node.complete_p:
                        plane.complete(transfer_id)
                    elif roll > 1 - node.busy_p:
                        write.busy = True  # a cancel cannot stop it any more
            except Exception as exc:
                self._crashed(node, "a data-plane completion", exc)

    def _leak_a_pin(self) -> None:
        """Negative control: a pin nobody will release, as a buggy tier would leave it."""
        for node in self.nodes:
            live = node.live
            if live is None:
                continue
            pool = live.pool
            for slot in range(pool.num_blocks):
                if pool.key_of(slot) is not None and pool.state(slot) is SlotState.READY:
                    pool.pin([slot])
                    self._leaked = True
                    return

    # -- requests ----------------------------------------------------------------------

    def _arrivals(self, tick: int) -> None:
        rng = self.rng
        count = (rng.random() < self.arrival_rate) + (rng.random() < self.arrival_rate / 4)
        for _ in range(count):
            self._planned.extend(self.router.spawn(tick))
        due = [plan for plan in self._planned if plan.tick <= tick]
        if not due:
            return
        self._planned = [plan for plan in self._planned if plan.tick > tick]
        for plan in due:
            node, request = plan.node, plan.request
            if node.live is None:
                request.done = True  # the router sent it to a node that is down
                continue
            prefetches = self.prefetches
            if prefetches is not None and request.req_id not in self._prefetched:
                self._prefetched.add(request.req_id)  # the router's prefetch leaves first
                if prefetches.request_due(node.peer_id, node.ahead,
                                          request.ctx.kv_transfer_params, request.keys,
                                          self.peer_ids):  # fmt: skip
                    self._planned.append(Planned(tick + 1, node, request))
                    continue
            try:
                node.start(request)
                self.requests += 1
            except Exception as exc:
                self._crashed(node, f"new request {request.req_id}", exc)


def run_seed(
    seed: int,
    nodes: int = 3,
    ticks: int = 200,
    *,
    soak: bool = False,
    corrupt_loads: bool = False,
    leak_pin: bool = False,
    timeouts: Timeouts | None = None,
    tier_overrides: dict[str, float] | None = None,
    held: bool | None = None,
    held_type: type[WatchedHeld] = WatchedHeld,
    ahead: bool | None = None,
) -> SeedResult:
    """Build the world of ``seed``, run it, return what the checker found."""
    world = World(
        seed,
        nodes,
        ticks,
        soak=soak,
        corrupt_loads=corrupt_loads,
        leak_pin=leak_pin,
        timeouts=timeouts,
        tier_overrides=tier_overrides,
        held=held,
        held_type=held_type,
        ahead=ahead,
    )
    return world.run()
