"""vLLM's ``OffloadingConnector``, loading offloaded prefixes in the step that finds them.

vLLM 0.32's ``OffloadingConnector`` reports every hit in host memory as an
*asynchronous* load: the request waits (``WAITING_FOR_REMOTE_KVS``) while the worker
copies the blocks into the KV cache during one engine step, and is scheduled in the
next. That is one engine step of delay for every prefix found in host memory, a
pulled one included, which on a busy engine is a whole step of someone else's
prefill. :class:`KVPeerOffloadingConnector` reports the same hits as *synchronous*
(``kvpeer_sync_load``, on by default): the scheduler schedules the request in the
step that found its prefix, and the worker finishes the copy before that step's
forward pass (kvpeer's CPU worker copies inside ``submit_load``; a GPU worker is
waited for). Select it with::

    {"kv_connector": "KVPeerOffloadingConnector",
     "kv_connector_module_path": "kvpeer.integrations.vllm.connector", ...}

Everything else (specs, tiers, stores, metrics, events) is the parent's.

Invariants:

1. A load reported synchronous is finished before the forward pass of the step that
   scheduled it (``start_load_kv`` waits for it).
2. A synchronous load's completion is never reported to the scheduler as a finished
   receive: vLLM's scheduler expects those only for requests waiting for remote KV
   (it asserts so). Its job completion still reaches the offloading scheduler
   (``completed_jobs``), which unpins the host blocks as after any load.
3. Only this step's decisions count: a request found synchronous but not scheduled
   (no budget) is asked again before it is scheduled.
4. A synchronous load is not in its request's in-flight set (the request stores in
   the same step), but stays in the offloading scheduler's job table until every
   worker reported it; only then are its host blocks unpinned, so nothing can evict
   or overwrite them while the worker may still read them.
5. A completion this connector does not consume reaches the parent: the report of a
   synchronous load that a cache reset made the scheduler forget is left for the
   parent, whose reset fence (vLLM 0.33+: every secondary-tier lookup answers MISS
   until each job in flight at the reset reported back) counts it; 0.32 drops it as
   stale. Swallowed, the fence would never clear and pulls would stay off for good.
6. What vLLM 0.33+ asks of whoever completes a job is done the same way here: the
   manager's ``lock`` is held around ``complete_load`` (its tier-poll thread enters
   the manager too), a job in the workers' ``failed_jobs`` (0.34) is completed as
   failed (its request never loads from the offloaded cache again, as vLLM's own
   failed loads), and a synchronous load goes to the workers marked ``sync`` where the
   job carries that flag (0.33+: vLLM's own workers then wait for it and never report
   it as a finished receive). Each is found by feature, never by version.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Collection
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
    TransferJob,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.forward_context import ForwardContext
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

from kvpeer.node.params import parse_transfer_params
from kvpeer.node.trace import TRACE_LOGGER

__all__ = ["SYNC_LOAD_KEY", "KVPeerConnectorMetadata", "KVPeerOffloadingConnector"]

log = logging.getLogger("kvpeer.vllm")

SYNC_LOAD_KEY = "kvpeer_sync_load"  # kv_connector_extra_config key (bool, default true)
# vLLM 0.33+ marks a load job its workers must finish before the step's forward pass.
_JOB_HAS_SYNC = "sync" in {f.name for f in dataclasses.fields(TransferJob)}


@dataclass
class KVPeerConnectorMetadata(OffloadingConnectorMetadata):
    """The parent's metadata plus which of this step's load jobs are synchronous."""

    sync_load_jobs: frozenset[int] = field(default_factory=frozenset)


def _trace(request: Request, event: str, **values: object) -> None:
    """A kvpeer.trace line for a request pulling from a peer (kvpeer.node.trace's format,
    under the pull's id), when the tier enabled tracing (``KVPEER_TRACE``)."""
    logger = logging.getLogger(TRACE_LOGGER)
    if not logger.isEnabledFor(logging.INFO):
        return
    source = parse_transfer_params(request.kv_transfer_params).source
    if source is None:
        return
    fields = " ".join(f"{name}={value}" for name, value in values.items())
    logger.info("kvpeer.trace t=%.6f node=connector id=%s event=%s %s",
                time.time(), source.kv_request_id, event, fields)  # fmt: skip


def _sync_load_setting(vllm_config: VllmConfig) -> bool:
    transfer = vllm_config.kv_transfer_config
    extra: dict[str, Any] = dict(transfer.kv_connector_extra_config or {}) if transfer else {}
    value = extra.get(SYNC_LOAD_KEY, True)
    if not isinstance(value, bool):
        raise ValueError(
            f"kv_connector_extra_config.{SYNC_LOAD_KEY}: expected true or false, got {value!r}"
        )
    return value


class KVPeerOffloadingConnector(OffloadingConnector):
    """``OffloadingConnector`` whose loads from host memory are synchronous."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._sync_load = _sync_load_setting(vllm_config)
        self._sync_now: set[str] = set()  # scheduler: requests answered sync this step
        self._sync_jobs: dict[int, ReqContext] = {}  # scheduler: sync loads not reported
        self._sync_reqs: dict[int, str] = {}  # worker: sync load job -> request id
        self.sync_loads = 0  # scheduler: hits reported synchronous, since start

    # -- scheduler side -------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        tokens, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if not (tokens and load_async and self._sync_load):
            return tokens, load_async
        # A hit of the whole prompt leaves nothing to compute, and the scheduler needs
        # one token to sample from: after an asynchronous load vLLM recomputes the last
        # token; loaded synchronously, the hit stops one token short instead (its
        # block is still loaded whole, and the forward pass rewrites that one token).
        tokens = min(tokens, request.num_tokens - 1 - num_computed_tokens)
        if tokens <= 0:
            return 0, False
        self._sync_now.add(request.request_id)
        self.sync_loads += 1
        return tokens, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        sync = bool(num_external_tokens) and request.request_id in self._sync_now
        if sync:
            blocks = self._fresh_view(request, blocks, num_external_tokens)
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if sync:
            self._track_sync_load(request, num_external_tokens)

    def _track_sync_load(self, request: Request, tokens: int) -> None:
        """Take the request's new load job out of its in-flight set (invariant 4).

        The offloading scheduler refuses to store a request's chunks while a load of
        it is in flight (it asserts so), and after a synchronous load the request
        computes, and stores, in the very step the load was issued. The load is over
        before that step's forward pass; only its completion report comes later.
        """
        scheduler = self.connector_scheduler
        assert scheduler is not None
        status = scheduler._req_status[request.request_id]
        (job_id,) = status.transfer_jobs  # a load is issued only when nothing is in flight
        status.transfer_jobs.discard(job_id)
        self._sync_jobs[job_id] = status.req_context
        _trace(request, "sync_load_scheduled", tokens=tokens)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if self._sync_jobs and isinstance(meta, OffloadingWorkerMetadata):
            failed: Collection[int] = getattr(meta, "failed_jobs", ())  # vLLM 0.34+
            with self._manager_lock():  # released before the parent takes it (invariant 6)
                for job_id in [job for job in meta.completed_jobs if job in self._sync_jobs]:
                    workers = meta.completed_jobs[job_id]
                    if self._complete_sync_load(job_id, workers, job_id in failed):
                        del meta.completed_jobs[job_id]  # else the parent's (invariant 5)
        super().update_connector_output(connector_output)

    def _manager_lock(self) -> AbstractContextManager[object]:
        """The offloading manager's lock where vLLM has one (0.33+), taken the way its
        scheduler takes it outside a step (``_manager_locked``, which first releases a
        step's hold a failed ``schedule()`` left behind), else nothing (0.32)."""
        scheduler = self.connector_scheduler
        assert scheduler is not None
        locked = getattr(scheduler, "_manager_locked", None)
        if locked is not None:
            region: AbstractContextManager[object] = locked()
            return region
        lock: AbstractContextManager[object] | None = getattr(scheduler.manager, "lock", None)
        return lock if lock is not None else contextlib.nullcontext()

    def _complete_sync_load(self, job_id: int, workers: int, failed: bool) -> bool:
        """What the parent does for a finished load, for one it no longer sees as the
        request's: unpin the host blocks once every worker reported it. False: the
        scheduler forgot the job (a cache reset), and the report is the parent's."""
        scheduler = self.connector_scheduler
        assert scheduler is not None
        status = scheduler._jobs.get(job_id)
        if status is None:  # forgotten by a cache reset: the parent's fence counts it
            self._sync_jobs.pop(job_id, None)
            return False
        if failed and hasattr(status, "failed"):
            status.failed = True
        status.pending_count -= workers
        if status.pending_count > 0:
            return True
        req_context = self._sync_jobs.pop(job_id)
        request_status = scheduler._req_status.get(status.req_id)
        if getattr(status, "failed", False):
            log.warning("kvpeer: synchronous load job %d of request %s failed; it will not "
                        "load from the offloaded cache again", job_id, status.req_id)  # fmt: skip
            if request_status is not None and hasattr(request_status, "load_failed"):
                request_status.load_failed = True
        scheduler.manager.complete_load(status.keys, req_context)
        request = request_status
        if request is not None:
            _trace(request.req, "sync_load_step_done")  # the step that loaded it has run
        if scheduler._chunks_being_loaded:
            scheduler._chunks_being_loaded.difference_update(status.keys)
        del scheduler._jobs[job_id]
        if request is not None and request.finished_signaled and not request.transfer_jobs:
            del scheduler._req_status[status.req_id]
        return True

    def _fresh_view(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> KVCacheBlocks:
        """``blocks`` with the ones the load fills shown unhashed.

        The offloading scheduler finds where a load starts by the first block without
        a prefix-cache hash: after an asynchronous load the scheduler hashes the loaded
        blocks only once they arrived, but for a synchronous one it has hashed them
        already (they will hold their tokens' KV before this step's forward pass), so
        the parent would take them for local hits and load nothing into them.
        """
        scheduler = self.connector_scheduler
        assert scheduler is not None
        local = scheduler._req_status[request.request_id].num_locally_computed_tokens
        groups = list(blocks.blocks)
        for group in scheduler.config.kv_group_configs:
            per_block = group.tokens_per_block
            first, end = -(-local // per_block), -(-(local + num_external_tokens) // per_block)
            shown = list(groups[group.group_idx])
            for index in range(first, min(end, len(shown))):
                if not shown[index].is_null:
                    shown[index] = KVCacheBlock(shown[index].block_id)  # unhashed twin
            groups[group.group_idx] = shown
        return KVCacheBlocks(tuple(groups))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = super().build_connector_meta(scheduler_output)
        assert isinstance(meta, OffloadingConnectorMetadata)
        sync = frozenset(job_id for job_id in meta.load_jobs if job_id in self._sync_jobs)
        self._sync_now.clear()  # invariant 3
        load_jobs = meta.load_jobs
        if sync and _JOB_HAS_SYNC:  # vLLM 0.33+: its workers wait for these (invariant 6)
            flag: dict[str, Any] = {"sync": True}  # a field 0.32's TransferJob has not
            load_jobs = {job_id: dataclasses.replace(job, **flag) if job_id in sync else job
                         for job_id, job in load_jobs.items()}  # fmt: skip
        return KVPeerConnectorMetadata(
            load_jobs=load_jobs,
            store_jobs=meta.store_jobs,
            jobs_to_flush=meta.jobs_to_flush,
            sync_load_jobs=sync,
        )

    # -- worker side ----------------------------------------------------------------

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        super().start_load_kv(forward_context, **kwargs)
        meta = self._connector_metadata
        if not isinstance(meta, KVPeerConnectorMetadata) or not meta.sync_load_jobs:
            return
        for job_id in meta.sync_load_jobs:
            self._sync_reqs[job_id] = meta.load_jobs[job_id].req_id
        worker = self.connector_worker
        assert worker is not None
        assert worker.worker is not None
        worker.worker.wait(set(meta.sync_load_jobs))  # invariant 1

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        sending, receiving = super().get_finished(finished_req_ids)
        if self._sync_reqs:
            worker = self.connector_worker
            assert worker is not None
            # the parent forgot the jobs it reported; ours that it no longer tracks are done
            done = [job for job in self._sync_reqs if job not in worker._load_jobs]
            synced = {self._sync_reqs.pop(job) for job in done}
            receiving -= synced  # invariant 2
        return sending, receiving
