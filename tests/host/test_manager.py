"""TieringHost: lookups and promotions, cascades, job accounting, finishes, the parent."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from kvpeer.host import BlockPool, JobKind, StepReport, StoreOutcome, TieringHost
from kvpeer.session.ports import Parent
from kvpeer.types import (
    JobResult,
    Key,
    LookupResult,
    OffloadPolicy,
    RequestContext,
    ServeRequest,
    TransferJob,
)

BLOCK = 32
HIT, PENDING, RETRY, MISS = (
    LookupResult.HIT,
    LookupResult.HIT_PENDING,
    LookupResult.RETRY,
    LookupResult.MISS,
)


def data(key: Key) -> bytes:
    return (key * BLOCK)[:BLOCK]


class DictTier:
    """An in-memory SecondaryTier: stores copy rows into a dict, loads copy them back.

    Results become reportable at the end of the step and are reported by the next
    ``get_finished_jobs`` unless ``hold`` is set;
    ``answers`` overrides lookups; ``fail`` fails every job; ``serve`` runs in the
    serve window. ``log`` records every call in order.
    """

    def __init__(
        self,
        pool: BlockPool,
        name: str,
        policy: OffloadPolicy = OffloadPolicy.CHUNK_LEVEL,
    ) -> None:
        self.pool = pool
        self.name = name
        self.policy = policy
        self.blocks: dict[Key, bytes] = {}
        self.answers: dict[Key, LookupResult] = {}
        self.hold = False
        self.fail = False
        self.busy = False
        self.serve: Callable[[Parent], None] | None = None
        self.stores: list[TransferJob] = []
        self.loads: list[TransferJob] = []
        self.looked_up: list[tuple[Key, str]] = []
        self.log: list[str] = []
        self.results: list[JobResult] = []  # not reportable before on_schedule_end
        self.reportable: list[JobResult] = []
        self.extra_results: list[JobResult] = []  # injected, to test the host's checks

    def on_new_request(self, request: RequestContext) -> OffloadPolicy:
        self.log.append(f"new {request.req_id}")
        return self.policy

    def lookup(self, key: Key, request: RequestContext) -> LookupResult:
        self.looked_up.append((key, request.req_id))
        if key in self.answers:
            return self.answers[key]
        return HIT if key in self.blocks else MISS

    def submit_store(self, job: TransferJob) -> None:
        self.log.append(f"store {job.request.req_id} {b','.join(job.keys).decode()}")
        self.stores.append(job)
        for key, slot in zip(job.keys, job.slots, strict=True):
            assert self.pool.pin_count(slot) > 0, "store from an unpinned slot"
            self.blocks[key] = self.pool.read(slot)
        self.results.append(JobResult(job.job_id, not self.fail))

    def submit_load(self, job: TransferJob) -> None:
        self.log.append(f"load {job.request.req_id} {b','.join(job.keys).decode()}")
        self.loads.append(job)
        for key, slot in zip(job.keys, job.slots, strict=True):
            if key in self.blocks and not self.fail:
                self.pool.write(slot, self.blocks[key])
        self.results.append(JobResult(job.job_id, not self.fail))

    def get_finished_jobs(self) -> list[JobResult]:
        extra, self.extra_results = self.extra_results, []
        if self.hold:
            return extra
        done, self.reportable = self.reportable, []
        return done + extra

    def serve_external_requests(self, parent: Parent) -> None:
        if self.serve is not None:
            self.serve(parent)

    def on_schedule_end(self) -> None:
        self.log.append("schedule_end")
        self.reportable += self.results
        self.results = []

    def on_request_finished(self, request: RequestContext) -> None:
        self.log.append(f"finished {request.req_id}")

    def has_pending_work(self) -> bool:
        return self.busy

    def drain_jobs(self) -> None:
        self.log.append("drain")
        self.hold = False
        self.on_schedule_end()

    def shutdown(self) -> None:
        self.log.append("shutdown")
        self.hold = False
        self.on_schedule_end()

    def finished(self) -> list[str]:
        return [entry for entry in self.log if entry.startswith("finished")]


def ctx(req_id: str) -> RequestContext:
    return RequestContext(req_id=req_id)


@pytest.fixture
def pool() -> BlockPool:
    return BlockPool(8, BLOCK)


@pytest.fixture
def tiers(pool: BlockPool) -> tuple[DictTier, DictTier]:
    return DictTier(pool, "first"), DictTier(pool, "second")


@pytest.fixture
def host(pool: BlockPool, tiers: tuple[DictTier, DictTier]) -> TieringHost:
    return TieringHost(pool, tiers)


def compute(host: TieringHost, req_id: str, keys: list[Key]) -> StoreOutcome:
    """A new request ``req_id`` computed ``keys`` and stored them."""
    host.new_request(ctx(req_id))
    return host.store(ctx(req_id), keys, [data(key) for key in keys])


class TestLookup:
    def test_primary_answers_before_the_tiers(
        self, host: TieringHost, tiers: tuple[DictTier, DictTier]
    ) -> None:
        compute(host, "r1", [b"a"])
        assert host.lookup(b"a", ctx("r1")) is PENDING  # written, not completed
        host.step()
        assert host.lookup(b"a", ctx("r1")) is HIT
        assert tiers[0].looked_up == tiers[1].looked_up == []

    def test_tier_hit_reserves_a_slot_and_promotes_once_per_tier_and_request(
        self, host: TieringHost, pool: BlockPool, tiers: tuple[DictTier, DictTier]
    ) -> None:
        first, second = tiers
        second.blocks = {b"a": data(b"a"), b"b": data(b"b")}
        host.new_request(ctx("r1"))
        host.new_request(ctx("r2"))
        assert host.lookup(b"a", ctx("r1")) is PENDING
        assert host.lookup(b"b", ctx("r1")) is PENDING
        assert host.lookup(b"a", ctx("r2")) is PENDING  # in flight: primary answers
        assert first.looked_up == [(b"a", "r1"), (b"b", "r1")]
        assert pool.statistics().writing == 2
        assert host.statistics().queued_promotion_keys == 2
        assert second.loads == []

        report = host.step()
        assert report.promotion_jobs_submitted == 1
        assert [(job.keys, job.request.req_id) for job in second.loads] == [((b"a", b"b"), "r1")]
        assert first.loads == []
        assert host.lookup(b"a", ctx("r1")) is PENDING

        host.step()
        assert host.lookup(b"a", ctx("r1")) is HIT
        assert host.lookup(b"b", ctx("r2")) is HIT
        for key in (b"a", b"b"):
            slot = pool.slot_of(key)
            assert slot is not None
            assert pool.read(slot) == data(key)

    def test_each_request_gets_its_own_load(
        self, host: TieringHost, tiers: tuple[DictTier, DictTier]
    ) -> None:
        tiers[0].blocks = {b"a": data(b"a"), b"b": data(b"b")}
        for req_id, key in [("r1", b"a"), ("r2", b"b")]:
            host.new_request(ctx(req_id))
            assert host.lookup(key, ctx(req_id)) is PENDING
        host.step()
        assert sorted(job.request.req_id for job in tiers[0].loads) == ["r1", "r2"]

    def test_retry_keeps_asking_later_tiers(
        self, host: TieringHost, tiers: tuple[DictTier, DictTier]
    ) -> None:
        first, second = tiers
        first.answers = {b"a": RETRY, b"b": RETRY, b"c": PENDING}
        second.blocks = {b"b": data(b"b")}
        host.new_request(ctx("r1"))
        assert host.lookup(b"a", ctx("r1")) is RETRY
        assert host.lookup(b"b", ctx("r1")) is PENDING  # promoted from the second tier
        assert host.lookup(b"c", ctx("r1")) is RETRY  # a tier's HIT_PENDING: ask again
        assert host.lookup(b"d", ctx("r1")) is MISS
        assert (b"a", "r1") in second.looked_up
        host.step()
        assert [job.keys for job in second.loads] == [(b"b",)]

    def test_full_primary_turns_a_tier_hit_into_a_miss(self, pool: BlockPool) -> None:
        small = BlockPool(1, BLOCK)
        tier = DictTier(small, "t")
        tier.blocks = {b"b": data(b"b")}
        host = TieringHost(small, [tier])
        compute(host, "r1", [b"a"])  # WRITING: not evictable
        host.new_request(ctx("r2"))
        assert host.lookup(b"b", ctx("r2")) is MISS
        host.step()  # a is READY now, pinned by its cascade until the result
        assert host.lookup(b"b", ctx("r2")) is MISS
        host.step()  # cascade result unpinned a: it can be evicted
        assert host.lookup(b"b", ctx("r2")) is PENDING
        assert small.statistics().evictions == 1

    def test_prefix_scan(self, host: TieringHost, tiers: tuple[DictTier, DictTier]) -> None:
        compute(host, "r0", [b"a", b"b"])
        host.step()
        tiers[0].answers = {b"c": RETRY}
        tiers[1].blocks = {b"d": data(b"d")}
        host.new_request(ctx("r1"))
        assert host.lookup_prefix([b"a", b"b"], ctx("r1")) == (2, False)
        assert host.lookup_prefix([b"a", b"b", b"x", b"c"], ctx("r1")) == (2, False)
        assert host.lookup_prefix([b"a", b"c", b"d", b"x", b"a"], ctx("r1")) == (2, True)
        assert host.lookup_prefix([b"a", b"d"], ctx("r1")) == (2, True)  # d in flight

    def test_promotion_failure_frees_the_reserved_slot(
        self, host: TieringHost, pool: BlockPool, tiers: tuple[DictTier, DictTier]
    ) -> None:
        tiers[0].blocks = {b"a": data(b"a")}
        tiers[0].fail = True
        host.new_request(ctx("r1"))
        assert host.lookup(b"a", ctx("r1")) is PENDING
        host.step()
        report = host.step()
        assert (report.jobs_finished, report.jobs_failed) == (1, 1)
        assert pool.slot_of(b"a") is None
        assert pool.statistics().free == 8
        tiers[0].fail = False
        assert host.lookup(b"a", ctx("r1")) is PENDING  # staged again


class TestCascade:
    def test_new_writes_go_to_every_tier_pinned_until_each_result(
        self, host: TieringHost, pool: BlockPool, tiers: tuple[DictTier, DictTier]
    ) -> None:
        first, second = tiers
        second.hold = True
        assert compute(host, "r1", [b"a", b"b"]) == StoreOutcome(written=2, resident=0, dropped=0)
        assert first.stores == second.stores == []  # the copy into the primary is running
        report = host.step()
        assert report.writes_completed == 2
        assert report.cascade_jobs_submitted == 2
        for tier in tiers:
            assert [(job.keys, job.request.req_id) for job in tier.stores] == [((b"a", b"b"), "r1")]
            assert tier.blocks == {b"a": data(b"a"), b"b": data(b"b")}
        assert host.statistics().cascades_in_flight == 2
        host.step()  # first reports; second holds
        assert pool.statistics().pinned == 2
        assert host.statistics().cascades_in_flight == 1
        second.hold = False
        host.step()
        assert pool.statistics().pinned == 0
        assert host.statistics().cascades_in_flight == 0

    def test_resident_blocks_are_not_rewritten(
        self, host: TieringHost, tiers: tuple[DictTier, DictTier]
    ) -> None:
        compute(host, "r1", [b"a"])
        host.step()
        assert compute(host, "r2", [b"a", b"b", b"b"]) == StoreOutcome(
            written=1, resident=2, dropped=0
        )
        host.step()
        assert [job.keys for job in tiers[0].stores] == [(b"a",), (b"b",)]

    def test_store_drops_blocks_without_a_slot(self) -> None:
        small = BlockPool(1, BLOCK)
        host = TieringHost(small, [])
        assert compute(host, "r1", [b"a", b"b"]) == StoreOutcome(written=1, resident=0, dropped=1)

    def test_request_level_tiers_also_get_already_resident_blocks(self, pool: BlockPool) -> None:
        producer = DictTier(pool, "producer", OffloadPolicy.REQUEST_LEVEL)
        plain = DictTier(pool, "plain")
        host = TieringHost(pool, [plain, producer])
        compute(host, "warm", [b"a"])
        host.step()
        producer.stores.clear()
        plain.stores.clear()
        assert host.new_request(ctx("r1")) is OffloadPolicy.REQUEST_LEVEL
        host.store(ctx("r1"), [b"a", b"b"], [data(b"a"), data(b"b")])
        # The prefix hit is cascaded at once, only to the tier that asked for it.
        assert [(job.keys, job.request.req_id) for job in producer.stores] == [((b"a",), "r1")]
        assert plain.stores == []
        host.store(ctx("r1"), [b"a"], [data(b"a")])  # once per request
        host.step()
        assert [job.keys for job in producer.stores] == [(b"a",), (b"b",)]
        assert [job.keys for job in plain.stores] == [(b"b",)]

    def test_request_level_block_still_writing_is_cascaded_when_it_lands(
        self, pool: BlockPool
    ) -> None:
        producer = DictTier(pool, "producer", OffloadPolicy.REQUEST_LEVEL)
        host = TieringHost(pool, [producer])
        compute(host, "other", [b"a"])  # a is WRITING for another request
        compute(host, "r1", [b"a"])
        host.finish_request(ctx("r1"))
        assert producer.finished() == []  # r1 still waits for a
        host.step()
        owners = sorted((job.keys, job.request.req_id) for job in producer.stores)
        assert owners == [((b"a",), "other"), ((b"a",), "r1")]
        assert producer.log.index("store r1 a") < producer.log.index("finished r1")


class TestJobAccounting:
    def test_job_ids_are_one_counter_across_kinds(
        self, host: TieringHost, tiers: tuple[DictTier, DictTier]
    ) -> None:
        tiers[0].blocks = {b"p": data(b"p")}
        compute(host, "r1", [b"a"])
        assert host.lookup(b"p", ctx("r1")) is PENDING
        host.step()
        ids = [job.job_id for tier in tiers for job in tier.stores + tier.loads]
        assert sorted(ids) == [1, 2, 3]

    def test_unknown_job_is_loud(self, host: TieringHost, tiers: tuple[DictTier, DictTier]) -> None:
        tiers[1].extra_results = [JobResult(99, True)]
        with pytest.raises(
            RuntimeError,
            match=r"tier 1 \(DictTier\) reported job 99, but no such job was ever issued",
        ):
            host.step()

    def test_duplicate_result_is_loud(
        self, host: TieringHost, tiers: tuple[DictTier, DictTier]
    ) -> None:
        compute(host, "r1", [b"a"])
        host.step()
        job_id = tiers[0].stores[0].job_id
        host.step()
        tiers[0].extra_results = [JobResult(job_id, True)]
        with pytest.raises(RuntimeError, match=rf"reported job {job_id}.*already reported"):
            host.step()

    def test_result_from_the_wrong_tier_is_loud(
        self, host: TieringHost, tiers: tuple[DictTier, DictTier]
    ) -> None:
        compute(host, "r1", [b"a"])
        tiers[0].hold = True
        host.step()
        tiers[1].extra_results = [JobResult(tiers[0].stores[0].job_id, True)]
        with pytest.raises(RuntimeError, match=r"tier 1 .* submitted to tier 0 \(DictTier\)"):
            host.step()

    def test_step_report_and_totals(
        self, host: TieringHost, tiers: tuple[DictTier, DictTier]
    ) -> None:
        compute(host, "r1", [b"a"])
        host.finish_request(ctx("r1"))
        first = host.step()
        assert first == StepReport(
            writes_completed=1, cascade_jobs_submitted=2, requests_finished=1
        )
        second = host.step()
        assert second == StepReport(jobs_finished=2)
        stats = host.statistics()
        assert stats.totals == StepReport(
            writes_completed=1, cascade_jobs_submitted=2, jobs_finished=2, requests_finished=1
        )
        with pytest.raises(dataclasses.FrozenInstanceError):
            stats.open_requests = 3  # type: ignore[misc]


class TestRequests:
    def test_finish_waits_for_pending_writes(
        self, host: TieringHost, tiers: tuple[DictTier, DictTier]
    ) -> None:
        compute(host, "r1", [b"a"])
        host.finish_request(ctx("r1"))
        assert tiers[0].finished() == []
        assert host.statistics().deferred_finishes == 1
        assert host.complete_writes() == 1
        for tier in tiers:
            assert tier.log[-2:] == ["store r1 a", "finished r1"]
        assert host.statistics().deferred_finishes == 0

    def test_finish_without_pending_work_is_forwarded_at_once(
        self, host: TieringHost, tiers: tuple[DictTier, DictTier]
    ) -> None:
        host.new_request(ctx("r1"))
        host.finish_request(ctx("r1"))
        assert tiers[1].finished() == ["finished r1"]
        with pytest.raises(RuntimeError, match=r"'r1' is not an open engine request"):
            host.finish_request(ctx("r1"))

    def test_finish_waits_for_staged_promotions_to_be_submitted(
        self, host: TieringHost, tiers: tuple[DictTier, DictTier]
    ) -> None:
        tiers[0].blocks = {b"a": data(b"a")}
        host.new_request(ctx("r1"))
        host.lookup(b"a", ctx("r1"))
        host.finish_request(ctx("r1"))
        assert tiers[0].finished() == []
        host.step()
        assert tiers[0].log.index("load r1 a") < tiers[0].log.index("finished r1")

    def test_requests_must_be_open(self, host: TieringHost) -> None:
        with pytest.raises(RuntimeError, match=r"'nope' is not an open engine request"):
            host.lookup(b"a", ctx("nope"))
        host.new_request(ctx("r1"))
        with pytest.raises(RuntimeError, match=r"'r1' is already open"):
            host.new_request(ctx("r1"))

    def test_store_validates_blocks(self, host: TieringHost) -> None:
        host.new_request(ctx("r1"))
        with pytest.raises(ValueError, match=r"2 keys but 1 blocks"):
            host.store(ctx("r1"), [b"a", b"b"], [data(b"a")])
        with pytest.raises(ValueError, match=r"key 62 is 3 bytes, a block is 32"):
            host.store(ctx("r1"), [b"a", b"b"], [data(b"a"), b"xyz"])
        assert host.pool.statistics().free == 8  # nothing written


class TestParent:
    @staticmethod
    def open_serve(host: TieringHost, tier: DictTier, script: Callable[[Parent], None]) -> None:
        """Run ``script`` in ``tier``'s next serve window."""
        tier.serve = script
        host.step()
        tier.serve = None

    def test_serve_lookup_pin_and_release(
        self, host: TieringHost, pool: BlockPool, tiers: tuple[DictTier, DictTier]
    ) -> None:
        first, server = tiers
        compute(host, "r1", [b"a"])
        host.step()
        host.step()
        serve = ServeRequest("serve-1", "kv-1", "peer-1")
        answers: list[LookupResult] = []
        jobs = []

        def script(parent: Parent) -> None:
            parent.on_new_request(serve)
            answers.extend(parent.lookup(key, serve) for key in (b"a", b"x"))
            jobs.append(parent.create_store_job([b"a"], serve))
            parent.on_request_finished(serve)

        server.looked_up.clear()
        self.open_serve(host, server, script)
        assert answers == [HIT, MISS]
        assert server.looked_up == []  # the calling tier is never asked
        assert first.looked_up == [(b"x", "serve-1")]
        assert first.log.count("new serve-1") == first.log.count("finished serve-1") == 1
        assert "new serve-1" not in server.log
        (job,) = jobs
        slot = pool.slot_of(b"a")
        assert (job.keys, job.slots) == ((b"a",), (slot,))
        assert pool.statistics().pinned == 1
        assert host.statistics().serve_jobs_in_flight == 1
        server.reportable.append(JobResult(job.job_id, True))
        host.step()
        assert pool.statistics().pinned == 0

    def test_serve_pins_only_ready_keys(
        self, host: TieringHost, tiers: tuple[DictTier, DictTier]
    ) -> None:
        compute(host, "r1", [b"a"])
        tiers[0].blocks = {b"b": data(b"b")}
        assert host.lookup(b"b", ctx("r1")) is PENDING  # WRITING until its promotion ends
        serve = ServeRequest("s", "kv", "peer")
        keys: list[tuple[Key, ...]] = []

        def script(parent: Parent) -> None:
            parent.on_new_request(serve)
            keys.append(parent.create_store_job([b"a", b"b", b"zz"], serve).keys)

        self.open_serve(host, tiers[1], script)
        assert keys == [(b"a",)]

    def test_serve_lookup_promotes_from_another_tier(
        self, host: TieringHost, tiers: tuple[DictTier, DictTier]
    ) -> None:
        first, server = tiers
        first.blocks = {b"a": data(b"a")}
        serve = ServeRequest("s", "kv", "peer")
        answers: list[LookupResult] = []

        def open_and_look(parent: Parent) -> None:
            parent.on_new_request(serve)
            answers.append(parent.lookup(b"a", serve))

        self.open_serve(host, server, open_and_look)
        assert [(job.keys, job.request.req_id) for job in first.loads] == [((b"a",), "s")]
        self.open_serve(host, server, lambda parent: answers.append(parent.lookup(b"a", serve)))
        assert answers == [PENDING, HIT]
        assert host.statistics().open_serve_requests == 1
        self.open_serve(host, server, lambda parent: parent.on_request_finished(serve))
        assert host.statistics().open_serve_requests == 0
        assert first.finished() == ["finished s"]

    def test_parent_is_dead_outside_the_window(
        self, host: TieringHost, tiers: tuple[DictTier, DictTier]
    ) -> None:
        kept: list[Parent] = []
        self.open_serve(host, tiers[0], kept.append)
        with pytest.raises(RuntimeError, match=r"tier 0 used its parent outside"):
            kept[0].on_new_request(ServeRequest("s", "kv", "peer"))

    def test_serve_request_lifecycle_is_enforced(
        self, host: TieringHost, tiers: tuple[DictTier, DictTier]
    ) -> None:
        serve = ServeRequest("s", "kv", "peer")
        errors: list[str] = []

        def misuse(parent: Parent) -> None:
            for call in (
                lambda: parent.lookup(b"a", serve),  # not opened
                lambda: parent.on_new_request(serve),
                lambda: parent.on_new_request(serve),  # twice
                lambda: parent.on_request_finished(serve),
                lambda: parent.on_request_finished(serve),  # twice
            ):
                try:
                    call()
                except RuntimeError as error:
                    errors.append(str(error))

        self.open_serve(host, tiers[1], misuse)
        assert len(errors) == 3
        assert "tier 1 (DictTier): serve request 's' is not open" in errors[0]
        assert "already open" in errors[1]
        assert tiers[0].finished() == ["finished s"]

    def test_another_tier_cannot_use_a_serve_request(
        self, host: TieringHost, tiers: tuple[DictTier, DictTier]
    ) -> None:
        serve = ServeRequest("s", "kv", "peer")
        tiers[0].serve = lambda parent: parent.on_new_request(serve)
        tiers[1].serve = lambda parent: parent.on_request_finished(serve)
        with pytest.raises(RuntimeError, match=r"tier 1 .* 's' is not open for this tier"):
            host.step()


