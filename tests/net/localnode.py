"""A node in the test process over its own :class:`BlockPool`, driven the way an
engine would: symmetric pulls and PD loads (:class:`LocalNode`, :class:`PdLoad`)."""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Mapping, Sequence
from types import TracebackType

from kvpeer.host import BlockPool
from kvpeer.lab.pull import Puller, PullResult
from kvpeer.node.build import open_node
from kvpeer.node.driver import DrivenTier
from kvpeer.node.params import split_peer_id
from kvpeer.node.serve import preload_synthetic
from kvpeer.node.synthetic import synthetic_index
from kvpeer.node.tier import TierStatistics
from kvpeer.testing.expect import record_once
from kvpeer.transport.data.base import PrimaryRegion
from kvpeer.types import Key, LookupResult, RequestContext, TransferJob
from tests.net.common import (
    BLOCK_LEN,
    DEADLINE_S,
    tier_config,
    unique_shm_path,
)

__all__ = [
    "LocalNode",
    "PdLoad",
    "open_pool_node",
]

def open_pool_node(
    tag: str,
    plane: str | Sequence[str],
    num_blocks: int,
    block_len: int,
    host: str,
    port: int,
    settings: Mapping[str, object],
    *,
    synthetic: int = 0,
) -> tuple[BlockPool, DrivenTier]:
    """A region (shm-backed when the shm plane is on) and a node over it."""
    planes = [plane] if isinstance(plane, str) else list(plane)
    shm_path = unique_shm_path(tag) if "shm" in planes else None
    pool = BlockPool(num_blocks, block_len, shm_path=shm_path)
    try:
        preload_synthetic(pool, synthetic)
        region = PrimaryRegion(pool.view, num_blocks, block_len, pool.shm_path)
        # Nodes of this process (a test may run two) may map each other's shm regions.
        config = tier_config(planes, host, port, **settings)
        return pool, open_node(config, region, shm_same_process=True)
    except BaseException:
        pool.close()
        raise


class LocalNode:
    """A node in the test process over its own pool; it pulls like an engine would.

    Every job result goes through :meth:`collect`, so PD loads never lose each
    other's results (:class:`Puller` keeps only its own: do not overlap the two).
    """

    def __init__(
        self,
        plane: str | Sequence[str] = "tcp",
        *,
        num_blocks: int = 64,
        block_len: int = BLOCK_LEN,
        host: str = "127.0.0.1",
        port: int = 0,
        config: Mapping[str, object] | None = None,
        **overrides: object,
    ) -> None:
        """``config`` and ``overrides``: tier config keys on top of the defaults."""
        self.pool, self.node = open_pool_node(
            "node", plane, num_blocks, block_len, host, port, {**(config or {}), **overrides}
        )
        self.results: dict[int, bool] = {}
        self._job_ids = itertools.count(1)
        self._closed = False

    @property
    def peer_id(self) -> str:
        return self.node.tier.peer_id

    def next_job_id(self) -> int:
        return next(self._job_ids)

    def pull(
        self, peer_id: str, keys: Sequence[Key], slots: Sequence[int], timeout_s: float = DEADLINE_S
    ) -> PullResult:
        """One symmetric pull (probe, then load the leading hits)."""
        puller = Puller(self.node, peer_id, job_ids_from=self.next_job_id())
        return puller.pull(keys, slots, timeout_s=timeout_s)

    def start_pd_load(
        self, peer_id: str, kv_request_id: str, keys: Sequence[Key], slots: Sequence[int]
    ) -> PdLoad:
        return PdLoad(self, peer_id, kv_request_id, keys, slots)

    def collect(self) -> None:
        for result in self.node.get_finished_jobs():
            record_once(self.results, result.job_id, result.success)

    def wait_job(self, job_id: int, timeout_s: float = DEADLINE_S) -> bool | None:
        """The job's success, or None if it did not finish within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.collect()
            if job_id in self.results:
                return self.results[job_id]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self.node.wait_for_work(min(0.05, remaining))

    def statistics(self) -> TierStatistics:
        with self.node.locked():
            return self.node.tier.statistics()

    def has_session(self, peer_id: str) -> bool:
        with self.node.locked():
            return self.node.tier.session(peer_id) is not None

    def block_index(self, slot: int) -> int | None:
        """Which synthetic block slot ``slot`` holds (None: not a synthetic block)."""
        return synthetic_index(bytes(self.pool.slot_view(slot)))

    def is_zero(self, slot: int) -> bool:
        return not any(bytes(self.pool.slot_view(slot)))

    def assert_blocks(self, slots: Sequence[int], indexes: Sequence[int]) -> None:
        found = [self.block_index(slot) for slot in slots]
        assert found == list(indexes), "blocks landed in the wrong slots or corrupted"

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.node.shutdown()
            with contextlib.suppress(Exception):
                self.collect()
        finally:
            self.pool.close()

    def __enter__(self) -> LocalNode:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


class PdLoad:
    """One PD consumer request (``remote_prefiller``): lookups answer HIT, one load."""

    def __init__(
        self,
        owner: LocalNode,
        peer_id: str,
        kv_request_id: str,
        keys: Sequence[Key],
        slots: Sequence[int],
    ) -> None:
        address = split_peer_id(peer_id)
        assert address is not None, peer_id
        self._owner = owner
        node = owner.node
        self.context = RequestContext(
            f"decode-{kv_request_id}",
            {
                "remote_prefiller": {
                    "kv_request_id": kv_request_id,
                    "remote_host": address[0],
                    "remote_port": address[1],
                }
            },
        )
        node.on_new_request(self.context)
        self.answers = [node.lookup(key, self.context) for key in keys]
        node.on_schedule_end()
        self.job_id = owner.next_job_id()
        self.submitted_at = time.monotonic()
        #: Like an engine: load only when every lookup hit; otherwise compute locally.
        self.submitted = all(answer is LookupResult.HIT for answer in self.answers)
        if self.submitted:
            node.submit_load(TransferJob(self.job_id, tuple(keys), tuple(slots), self.context))
        self._finished = False

    def wait(self, timeout_s: float = DEADLINE_S) -> bool | None:
        """The load's success; None if it is still running after ``timeout_s``."""
        assert self.submitted, f"no load was submitted (lookups answered {self.answers})"
        return self._owner.wait_job(self.job_id, timeout_s)

    def finish(self) -> None:
        if not self._finished:
            self._finished = True
            self._owner.node.on_request_finished(self.context)
