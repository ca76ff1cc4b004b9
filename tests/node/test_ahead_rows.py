"""``kvpeer.node.ahead`` alone, under random operation sequences: every staging row is
free or in exactly one entry (invariant 1), only rows whose fetch succeeded are copied
out (2), every engine job is reported exactly once (5), nothing outlives its TTL
unclaimed (3), and after shutdown every row is free."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvpeer.config import TierConfig
from kvpeer.node.ahead import AheadFetch, PullAhead
from kvpeer.node.counters import TierCounters
from kvpeer.protocol import Prefetch
from kvpeer.types import JobResult, Key, RequestContext, TransferJob

ROWS = list(range(100, 106))
SOURCE = "10.0.0.2:5710"  # the peer every prefetch here names
TTL_S = 5.0


def key(n: int) -> Key:
    return b"k%04d" % n + bytes(4)


def keys_of(tokens: Sequence[int], max_keys: int) -> list[Key]:
    return [key(t) for t in tokens[:max_keys]]


operations: st.SearchStrategy[list[tuple[object, ...]]] = st.lists(
    st.one_of(
        st.tuples(st.just("prefetch"), st.lists(st.integers(0, 9), min_size=1, max_size=5)),
        st.tuples(st.just("land"), st.booleans()),
        st.tuples(st.just("job"), st.lists(st.integers(0, 9), min_size=1, max_size=4),
                  st.booleans()),
        st.tuples(st.just("time"), st.floats(0.0, 4.0)),
        st.tuples(st.just("adopt"), st.lists(st.integers(0, 9), min_size=1, max_size=4)),
        st.tuples(st.just("clear"), st.none()),
    ),
    max_size=60,
)


@settings(max_examples=400, deadline=None)
@given(operations)
# simulation seed 2747: a job waiting on two fetches fails over the first; the second
# lands and must not stay claimed for ever
@example([("prefetch", [1]), ("prefetch", [2]), ("job", [1, 2], True), ("land", False),
          ("land", True)])  # fmt: skip
def test_rows_are_conserved_and_jobs_reported_once(ops: list[tuple[object, ...]]) -> None:
    config = TierConfig.from_dict({"prefetch_from": ["10.0.0.0/8"], "prefetch_ttl_s": TTL_S})
    ahead = PullAhead(config, TierCounters(), "127.0.0.1:1")
    fetched_ok: set[int] = set()  # rows whose current fetch succeeded
    copied: list[tuple[int, int]] = []

    def copy(pairs: Sequence[tuple[int, int]]) -> None:
        for src, _ in pairs:
            assert src in fetched_ok, f"row {src} copied before its fetch succeeded"
        copied.extend(pairs)

    ahead.configure(ROWS, keys_of, copy, 8)
    now = 0.0
    fetches: list[AheadFetch] = []
    submitted: set[int] = set()
    reported: dict[int, bool] = {}
    next_job = 1

    def report(results: list[JobResult] | None) -> None:
        for result in results or []:
            assert result.job_id > 0, "an ahead fetch reached the engine"
            assert result.job_id not in reported, f"job {result.job_id} reported twice"
            assert result.job_id in submitted
            reported[result.job_id] = result.success

    discarded: set[int] = set()  # fetches running when the engine reset its cache
    engine_rows = iter(range(1000, 2000))  # rows the engine allocates and gives away
    adopted_rows: set[int] = set()  # staging rows the engine took into its cache

    def check() -> None:
        staged, fetching, free = ahead.statistics()
        assert staged + fetching + free == len(ROWS) == len(ahead.rows)
        assert len(ahead._free) == len(set(ahead._free))
        in_use = {e.row for e in ahead._entries.values()}
        assert not in_use & set(ahead._free)
        assert in_use | set(ahead._free) == set(ahead.rows)
        assert not adopted_rows & set(ahead.rows), "a row is the engine's and staging's"

    for op, arg, *more in ops:
        if op == "prefetch":
            assert isinstance(arg, list)
            message = Prefetch(kv_request_id="r", source=SOURCE, tokens=tuple(arg))
            fetch = ahead.admit("10.0.0.1", message, now)
            if isinstance(fetch, AheadFetch):
                fetches.append(fetch)
                for row in fetch.rows:
                    fetched_ok.discard(row)
        elif op == "land" and fetches:
            fetch = fetches.pop(0)
            if arg and fetch.job_id not in discarded:
                fetched_ok.update(fetch.rows)
            report(ahead.landed(fetch.job_id, bool(arg), now))
        elif op == "job":
            assert isinstance(arg, list)
            job = TransferJob(next_job, tuple(key(n) for n in arg),
                              tuple(range(len(arg))), RequestContext("c"))  # fmt: skip
            submitted.add(next_job)
            next_job += 1
            # the request names the prefetches' source (it may wait for them), or none
            results = ahead.take(job, now, SOURCE if more and more[0] else None)
            if results is None:
                submitted.discard(job.job_id)  # the ordinary path takes it
            report(results)
        elif op == "adopt":
            assert isinstance(arg, list)
            wanted = [key(n) for n in dict.fromkeys(arg)]
            ready = ahead.state(wanted) is True
            given = [next(engine_rows) for _ in wanted]
            taken = ahead.adopt(wanted, given)
            assert (taken is not None) == ready
            if taken is not None:
                assert all(row in fetched_ok for row in taken)
                adopted_rows.update(taken)
                assert ahead.state(wanted) is None  # the engine holds them now
        elif op == "clear":
            report(ahead.clear())
            discarded.update(f.job_id for f in fetches)
            assert ahead.statistics()[0] == 0  # nothing staged survives a reset
        elif op == "time":
            assert isinstance(arg, float)
            now += arg
            ahead.expire(now)
            for entry in ahead._entries.values():
                assert entry.fetch is not None or entry.claimed or entry.deadline > now
        check()
    for fetch in fetches:  # the sessions end: every fetch is reported, failed
        report(ahead.landed(fetch.job_id, False, now))
    ahead.expire(now + 10 * TTL_S)
    if not ahead._waiting:  # nothing claims a row any more: every staged one expired
        assert ahead.statistics() == (0, 0, len(ROWS)), "a staged row outlived its TTL"
    report(ahead.shutdown())
    check()
    assert ahead.statistics() == (0, 0, len(ROWS))
    assert len(ahead.rows) == len(ROWS)
    assert set(reported) == submitted, "a job was never reported"


def test_a_sender_outside_prefetch_from_changes_nothing() -> None:
    config = TierConfig.from_dict({"prefetch_from": ["10.0.0.0/8"]})
    ahead = PullAhead(config, TierCounters(), "127.0.0.1:1")
    ahead.configure(ROWS, keys_of, lambda pairs: None, 8)
    message = Prefetch(kv_request_id="r", source="10.0.0.2:5710", tokens=(1, 2))
    reason = ahead.admit("192.168.1.1", message, 0.0)
    assert isinstance(reason, str)
    assert "192.168.1.1" in reason
    assert "prefetch_from" in reason
    assert ahead.statistics() == (0, 0, len(ROWS))


def test_configure_refuses_rows_named_twice() -> None:
    ahead = PullAhead(TierConfig(), TierCounters(), "127.0.0.1:1")
    with pytest.raises(ValueError, match="distinct"):
        ahead.configure([1, 1], keys_of, lambda pairs: None, 8)


def test_shutdown_lets_go_of_the_engines_region() -> None:
    """The row copier views the engine's region; after shutdown nothing of it is held, so
    the engine can unmap the region (vLLM closes it after its tiers: a view kept past the
    tier's shutdown made every engine log a BufferError at exit)."""
    import mmap

    from kvpeer.node.ahead import row_copier
    from kvpeer.transport.data.base import PrimaryRegion

    memory = mmap.mmap(-1, 8 * 64)
    region = PrimaryRegion(memoryview(memory), 8, 64)
    ahead = PullAhead(TierConfig(), TierCounters(), "127.0.0.1:1")
    ahead.configure([6, 7], lambda tokens, most: None, row_copier(region), 64)
    with pytest.raises(BufferError):
        memory.close()  # the copier's view holds it
    ahead.shutdown()
    region.view.release()
    memory.close()  # nothing holds it any more