class TestLifecycle:
    def test_pending_work(self, host: TieringHost, tiers: tuple[DictTier, DictTier]) -> None:
        assert not host.has_pending_work()
        compute(host, "r1", [b"a"])
        assert host.has_pending_work()  # a write
        host.step()
        assert host.has_pending_work()  # cascades in flight
        host.step()
        assert not host.has_pending_work()
        tiers[0].blocks = {b"p": data(b"p")}
        host.lookup(b"p", ctx("r1"))
        assert host.has_pending_work()  # a staged promotion
        host.step()
        host.step()
        assert not host.has_pending_work()
        tiers[1].busy = True
        assert host.has_pending_work()

    def test_drain_consumes_every_result(
        self, host: TieringHost, tiers: tuple[DictTier, DictTier]
    ) -> None:
        compute(host, "r1", [b"a"])
        for tier in tiers:
            tier.hold = True
        host.step()
        assert host.statistics().cascades_in_flight == 2
        host.drain()
        assert host.statistics().cascades_in_flight == 0
        assert all("drain" in tier.log for tier in tiers)

    def test_shutdown_consumes_results_and_closes(
        self, host: TieringHost, tiers: tuple[DictTier, DictTier]
    ) -> None:
        compute(host, "r1", [b"a"])
        tiers[0].hold = True
        host.step()
        host.shutdown()
        stats = host.statistics()
        assert stats.cascades_in_flight == 0
        assert stats.pool.pinned == 0
        assert all("shutdown" in tier.log for tier in tiers)
        with pytest.raises(RuntimeError, match="shut down"):
            host.step()

    def test_statistics_count_jobs_by_kind(
        self, host: TieringHost, tiers: tuple[DictTier, DictTier]
    ) -> None:
        for tier in tiers:
            tier.hold = True
        tiers[0].blocks = {b"p": data(b"p")}
        compute(host, "r1", [b"a"])
        host.lookup(b"p", ctx("r1"))
        host.step()
        stats = host.statistics()
        kinds = {
            JobKind.PROMOTION: stats.promotions_in_flight,
            JobKind.CASCADE: stats.cascades_in_flight,
            JobKind.SERVE: stats.serve_jobs_in_flight,
        }
        assert kinds == {JobKind.PROMOTION: 1, JobKind.CASCADE: 2, JobKind.SERVE: 0}
        assert stats.open_requests == 1
