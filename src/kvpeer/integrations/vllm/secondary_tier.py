"""kvpeer as a vLLM secondary tier: maps vLLM's hooks and types onto the kvpeer tier.

vLLM loads it from ``kv_connector_extra_config.secondary_tiers``::

    {"type": "KVPeerTier", "module_path": "kvpeer.integrations.vllm", "port": 5710, ...}

Every other key of the entry is a kvpeer tier config key, validated by
:class:`kvpeer.config.TierConfig` (unknown keys and bad values are errors that
name the key). The bound port is ``port`` + the engine's data-parallel index, as
with vLLM's own ``p2p`` tier. Nothing here decides anything: requests, lookups,
jobs and the serve window go to :class:`kvpeer.node.driver.DrivenTier` as
kvpeer values and come back as vLLM values.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
import weakref
from collections.abc import Collection, Iterable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    LookupResult as VllmLookupResult,
)
from vllm.v1.kv_offload.base import (
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.base import (
    OffloadPolicy as VllmOffloadPolicy,
)
from vllm.v1.kv_offload.tiering.base import (
    JobResult as VllmJobResult,
)
from vllm.v1.kv_offload.tiering.base import (
    ParentManager,
    SecondaryTierManager,
)
from vllm.v1.kv_offload.tiering.base import (
    TransferJob as VllmTransferJob,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvpeer.config import TierConfig
from kvpeer.errors import ConfigError
from kvpeer.host.claims import Claim
from kvpeer.integrations.vllm.metrics import StatsSource, metric_definitions
from kvpeer.integrations.vllm.prompt_keys import PromptKeys, find_engine_core
from kvpeer.node.ahead import row_copier
from kvpeer.node.build import open_node
from kvpeer.node.driver import DrivenTier
from kvpeer.node.trace import TRACE_ENV, TRACE_LOGGER
from kvpeer.transport.data.base import PrimaryRegion
from kvpeer.types import (
    JobResult,
    Key,
    LookupResult,
    RequestContext,
    ServeRequest,
    StoreJob,
    TransferJob,
)

__all__ = ["KVPeerTier", "live_tiers"]

log = logging.getLogger("kvpeer.vllm")

_TO_VLLM_LOOKUP = {result: VllmLookupResult[result.name] for result in LookupResult}
_FROM_VLLM_LOOKUP = {value: key for key, value in _TO_VLLM_LOOKUP.items()}
_LIVE: weakref.WeakSet[KVPeerTier] = weakref.WeakSet()


def live_tiers() -> list[KVPeerTier]:
    """The tiers of this process not shut down yet (with vLLM's in-process engine,
    the scheduler's tier lives in the caller's process: e.g. to read its statistics)."""
    return list(_LIVE)


def _fingerprint(offloading_spec: Any) -> str:
    """The compatibility fingerprint vLLM's own p2p tier advertises, computed the same
    way from vLLM's run config, so kvpeer and vLLM peers check each other alike."""
    try:
        from vllm.v1.kv_offload.file_mapper import FileMapper

        fields = FileMapper.from_offloading_spec(
            root_dir="",
            offloading_spec=offloading_spec,
            blocks_per_file=offloading_spec.blocks_per_chunk,
            parallel_agnostic=True,
        ).get_run_config()
    except Exception as exc:  # a vLLM layout we cannot describe: skip the check
        log.warning("no config fingerprint (peers will not check it): %s", exc)
        return ""
    if not fields:
        return ""
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _hash_seed() -> str:
    from vllm.v1.core.kv_cache_utils import get_none_hash_seed

    return str(get_none_hash_seed())


def _trace_from_env() -> bool:
    """``KVPEER_TRACE=1``: the tier traces each pull (kvpeer.node.trace) to stderr, which
    vLLM's own logging setup would not show (its handlers serve ``vllm.*`` only)."""
    if os.environ.get(TRACE_ENV, "") not in ("1", "true", "yes"):
        return False
    logger = logging.getLogger(TRACE_LOGGER)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return True


def _region(primary_kv_view: memoryview, engine_id: str) -> PrimaryRegion:
    num_blocks = primary_kv_view.shape[0] if primary_kv_view.shape else 0
    block_len = primary_kv_view.strides[0] if primary_kv_view.strides else 0
    flat = primary_kv_view.cast("B") if primary_kv_view.ndim != 1 else primary_kv_view
    path = f"/dev/shm/vllm_offload_{engine_id}.mmap"
    shm_path = path if os.path.exists(path) and os.path.getsize(path) == flat.nbytes else None
    return PrimaryRegion(flat, num_blocks, block_len, shm_path)


