"""vLLM's tiering manager with pulls that finish inside the scheduler step that asked.

vLLM 0.32's ``TieringOffloadingManager`` turns a secondary tier's HIT into a
*promotion*: it reserves a primary slot for the one key looked up, answers
HIT_PENDING, and submits every key reserved in the step as one job at the step's
end (``on_schedule_end``); the next step learns the job finished and only then
answers HIT. With the connector's asynchronous load into the KV cache after that,
a prefix pulled from a peer cost its request two engine steps more than a local
hit (issue 27). :class:`KVPeerTieringManager` changes one thing, for kvpeer tiers
only: when a kvpeer tier answers HIT it reserves, in one job, that key and every
following key of the request the tier also answers HIT at once, submits the job
immediately, and waits a bounded time (the tier's ``sync_pull_wait_s``) for the
tier to report it. If the pull finished, the promotion completes there and the
lookup answers HIT, in the same step; if not, the job simply stays in flight and
completes the way vLLM's own do (HIT_PENDING now, HIT in a later step). With
:class:`kvpeer.integrations.vllm.connector.KVPeerOffloadingConnector` loading
synchronously, a pulled prefix is then computed into the KV cache in the very step
that found it.

Invariants:

1. Bookkeeping is vLLM's: the job is registered, reported and completed through the
   parent class's own job table (``_register_job``, ``_process_finished_jobs``), so a
   job that misses the wait is indistinguishable from one vLLM submitted itself.
2. Every key of a job was reserved in the primary tier by ``prepare_write`` before
   the tier could write it, and is made readable only by the job's success
   (``complete_write``); a failed or partial job frees its keys as vLLM's would.
3. The engine thread never waits longer than ``sync_pull_wait_s`` per promotion, and
   not at all for tiers that are not kvpeer's or for requests whose source has not
   confirmed its blocks (a PD consumer sent before its prefill answered may wait for
   a prefill that takes seconds).
4. Only a request whose source holds its blocks is promoted this way; every other
   promotion is vLLM's own (deferred, one job per request and step), because a
   source's promise for a PD request is one fetch for all its keys.
5. Staging rows (pulling ahead) are taken from the CPU tier's allocator at
   construction and never given back: no key of vLLM's ever lives in one while it is
   a staging row, and the CPU tier's free count excludes them, so its evictions stay
   exact.
6. A promotion whose keys were pulled ahead exchanges rows instead of copying: each
   key's ``ChunkStatus`` (just allocated by ``prepare_write``, not yet readable) is
   pointed at the staging row holding its block, and the allocated row becomes a
   staging row. Nothing else holds a freshly allocated row, so after the exchange every
   row is either the CPU tier's or staging's, never both; the job is then reported
   done through vLLM's job table like any other (invariant 1).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, OffloadKey, ReqContext
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager, TransferJob
from vllm.v1.kv_offload.tiering.manager import (
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
)

if TYPE_CHECKING:
    from kvpeer.integrations.vllm.secondary_tier import KVPeerTier

__all__ = ["GROUP_BYTES", "KVPeerTieringManager", "following_keys"]

GROUP_BYTES = 4  # an offload key is its block hash, then its group's index in 4 bytes

log = logging.getLogger("kvpeer.vllm")


def following_keys(key: OffloadKey, req_context: ReqContext) -> list[OffloadKey]:
    """The request's keys after ``key`` in its KV-cache group, in prompt order (the
    scheduler records each key's end position in the request's context as it hashes the
    prompt; a key ends in its group's index, ``make_offload_key``)."""
    positions: dict[OffloadKey, int] = req_context._offload_key_positions
    start = positions.get(key)
    if start is None:
        return []
    group = key[-GROUP_BYTES:]
    after = (k for k, end in positions.items() if end > start and k[-GROUP_BYTES:] == group)
    return sorted(after, key=positions.__getitem__)


