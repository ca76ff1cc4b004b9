"""The invariants, checked on every live node after every tick and once at the end.

During the run (:meth:`Checker.running`):

1. Every open job is reported within its bound (:class:`~kvpeer.lab.sim.timeouts.Bounds`):
   a load within the load and abort_ack timeouts, a pin through the parent
   within the store timeout plus a fetched transfer's abort and drain, a
   producer's store within that plus the unbound-store timeout.
2. Pins: each slot's pin count equals the number of open store and serve jobs
   holding it, so a pin that outlives its job (or a missing pin) shows at once.
3. Bytes: every slot a peer wrote is, once READY, exactly ``content(key)``.
   Writes into slots not opened for the writer (the fake plane's record) count.
4. The tier's own counts agree with what it was told: open requests, consumer
   and producer ids; parked batches, tombstones, early fetches and consumer
   session entries never exceed what their timeouts allow to be alive (consumer
   entries per session: each peer's session keeps its own entry per id).
5. Held blocks (:mod:`kvpeer.lab.sim.held`, whose watcher checks each promise as
   it is made, kept and read): the copy never holds more bytes than its
   ``held_bytes``, and its pinned rows are exactly those promised to peers.

After the quiet phase (:meth:`Checker.quiet`): no job, request, pin, WRITING
slot, parked batch, tombstone, early fetch, session entry, pending write or
pinned held row is left anywhere, and every READY slot holds its key's bytes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

from kvpeer.host import SlotState
from kvpeer.lab.sim.ahead import staged_bytes_problems
from kvpeer.lab.sim.node import LOAD, STORE, Incarnation, OpenJob, SimNode
from kvpeer.lab.sim.timeouts import SimContext

__all__ = ["Checker", "unexplained_consumer_entries"]


def _describe(job_id: int, job: OpenJob) -> str:
    what = f"{job.kind} job {job_id} ({len(job.keys)} blocks"
    if job.kv_request_id is not None:
        what += f", {job.kv_request_id}"
    if job.peer_id is not None:
        what += f" from {job.peer_id}"
    return what + ")"


def unexplained_consumer_entries(
    entries: Mapping[str, int], explained: Iterable[tuple[str, str]]
) -> list[str]:
    """Our sessions holding more consumer entries than their timeouts allow.

    ``entries``: peer id -> consumer entries of our session toward it;
    ``explained``: the (peer id, kv id) pairs pulled by an open request or by one
    finished within an abort and its owed ack. Each session keeps its own entry
    per id (consumer invariant 8), so an id reused toward another peer while an
    ack toward the first is still owed has an entry in both sessions: the rule
    counts per session, never ids across sessions.
    """
    allowed = Counter(peer_id for peer_id, _ in set(explained))
    return [
        f"{count} consumer session entries toward {peer_id} but only {allowed[peer_id]} "
        "ids pulled from it are open or finished within the abort_ack timeouts"
        for peer_id, count in sorted(entries.items())
        if count > allowed[peer_id]
    ]


class Checker:
    """Runs the checks of one world; each distinct finding is reported once."""

    def __init__(self, ctx: SimContext) -> None:
        self.ctx = ctx
        self._seen: set[tuple[str, str]] = set()

    def once(self, where: str, what: str, message: str) -> None:
        if (where, what) not in self._seen:
            self._seen.add((where, what))
            self.ctx.violate(where, message)

    # -- during the run --------------------------------------------------------------

    def running(self, node: SimNode, peers: list[str], full: bool) -> None:
        live = node.live
        assert live is not None
        self._jobs(node.name, live)
        self._budgets(node.name, live)
        self._pins(node.name, live, full)
        self._held(node.name, live)
        self._written(node.name, live)
        if node.ahead is not None:
            self._ahead(node.name, live, full)
        if full:
            self._tier_counts(node, live, peers)

    def _jobs(self, where: str, live: Incarnation) -> None:
        now = self.ctx.clock.now
        for job_id, job in live.probe.open_jobs.items():
            if not job.overdue and now > job.deadline:
                job.overdue = True
                self.ctx.violate(
                    where,
                    f"{_describe(job_id, job)} unreported {now - job.submitted:.2f}s after "
                    f"submission (bound {job.deadline - job.submitted:.2f}s)",
                )

    def _budgets(self, where: str, live: Incarnation) -> None:
        """Loads from an unreachable peer end within the request budget (budgets.py)."""
        reach = self.ctx.reach
        if reach is None:
            return
        for job_id, job in live.probe.open_jobs.items():
            if job.kind == LOAD and job.peer_id is not None:
                reach.check_load(
                    live.tier, where, job_id, job.peer_id, job.kv_request_id, job.submitted
                )

    def _pins(self, where: str, live: Incarnation, full: bool) -> None:
        expected: dict[int, int] = {}
        for job in live.probe.open_jobs.values():
            if job.kind != LOAD:
                for slot in job.slots:
                    expected[slot] = expected.get(slot, 0) + 1
        pool = live.pool
        # Each tick: as many slots pinned as open jobs hold; every pin count when full.
        if pool.pinned == len(expected) and (
            not full or all(pool.pin_count(slot) == count for slot, count in expected.items())
        ):
            return
        for slot in range(pool.num_blocks):
            actual, wanted = pool.pin_count(slot), expected.get(slot, 0)
            if actual != wanted:
                self.once(
                    where,
                    f"pin {slot}",
                    f"slot {slot} is pinned {actual} times but open jobs hold it {wanted} times"
                    + (" (a pin outlived its job)" if actual > wanted else ""),
                )

    def _held(self, where: str, live: Incarnation) -> None:
        held = live.held
        if held is None:
            return
        stats = held.statistics()
        if stats.bytes > held.bound or stats.capacity_bytes > held.bound:
            self.once(
                where,
                "held bound",
                f"held blocks hold {stats.bytes} bytes (capacity {stats.capacity_bytes}), "
                f"over their held_bytes of {held.bound}",
            )
        if stats.pinned_blocks != len(held.promised):
            self.once(
                where,
                "held pins",
                f"held blocks count {stats.pinned_blocks} pinned rows, but peers were "
                f"promised {len(held.promised)} rows and hold them",
            )

    def _ahead(self, where: str, live: Incarnation, full: bool) -> None:
        """kvpeer.lab.sim.ahead checks 1 and 2: staging rows conserved, staged bytes
        right."""
        ahead = live.tier.ahead
        # An ahead fetch is a consumer entry of its session while it runs and for as
        # long after as a request's (the tier finishes it when it lands).
        now_fetching = set(ahead.fetching())
        probe = live.probe
        for ended in probe.ahead_fetching - now_fetching:
            probe.finished_sources[ended] = self.ctx.clock.now
        probe.ahead_fetching = now_fetching
        staged, fetching, free = ahead.statistics()
        if staged + fetching + free != len(ahead.rows) or not ahead.rows:
            self.once(where, "staging rows",
                      f"staging counts {staged} staged + {fetching} fetching + {free} free, "
                      f"but holds {len(ahead.rows)} rows")  # fmt: skip
        pool = live.pool
        if ahead.rows != pool.withheld:  # this host copies out of staging, never adopts
            self.once(where, "staging rows in the pool",
                      f"staging rows {sorted(ahead.rows)} are not the rows the pool "
                      f"withheld, {sorted(pool.withheld)}")  # fmt: skip
        if full:
            for problem in staged_bytes_problems(ahead, self.ctx.blocks.content, pool.view,
                                                 pool.block_len):  # fmt: skip
                self.ctx.violate(where, problem)

    def _written(self, where: str, live: Incarnation) -> None:
        pool, region = live.pool, live.region
        if region.dirty:
            view, block_len = pool.view, pool.block_len
            for slot in sorted(region.dirty):
                state = pool.state(slot)
                if state is SlotState.WRITING:
                    continue  # judged when its load reports or it turns READY
                region.dirty.discard(slot)
                key = pool.key_of(slot)
                if state is SlotState.READY and key is not None:
                    start = slot * block_len
                    if view[start : start + block_len] != self.ctx.blocks.content(key):
                        self.ctx.violate(
                            where,
                            f"READY slot {slot} (key {key.hex()[:12]}) was overwritten by a "
                            "peer with other bytes (a stale or misdirected write)",
                        )
        found = live.plane.violations
        for message in found[live.plane_violations_seen :]:
            self.ctx.violate(where, f"data plane: {message}")
        live.plane_violations_seen = len(found)

    def _tier_counts(self, node: SimNode, live: Incarnation, peers: list[str]) -> None:
        where, probe, bounds = node.name, live.probe, self.ctx.bounds
        now = self.ctx.clock.now
        stats = live.tier.statistics()
        sources = {r.source.kv_request_id for r in probe.routing.values() if r.source}
        destinations = {
            r.destination.kv_request_id for r in probe.routing.values() if r.destination
        }

        def expect(what: str, ok: bool, detail: str) -> None:
            if not ok:
                self.once(where, what, f"tier statistics: {detail}")

        expect(
            "requests",
            stats.requests == len(probe.routing),
            f"{stats.requests} requests, the host has {len(probe.routing)} open",
        )
        expect(
            "consumer_ids",
            stats.consumer_ids == len(sources),
            f"{stats.consumer_ids} consumer ids, open requests pull {len(sources)}",
        )
        expect(
            "failed_ids",
            stats.failed_ids <= stats.consumer_ids,
            f"{stats.failed_ids} failed ids outlive their {stats.consumer_ids} consumer ids",
        )
        expect(
            "producer_ids",
            stats.producer_ids == len(destinations),
            f"{stats.producer_ids} producer ids, open requests produce {len(destinations)}",
        )
        expect(
            "bound_ids",
            stats.bound_ids <= stats.producer_ids,
            f"{stats.bound_ids} bound ids outlive their {stats.producer_ids} producer ids",
        )
        young = sum(
            1
            for job in probe.open_jobs.values()
            if job.kind == STORE
            and job.kv_request_id is not None
            and now - job.submitted <= bounds.parked
        )
        expect(
            "parked",
            stats.parked_batches <= young,
            f"{stats.parked_batches} parked batches but only {young} producer stores are "
            "younger than the unbound-store timeout",
        )
        failed = probe.failed_destinations
        for kv_request_id in [k for k, t in failed.items() if now - t > bounds.tombstone]:
            del failed[kv_request_id]
        expect(
            "tombstones",
            stats.tombstones <= len(failed),
            f"{stats.tombstones} tombstones but only {len(failed)} ids had stores fail "
            "within the tombstone retention",
        )
        toward = self.ctx.loads_toward.get(node.peer_id, {})
        for kv_request_id in [k for k, t in toward.items() if now - t > bounds.early_fetch]:
            del toward[kv_request_id]
        expect(
            "early_fetches",
            stats.early_fetches <= len(toward),
            f"{stats.early_fetches} early fetches but only {len(toward)} ids were fetched "
            "from this node within a load's lifetime",
        )
        finished = probe.finished_sources
        for pulled in [k for k, t in finished.items() if now - t > bounds.consumer_entry]:
            del finished[pulled]
        entries: dict[str, int] = {}
        supplies = 0
        for peer_id in peers:
            session = live.tier.session(peer_id)
            if session is not None:
                session_stats = session.statistics()
                entries[peer_id] = session_stats.consumer.requests
                supplies += session_stats.producer.pinned_blocks
        pulling = {
            (r.source.peer_id, r.source.kv_request_id) for r in probe.routing.values() if r.source
        }
        pulling |= probe.ahead_fetching
        for problem in unexplained_consumer_entries(entries, pulling | finished.keys()):
            expect("consumer_entries", False, problem)
        pins = sum(len(job.slots) for job in probe.open_jobs.values() if job.kind != LOAD)
        if live.held is not None:
            pins += live.held.promised_pins  # supply pinned from held rows
        expect(
            "supply",
            supplies <= pins and stats.pinned_blocks <= pins,
            f"{stats.pinned_blocks} blocks of supply, open jobs and held rows pin {pins}",
        )
        if live.held is not None:
            held = live.held.statistics()
            expect(
                "held",
                (stats.held_blocks, stats.held_bytes) == (held.blocks, held.bytes),
                f"{stats.held_blocks} held blocks of {stats.held_bytes} bytes, the copy "
                f"holds {held.blocks} of {held.bytes}",
            )

    # -- after the quiet phase ---------------------------------------------------------

    def quiet(self, node: SimNode, peers: list[str], stale: frozenset[str] = frozenset()) -> None:
        """``stale``: peers toward which ``node`` holds a half-open session (the peer
        forgot it): what such a session holds is judged after the reunion, which
        must mend it (kvpeer.lab.sim.reunion)."""
        live = node.live
        assert live is not None
        where = node.name
        for job_id, job in live.probe.open_jobs.items():
            self.ctx.violate(where, f"{_describe(job_id, job)} was never reported")
        host = live.host.statistics()
        leftovers = {
            "promotions in flight": host.promotions_in_flight,
            "cascades in flight": host.cascades_in_flight,
            "serve jobs in flight": host.serve_jobs_in_flight,
            "queued promotion keys": host.queued_promotion_keys,
            "pending writes": host.pending_writes,
            "open requests": host.open_requests,
            "open serve requests": host.open_serve_requests,
            "deferred finishes": host.deferred_finishes,
            "pinned slots": host.pool.pinned,
            "WRITING slots": host.pool.writing,
        }
        tier = live.tier.statistics()
        for name in (
            "requests",
            "consumer_ids",
            "producer_ids",
            "failed_ids",
            "bound_ids",
            "parked_ids",
            "parked_batches",
            "tombstones",
            "early_fetches",
            "loads_in_flight",
            "transfers_in_flight",
            "pinned_blocks",
            "results_pending",
        ):
            leftovers[f"tier {name}"] = getattr(tier, name)
        for peer_id in peers:
            session = live.tier.session(peer_id)
            if session is None or peer_id in stale:
                continue
            stats = session.statistics()
            leftovers[f"session {peer_id} consumer entries"] = stats.consumer.requests
            leftovers[f"session {peer_id} producer entries"] = stats.producer.requests
            leftovers[f"session {peer_id} open store jobs"] = stats.producer.store_jobs_open
            leftovers[f"session {peer_id} queued lookup keys"] = stats.producer.lookups_queued
            leftovers[f"session {peer_id} queued messages"] = stats.queued_messages
            leftovers[f"data plane slots open for {peer_id}"] = len(
                live.plane.open_slots_for(peer_id)
            )
        leftovers["data plane pending writes"] = len(live.plane.pending)
        staged, fetching, _ = live.tier.ahead.statistics()
        leftovers["staged blocks"] = staged
        leftovers["blocks being fetched into staging"] = fetching
        if live.held is not None:
            leftovers["pinned held rows"] = live.held.statistics().pinned_blocks
            leftovers["held pins promised to peers"] = live.held.promised_pins
        leftovers["host pending work"] = int(live.host.has_pending_work())
        for name, count in leftovers.items():
            if count:
                self.ctx.violate(where, f"after the quiet phase: {name} = {count}")
        pool = live.pool
        view, block_len = pool.view, pool.block_len
        for slot in range(pool.num_blocks):
            key = pool.key_of(slot)
            if key is not None and pool.state(slot) is SlotState.READY:
                start = slot * block_len
                if view[start : start + block_len] != self.ctx.blocks.content(key):
                    self.ctx.violate(where, f"READY slot {slot} holds wrong bytes at the end")

    @staticmethod
    def half_open(nodes: list[SimNode]) -> dict[str, frozenset[str]]:
        """Per node: the peers it holds a ready session toward that hold no ready
        session toward it."""
        live = {node.peer_id: node.live for node in nodes if node.live is not None}
        found: dict[str, frozenset[str]] = {}
        for peer_id, mine in live.items():
            stale = set()
            for other_id, other in live.items():
                ours = mine.tier.session(other_id)
                theirs = other.tier.session(peer_id)
                if ours is not None and ours.ready and (theirs is None or not theirs.ready):
                    stale.add(other_id)
            found[peer_id] = frozenset(stale)
        return found

    def sessions(self, nodes: list[SimNode], ghost: str) -> None:
        """After the quiet phase every session a node holds is ready, toward a live
        node that holds a ready one toward it: none waits on a dead, silent or
        nonexistent peer, and none is half-open (its peer forgot it)."""
        live = {node.peer_id: node.live for node in nodes if node.live is not None}
        for node in nodes:
            if node.live is None:
                continue
            tier = node.live.tier
            held = 0
            for peer_id in [*(n.peer_id for n in nodes if n is not node), ghost]:
                session = tier.session(peer_id)
                if session is None:
                    continue
                held += 1
                other = live.get(peer_id)
                if other is None:
                    problem = "toward a node that is down or does not exist"
                elif not session.statistics().ready:
                    problem = "still in its handshake"
                elif (back := other.tier.session(node.peer_id)) is None or not back.ready:
                    problem = "half-open: the peer holds no ready session toward us"
                else:
                    continue
                self.ctx.violate(node.name, f"after the quiet phase: session {peer_id} {problem}")
            sessions = tier.statistics().sessions
            if sessions != held:
                self.ctx.violate(
                    node.name, f"after the quiet phase: {sessions} sessions, {held} toward peers"
                )