def _drop_region_name(path: str | None, claim: Claim) -> None:
    """Remove the name of vLLM's region file once nobody needs it, then our claim.

    vLLM's workers create and map ``/dev/shm/vllm_offload_<engine_id>.mmap`` before
    the scheduler joins it and builds its tiers, so by now every process of this engine
    has mapped the file and our shm plane holds a descriptor of it: the name serves
    nobody. vLLM unlinks it only in the creator's cleanup, which a ``vllm serve`` never
    reaches (its API server SIGKILLs the EngineCore at once on SIGTERM), so the file
    would stay after every exit, clean or not. Unlinked here, the memory goes with the
    last mapping, whichever way the engine exits (as vLLM's own region does when it is
    given a barrier). The claim covered the start-up; the sweep of a later node removes
    file and claim if we died before this.
    """
    if path is not None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    claim.release()


class _Parent:
    """vLLM's ParentManager seen as kvpeer's Parent, for one serve window."""

    def __init__(self, parent: ParentManager, contexts: dict[str, ReqContext]) -> None:
        self._parent = parent
        self._contexts = contexts

    def on_new_request(self, request: ServeRequest) -> None:
        context = ReqContext(req_id=request.req_id)
        self._contexts[request.req_id] = context
        self._parent.on_new_request(context)

    def lookup(self, key: Key, request: ServeRequest) -> LookupResult:
        context = self._contexts[request.req_id]
        return _FROM_VLLM_LOOKUP[self._parent.lookup(OffloadKey(key), context)]

    def create_store_job(self, keys: Collection[Key], request: ServeRequest) -> StoreJob:
        job = self._parent.create_store_job(
            [OffloadKey(k) for k in keys], self._contexts[request.req_id]
        )
        return StoreJob(int(job.job_id), tuple(job.keys), tuple(int(s) for s in job.chunk_ids))

    def on_request_finished(self, request: ServeRequest) -> None:
        context = self._contexts.pop(request.req_id, None)
        if context is not None:
            self._parent.on_request_finished(context)


class _EngineWaker:
    """Wakes vLLM's engine-core busy loop when a peer's lookup needs a serve window.

    An idle EngineCore blocks on its input queue and steps only when it has work;
    the tier then reports pending work (so the loop keeps stepping) only while it
    has some. A lookup from a peer arrives on our driver thread while the engine
    sleeps, so the driver puts vLLM's own ``WAKEUP`` sentinel into the engine's
    input queue: the loop wakes, sees the tier's pending work, steps, and the
    serve window answers the peer. vLLM 0.32 gives a tier no handle on its engine,
    so the queue is found once, by looking for the EngineCore whose busy loop runs
    on one of this process's threads. In-process engines (no busy loop) step only
    inside ``generate()``; there is nothing to wake and the lookup waits for it.
    """

    def __init__(self) -> None:
        self._queue: Any = None
        self._searched = False

    def __call__(self) -> None:
        if not self._searched:
            self._searched = True
            self._queue = self._find_input_queue()
        if self._queue is not None:
            from vllm.v1.engine import EngineCoreRequestType

            self._queue.put_nowait((EngineCoreRequestType.WAKEUP, None))

    @staticmethod
    def _find_input_queue() -> Any:
        from vllm.v1.engine.core import EngineCoreProc

        engine = find_engine_core(EngineCoreProc)
        if engine is not None:
            return engine.input_queue
        log.info("no EngineCore busy loop in this process: idle serving waits for steps")
        return None