class KVPeerTieringManager(TieringOffloadingManager):
    """``TieringOffloadingManager`` whose kvpeer tiers promote at once, in one job."""

    def __init__(
        self,
        primary_tier: CPUPrimaryTierOffloadingManager,
        secondary_tiers: list[SecondaryTierManager] | None = None,
        **options: float,
    ) -> None:
        # options: what this vLLM's manager takes besides (0.33+: tier_poll_interval_s)
        super().__init__(primary_tier, secondary_tiers, **options)
        from kvpeer.integrations.vllm.secondary_tier import KVPeerTier

        self._kvpeer: dict[int, KVPeerTier] = {
            index: tier
            for index, tier in enumerate(self.secondary_tiers)
            if isinstance(tier, KVPeerTier)
        }
        # keys whose promotion ended inside their own lookup -> the primary's answer then
        self._promoted_now: dict[OffloadKey, LookupResult] = {}
        self.sync_promotions = 0  # promotions that finished inside their lookup
        self.late_promotions = 0  # promotions submitted at once that missed the wait
        self.adopted_promotions = 0  # promotions whose rows were staged ahead (no copy)
        for tier in self._kvpeer.values():
            self._withhold_staging(tier)

    def reset_cache(self) -> None:
        """vLLM's reset (sleep, new weights) clears the CPU tier's allocator, which would
        hand staging rows out again: after it, what was staged is dropped and the staging
        rows are withheld again (invariant 5), whichever rows they are by now."""
        super().reset_cache()
        staging: set[int] = set()
        for tier in self._kvpeer.values():
            staging |= tier.reset_staging()
        if staging:
            primary = self.primary_tier
            total = primary._num_chunks
            primary._free_list = [row for row in range(total) if row not in staging]
            primary._num_allocated_chunks = total

    def _withhold_staging(self, tier: KVPeerTier) -> None:
        """Give ``tier`` the staging rows it wants for pulling ahead (kvpeer.node.ahead):
        rows of the primary region taken from the CPU tier's allocator now, before it
        allocated any, and never returned, so vLLM's own cache never uses them
        (invariant 5). At most a quarter of the region."""
        wanted = tier.staging_wanted()
        if wanted <= 0:
            return
        primary = self.primary_tier
        available = primary._get_num_free_chunks() // 4
        if wanted > available:
            log.warning("kvpeer: staging_blocks=%d is over a quarter of the CPU tier's %d "
                        "free rows; withholding %d", wanted, primary._get_num_free_chunks(),
                        available)  # fmt: skip
            wanted = available
        if wanted <= 0:
            return
        chunks = primary._allocate_chunks([OffloadKey(b"")] * wanted)
        tier.configure_staging([int(chunk.chunk_id) for chunk in chunks])

    def lookup(
        self,
        key: OffloadKey,
        req_context: ReqContext,
        *,
        exclude_tier_idx: int | None = None,
    ) -> LookupResult:
        result = super().lookup(key, req_context, exclude_tier_idx=exclude_tier_idx)
        if result is LookupResult.HIT_PENDING:
            # HIT if the job completed; MISS if it failed (the engine computes the key)
            return self._promoted_now.pop(key, result)
        return result

    def _initiate_promotion(self, tier_idx: int, key: OffloadKey, req_context: ReqContext) -> bool:
        tier = self._kvpeer.get(tier_idx)
        if tier is None or not tier.batches_promotions(req_context):
            # vLLM's way: one job per request at the step's end. A PD source still
            # computing its prefill is one of these: a vLLM producer serves one fetch
            # per PD request, so its keys must leave as one job (invariant 4).
            return super()._initiate_promotion(tier_idx, key, req_context)
        keys = [key, *self._also_held(tier, key, req_context)]
        reserved = self.primary_tier.prepare_write(keys, req_context)
        if reserved is None or not reserved.keys_to_store:
            self._metrics.on_promotion_allocation_failure()
            return False
        job_keys = list(reserved.keys_to_store)
        chunk_ids = np.asarray(reserved.store_spec.chunk_ids, dtype=np.int32)  # type: ignore[attr-defined]
        sources = self._request_load_sources.setdefault(req_context.req_id, {})
        for promoted in job_keys:
            sources[promoted] = tier.cache_hit_source
        job = TransferJob(
            job_id=self._next_job_id(),
            keys=job_keys,
            chunk_ids=chunk_ids,
            is_promotion=True,
            req_context=req_context,
        )
        adopted = self._adopt_staged(tier, job)
        if adopted is not None:
            job.chunk_ids = np.asarray(adopted, dtype=np.int32)
        self._register_job(job, tier_idx)
        if adopted is not None:
            tier.report_adopted(job)
        if adopted is not None or tier.promote_now(job):
            self._process_finished_jobs()  # type: ignore[no-untyped-call]  # completes it
            self.sync_promotions += 1
            self._promoted_now[key] = self.primary_tier.lookup(key, req_context)
        else:
            self.late_promotions += 1
        return True

    def _adopt_staged(self, tier: KVPeerTier, job: TransferJob) -> list[int] | None:
        """Pulled ahead (invariant 6): the staging rows holding ``job``'s keys become
        those keys' rows in the CPU tier, and the rows ``prepare_write`` just allocated
        for them become staging rows; the job then moves nothing. None: not staged, or
        the CPU tier's records are not what this expects (the job goes the ordinary
        way, copying from staging)."""
        keys = list(job.keys)
        if not keys or not tier.stages(keys[0], job.req_context):
            return None
        policy = getattr(self.primary_tier, "_policy", None)
        chunks = [policy.get(key) if policy is not None else None for key in keys]
        allocated = [int(c) for c in job.chunk_ids]
        if any(getattr(chunk, "chunk_id", None) != row
               for chunk, row in zip(chunks, allocated, strict=True)):  # fmt: skip
            return None
        rows = tier.take_staged(job)
        if rows is None:
            return None
        for chunk, row in zip(chunks, rows, strict=True):
            chunk.chunk_id = row  # type: ignore[union-attr]
        self.adopted_promotions += 1
        return rows

    def _also_held(
        self, tier: KVPeerTier, key: OffloadKey, req_context: ReqContext
    ) -> Sequence[OffloadKey]:
        """Keys after ``key`` that the primary tier lacks and ``tier`` answers HIT now,
        up to the first that breaks the run (so one job carries the whole prefix)."""
        run: list[OffloadKey] = []
        for following in following_keys(key, req_context):
            if self.primary_tier.lookup(following, req_context) is not LookupResult.MISS:
                break
            if tier.lookup(following, req_context) is not LookupResult.HIT:
                break
            run.append(following)
        return run
