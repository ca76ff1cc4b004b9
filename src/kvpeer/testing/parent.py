"""A fake parent (host cache manager) with pinning and pending keys.

It enforces the parent contract loudly, so a session that breaks it fails
the test: lookups only for open requests, ``on_request_finished`` exactly
once per ``on_new_request``, pins only of present keys, every store job
finished exactly once.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from kvpeer.session.results import StoreFinished
from kvpeer.testing.dataplane import Region
from kvpeer.types import Key, LookupResult, ServeRequest, StoreJob

__all__ = ["FakeParent"]


class FakeParent:
    """Holds keys in slots of a :class:`Region`; answers and pins like a host."""

    def __init__(self, region: Region, job_ids: itertools.count[int] | None = None) -> None:
        self.region = region
        self.slots: dict[Key, int] = {}
        self.pending: set[Key] = set()  # answer HIT_PENDING
        self.undecided: set[Key] = set()  # answer RETRY
        self.pins: dict[int, int] = {}
        self.open_jobs: dict[int, StoreJob] = {}
        self.finished_jobs: dict[int, bool] = {}
        self.open_requests: dict[str, ServeRequest] = {}
        self.requests_seen = 0
        self.lookups = 0
        self._job_ids = job_ids if job_ids is not None else itertools.count(1_000_000)
        self._free = list(range(region.num_blocks - 1, -1, -1))

    # -- setup ---------------------------------------------------------------

    def put(self, key: Key, data: bytes | None = None) -> int:
        """Store ``key`` (with ``data`` or a pattern derived from the key)."""
        if key in self.slots:
            return self.slots[key]
        slot = self._free.pop()
        block = data if data is not None else _pattern(key, self.region.block_len)
        self.region.write(slot, block)
        self.slots[key] = slot
        return slot

    def expected(self, key: Key) -> bytes:
        return _pattern(key, self.region.block_len)

    # -- Parent ----------------------------------------------------------------

    def on_new_request(self, request: ServeRequest) -> None:
        assert request.req_id not in self.open_requests, f"{request.req_id} opened twice"
        self.open_requests[request.req_id] = request
        self.requests_seen += 1

    def lookup(self, key: Key, request: ServeRequest) -> LookupResult:
        assert request.req_id in self.open_requests, f"lookup on closed {request.req_id}"
        self.lookups += 1
        if key in self.pending:
            return LookupResult.HIT_PENDING
        if key in self.undecided:
            return LookupResult.RETRY
        return LookupResult.HIT if key in self.slots else LookupResult.MISS

    def create_store_job(self, keys: Sequence[Key], request: ServeRequest) -> StoreJob:
        assert request.req_id in self.open_requests, f"pin on closed {request.req_id}"
        slots = []
        for key in keys:
            assert key in self.slots, f"pin of absent key {key!r}"
            slot = self.slots[key]
            self.pins[slot] = self.pins.get(slot, 0) + 1
            slots.append(slot)
        job = StoreJob(next(self._job_ids), tuple(keys), tuple(slots))
        self.open_jobs[job.job_id] = job
        return job

    def on_request_finished(self, request: ServeRequest) -> None:
        assert request.req_id in self.open_requests, f"{request.req_id} finished twice"
        del self.open_requests[request.req_id]

    # -- results -------------------------------------------------------------

    def store_job(self, keys: Sequence[Key]) -> StoreJob:
        """Pin ``keys`` for a store the host submits itself (a PD producer)."""
        request = ServeRequest(f"store-{len(self.finished_jobs) + len(self.open_jobs)}", "", "")
        self.open_requests[request.req_id] = request
        try:
            return self.create_store_job(keys, request)
        finally:
            del self.open_requests[request.req_id]

    def job_finished(self, result: StoreFinished) -> None:
        assert result.job_id not in self.finished_jobs, f"store job {result.job_id} twice"
        job = self.open_jobs.pop(result.job_id, None)
        assert job is not None, f"unknown store job {result.job_id}"
        self.finished_jobs[result.job_id] = result.success
        for slot in job.slots:
            self.pins[slot] -= 1
            if not self.pins[slot]:
                del self.pins[slot]

    def pinned_slots(self) -> int:
        return len(self.pins)


def _pattern(key: Key, size: int) -> bytes:
    seed = (key * (size // max(len(key), 1) + 1))[:size]
    return bytes(b ^ 0x5A for b in seed)