class KVPeerTier(SecondaryTierManager):
    """The kvpeer peer-to-peer tier inside a vLLM engine."""

    cache_hit_source = CacheHitSource.P2P

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        **tier_config: object,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type)
        if backpressure_detector is not None:
            raise ConfigError(
                "backpressure: not supported by kvpeer (dropping a producer's store "
                "strands its decoder); remove it from this tier's config"
            )
        config = dict(tier_config)
        parallel = offloading_spec.config.parallel
        config["port"] = int(str(config.get("port", 5710))) + int(parallel.data_parallel_index)
        config.setdefault("config_fingerprint", _fingerprint(offloading_spec))
        self._config = TierConfig.from_dict(config)
        engine_id = str(offloading_spec.config.engine_id)
        self._region = _region(primary_kv_view, engine_id)
        # vLLM's region file outlives its engine (see _drop_region_name): while we
        # start, our claim lets the next node on this machine remove it if we die.
        claim = Claim(self._region.shm_path) if self._region.shm_path else None
        trace = _trace_from_env()
        try:
            self._node: DrivenTier = open_node(
                self._config, self._region, hash_seed=_hash_seed, wake_host=_EngineWaker(),
                trace=trace,
            )  # fmt: skip
        finally:
            if claim is not None:
                _drop_region_name(self._region.shm_path, claim)
        self._prompt_keys = PromptKeys(offloading_spec)
        self._serve_contexts: dict[str, ReqContext] = {}
        self._early: list[JobResult] = []  # collected while a promotion was waited for
        self._stats = StatsSource(self._node)
        _LIVE.add(self)
        held = self._node.tier.held()
        log.warning(
            "kvpeer tier %s ready: %d blocks x %d bytes, data planes %s, held blocks %s",
            self._node.tier.peer_id,
            self._region.num_blocks,
            self._region.block_len,
            ",".join(self._node.tier.data_planes),
            "off" if held is None else f"up to {held.statistics().capacity_bytes / 2**20:.0f} MiB"
            + (" (a quarter of the CPU tier)" if self._config.held_bytes is None else ""),
        )

    @property
    def node(self) -> DrivenTier:
        return self._node

    @staticmethod
    def _context(req_context: ReqContext) -> RequestContext:
        cached = req_context.get_state(RequestContext)
        if cached is None:
            cached = RequestContext(
                req_context.req_id,
                req_context.kv_transfer_params,
                key_position=lambda key: req_context.get_offload_key_position(OffloadKey(key)),
            )
            req_context.set_state(cached)
        return cached

    def _job(self, job: VllmTransferJob) -> TransferJob:
        return TransferJob(
            int(job.job_id),
            tuple(job.keys),
            tuple(int(s) for s in job.chunk_ids),
            self._context(job.req_context),
        )

    # -- SecondaryTierManager --------------------------------------------------------

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        """kvpeer's catalog as ``vllm:kvpeer_*`` (kvpeer.integrations.vllm.metrics)."""
        return metric_definitions()

    def get_stats(self) -> OffloadingConnectorStats | None:
        return self._stats.take()

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        policy = self._node.on_new_request(self._context(req_context))
        return RequestOffloadingContext(policy=VllmOffloadPolicy(policy.value))

    def lookup(self, key: Key, req_context: ReqContext) -> VllmLookupResult:
        return _TO_VLLM_LOOKUP[self._node.lookup(key, self._context(req_context))]

    def submit_store(self, job_metadata: VllmTransferJob) -> None:
        self._node.submit_store(self._job(job_metadata))

    def submit_load(self, job_metadata: VllmTransferJob) -> None:
        self._node.submit_load(self._job(job_metadata))

    def get_finished_jobs(self) -> Iterable[VllmJobResult]:
        finished, self._early = [*self._early, *self._node.get_finished_jobs()], []
        return [
            VllmJobResult(
                r.job_id,
                r.success,
                transfer_time=r.transfer_seconds,
                transfer_bytes=r.transfer_bytes,
            )
            for r in finished
        ]

    # -- for KVPeerTieringManager (kvpeer.integrations.vllm.manager) --------------------

    def batches_promotions(self, req_context: ReqContext) -> bool:
        """Whether the request's source holds its blocks, so the manager may promote a
        whole run of keys in one job and wait for it."""
        return self._node.pull_confirmed(self._context(req_context))

    def promote_now(self, job: VllmTransferJob) -> bool:
        """Submit promotion ``job`` at once and wait up to ``sync_pull_wait_s`` for its
        result (only when its source holds the blocks); True: the result is ready and
        the next ``get_finished_jobs`` reports it."""
        request = self._context(job.req_context)
        self._node.submit_load(self._job(job))
        wait_s = self._config.sync_pull_wait_s
        if wait_s <= 0 or not self._node.pull_confirmed(request):
            return self._collected(job.job_id)
        start = time.monotonic()
        done = self._wait_collected(job.job_id, start + wait_s)
        self._node.promotion_waited(request, time.monotonic() - start, done)
        return done

    def reset_staging(self) -> frozenset[int]:
        """vLLM dropped its CPU cache: drop what was staged; the rows staging holds."""
        return self._node.reset_staging()

    def stages(self, key: OffloadKey, req_context: ReqContext) -> bool:
        """``key`` was pulled ahead, or is being, for this request (kvpeer.node.ahead)."""
        return self._node.staged_state([key], self._context(req_context)) is not None

    def take_staged(self, job: VllmTransferJob) -> list[int] | None:
        """Pulled ahead (kvpeer.node.ahead): the staging rows holding every key of
        promotion ``job``, which the manager puts in the CPU tier's cache in place of the
        rows it allocated (``job.chunk_ids``, which staging takes in exchange). Waits up
        to ``sync_pull_wait_s`` for a prefetch still running; None: not every key is
        staged by then (the job then goes the ordinary way)."""
        keys = list(job.keys)
        request = self._context(job.req_context)
        state = self._node.staged_state(keys, request)
        if state is None:
            return None
        start = time.monotonic()
        deadline = start + self._config.sync_pull_wait_s
        while state is False:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self._node.wait_for_work(min(remaining, 0.002))
            state = self._node.staged_state(keys, request)
        if state is None:
            return None
        rows = self._node.adopt_staged(keys, [int(c) for c in job.chunk_ids], request)
        if rows is not None:
            self._node.promotion_waited(request, time.monotonic() - start, True)
        return rows

    def report_adopted(self, job: VllmTransferJob) -> None:
        """``job``'s keys are in the CPU tier already (:meth:`take_staged`): it succeeded,
        moving nothing; the next ``get_finished_jobs`` reports it."""
        self._early.append(JobResult(int(job.job_id), True, 0.0, 0))

    def _wait_collected(self, job_id: int, deadline: float) -> bool:
        woken = False
        while not self._collected(job_id):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if woken:
                # Woken without our result: other jobs' results (now collected) or a
                # peer waiting for our serve window, which cannot come while the engine
                # thread is here; pace the loop rather than spin on that.
                time.sleep(min(0.0005, remaining))
            woken = self._node.wait_for_work(remaining)  # this thread polls meanwhile
        return True

    def _collected(self, job_id: int) -> bool:
        self._early.extend(self._node.get_finished_jobs())
        return any(result.job_id == job_id for result in self._early)

    def staging_wanted(self) -> int:
        """Rows this tier wants withheld for pulling ahead (``staging_blocks``, unless
        nobody may send it a prefetch)."""
        return 0 if self._config.prefetch_trusted().nobody else self._config.staging_blocks

    def configure_staging(self, rows: list[int]) -> None:
        """The manager withheld ``rows`` of the primary region for this tier."""
        region = self._region
        self._node.configure_staging(rows, self._prompt_keys, row_copier(region),
                                     region.block_len)  # fmt: skip
        routers = ",".join(self._config.prefetch_trusted().to_entries() or ["anyone CURVE admits"])
        log.info("kvpeer tier %s pulls ahead for routers at %s: %d staging rows (%.0f MiB)",
                    self._node.tier.peer_id, routers, len(rows),
                    len(rows) * region.block_len / 2**20)  # fmt: skip

    def has_pending_work(self) -> bool:
        return self._node.has_pending_work()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._node.on_request_finished(self._context(req_context))

    def serve_external_requests(self, parent: ParentManager) -> None:
        self._node.serve_external_requests(_Parent(parent, self._serve_contexts))

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._node.on_schedule_end()

    def drain_jobs(self) -> None:
        self._node.drain_jobs()

    @property
    def block_len(self) -> int:
        """Bytes of one block in the primary region (what a loaded block moves)."""
        return self._region.block_len

    def shutdown(self) -> None:
        _LIVE.discard(self)
        self._node.shutdown()
        # Our flat view exports vLLM's mapping; until it is released vLLM cannot
        # unmap its primary region ("cannot close exported pointers exist").
        try:
            self._region.view.release()
        except BufferError as exc:  # a data plane still holds a piece of it
            log.warning("primary region still referenced after shutdown: %s", exc)
