"""Offloading specs that let vLLM's ``OffloadingConnector`` run on the CPU platform.

What vLLM 0.32 refuses: ``CPUOffloadingSpec.get_worker`` (inherited by
``TieringOffloadingSpec``) raises "CPU Offloading is currently only supported on
CUDA-alike and XPU GPUs" on any other platform, and its ``CPUOffloadingWorker`` copies
with device streams, timing events and ``swap_blocks`` kernels that assert CUDA/XPU
tensors. Everything on the scheduler side (offloading manager, CPU primary tier,
secondary tiers) is plain Python and runs on CPU unchanged.

What these specs change: only the worker. :class:`CpuOffloadingSpec` and
:class:`CpuTieringOffloadingSpec` inherit all configuration and the scheduler side from
their vLLM parents and return a :class:`CpuCopyOffloadingWorker`, which copies pages
between the engine's KV cache tensors (CPU memory) and the primary region with
``ctypes.memmove``. Select them in ``kv_connector_extra_config``::

    {"spec_name": "CpuTieringOffloadingSpec",
     "spec_module_path": "kvpeer.integrations.vllm.cpu_spec",
     "cpu_bytes_to_use": 67108864, "secondary_tiers": [...]}

Invariants:

1. A job is copied completely inside ``submit_store`` / ``submit_load``; the next
   ``get_finished`` reports it exactly once, successful. ``wait`` never waits.
2. Page addresses come from vLLM's ``compute_sub_block_ptrs``, so chunks of several
   blocks (``blocks_per_chunk > 1``) and partial first chunks address the same bytes
   as vLLM's own worker does.
3. With the tiering spec the worker writes the rows of the ``SharedOffloadRegion``
   named by ``engine_id`` that the scheduler-side primary tier maps, so secondary
   tiers read and write the very bytes the engine loads, also when the worker runs
   in another process than the scheduler.
4. Every block and chunk id of a job is bounds-checked before the first byte moves:
   a bad id raises instead of writing outside a tensor, and no job is half copied.
5. The canonical host layout (``canonical_layout``) is not supported and is refused
   when the worker is built.
6. One worker for every vLLM: 0.32 passes the engine side as a ``GPULoadStoreSpec``
   (block ids), 0.34 as ``DevicePointers`` (addresses vLLM resolved, one per block and
   KV reference, group by group); 0.33 adds ``expedited=`` to ``submit_load`` (a copy
   here is never queued, so it changes nothing). Resolved addresses are checked to lie
   on a page of their tensor before the first byte moves, as block ids are (invariant 4).
"""

from __future__ import annotations

import ctypes
import inspect
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt
import torch
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingManager,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.gpu_worker import compute_sub_block_ptrs
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvpeer.integrations.vllm.manager import KVPeerTieringManager

__all__ = [
    "CpuCopyOffloadingWorker",
    "CpuOffloadingSpec",
    "CpuTieringOffloadingSpec",
    "KVPeerTieringOffloadingSpec",
]

_Pointers = npt.NDArray[np.uint64]


class _ResolvedPointers(Protocol):
    """vLLM 0.34's ``DevicePointers``: the engine side of a job as addresses, in canonical
    order (each group, each of its KV references, each of its blocks)."""

    ptrs: _Pointers
    sizes: _Pointers
    group_block_counts: tuple[int, ...]
    group_data_ref_counts: tuple[int, ...]
    block_indices: tuple[int, ...]


EngineSide = GPULoadStoreSpec | _ResolvedPointers


@dataclass(frozen=True)
class _CopyRun:
    """``size``-byte pages: ``engine[i]`` and ``primary[i]`` are one page's two homes."""

    engine: _Pointers
    primary: _Pointers
    size: int


class CpuCopyOffloadingWorker(OffloadingWorker):
    """Moves KV pages between CPU-resident engine KV caches and a primary region.

    The engine side of every transfer is one page (one block) per KV tensor; the
    primary side is a chunk row holding ``blocks_per_chunk`` such pages per tensor.
    Jobs complete synchronously (invariant 1).
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        blocks_per_chunk: int,
        num_chunks: int,
        region: SharedOffloadRegion | None = None,
    ) -> None:
        """Build one engine view and one primary view per KV tensor.

        With ``region`` the primary views are this rank's slots of the shared region
        and the worker owns the region from now on (``shutdown`` releases it);
        without, the primary is a private zeroed tensor of ``num_chunks`` rows.
        """
        if blocks_per_chunk < 1:
            raise ValueError(f"blocks_per_chunk must be >= 1, got {blocks_per_chunk}")
        self._blocks_per_chunk = blocks_per_chunk
        self._region = region
        self._group_refs: list[list[CanonicalKVCacheRef]] = kv_caches.group_data_refs
        self._engine: list[torch.Tensor] = []
        self._primary: list[torch.Tensor] = []
        self._finished: list[TransferResult] = []
        for kv_tensor in kv_caches.tensors:
            page_size = kv_tensor.page_size_bytes
            # The same (num_blocks, page) byte view vLLM's CPUOffloadingWorker builds.
            engine_view = kv_tensor.tensor.view(torch.int8).view((-1, page_size))
            if engine_view.device.type != "cpu":
                raise ValueError(
                    f"CpuCopyOffloadingWorker needs KV caches in CPU memory, "
                    f"got a tensor on {engine_view.device}"
                )
            chunk_size = page_size * blocks_per_chunk
            if region is not None:
                primary_view = region.create_next_worker_view(chunk_size)
            else:
                primary_view = torch.zeros((num_chunks, chunk_size), dtype=torch.int8)
            self._engine.append(engine_view)
            self._primary.append(primary_view)
        for refs in self._group_refs:
            for ref in refs:
                if ref.page_size_bytes > self._engine[ref.tensor_idx].shape[1]:
                    raise ValueError(
                        f"KV reference of {ref.page_size_bytes} bytes exceeds its "
                        f"tensor's page of {self._engine[ref.tensor_idx].shape[1]} bytes"
                    )

    @property
    def primary_tensors(self) -> tuple[torch.Tensor, ...]:
        """The primary-side int8 views, ``(num_chunks, page * blocks_per_chunk)`` each."""
        return tuple(self._primary)

    def submit_store(self, job_id: int, src_spec: EngineSide, dst_spec: LoadStoreSpec) -> bool:
        """Copy engine blocks into primary chunks now (engine -> primary)."""
        self._finished.append(self._copy(job_id, src_spec, dst_spec, to_primary=True))
        return True

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: EngineSide,
        expedited: bool = False,
    ) -> bool:
        """Copy primary chunks into engine blocks now (primary -> engine); every copy is
        immediate, so ``expedited`` (vLLM 0.33+: waited for in the step) changes nothing."""
        self._finished.append(self._copy(job_id, dst_spec, src_spec, to_primary=False))
        return True

    def get_finished(self) -> list[TransferResult]:
        """Every job submitted since the last call, each reported once."""
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        """Nothing to wait for: every submitted job is already complete."""

    def shutdown(self) -> None:
        """Drop the views, then release the shared region if this worker owns one."""
        self._engine.clear()
        # The views export the region's buffer; they must go before the mmap closes.
        self._primary.clear()
        self._finished.clear()
        if self._region is not None:
            self._region.cleanup()
            self._region = None

    def _copy(
        self,
        job_id: int,
        engine_spec: EngineSide,
        primary_spec: LoadStoreSpec,
        *,
        to_primary: bool,
    ) -> TransferResult:
        started = time.perf_counter()
        runs = self._plan(engine_spec, primary_spec)
        num_bytes = 0
        for run in runs:
            sources, destinations = (
                (run.engine, run.primary) if to_primary else (run.primary, run.engine)
            )
            for source, destination in zip(sources.tolist(), destinations.tolist(), strict=True):
                ctypes.memmove(destination, source, run.size)
            num_bytes += len(run.engine) * run.size
        return TransferResult(
            job_id=job_id,
            success=True,
            transfer_size=num_bytes,
            transfer_time=time.perf_counter() - started,
        )

    def _plan(self, engine_spec: EngineSide, primary_spec: LoadStoreSpec) -> list[_CopyRun]:
        """Engine-page -> primary-page address pairs of one job, validated up front.

        Blocks arrive ordered by KV-cache group; group ``g`` has ``group_sizes[g]``
        engine blocks that are logically contiguous from request block
        ``block_indices[g]``, so its first primary chunk may start mid-chunk.
        """
        if not isinstance(primary_spec, BlockIDsLoadStoreSpec):
            raise TypeError(f"expected a chunk-id spec, got {type(primary_spec).__name__}")
        resolved: _ResolvedPointers | None = None
        if isinstance(engine_spec, GPULoadStoreSpec):
            block_ids = engine_spec.block_ids
            group_sizes: Sequence[int] = engine_spec.group_sizes
            block_indices: Sequence[int] = engine_spec.block_indices
        else:  # invariant 6: vLLM 0.34 resolved the engine's addresses itself
            resolved = engine_spec
            group_sizes, block_indices = resolved.group_block_counts, resolved.block_indices
            block_ids = np.zeros(sum(group_sizes), dtype=np.int32)  # only counted
        chunk_ids = primary_spec.block_ids
        if len(group_sizes) != len(self._group_refs):
            raise ValueError(
                f"job names {len(group_sizes)} KV-cache groups, "
                f"the worker has {len(self._group_refs)}"
            )
        if resolved is None:
            self._check_bounds("block", block_ids, self._engine)
        else:
            self._check_resolved(resolved)
        self._check_bounds("chunk", chunk_ids, self._primary)
        resolved_at = 0

        runs: list[_CopyRun] = []
        block_offset = 0
        chunk_offset = 0
        for refs, group_size, first_block in zip(
            self._group_refs, group_sizes, block_indices, strict=True
        ):
            if group_size == 0:
                continue
            skip = first_block % self._blocks_per_chunk
            group_chunks = cdiv(group_size + skip, self._blocks_per_chunk)
            group_block_ids = block_ids[block_offset : block_offset + group_size]
            group_chunk_ids = chunk_ids[chunk_offset : chunk_offset + group_chunks]
            if len(group_block_ids) != group_size or len(group_chunk_ids) != group_chunks:
                raise ValueError(
                    f"job has {len(block_ids)} blocks and {len(chunk_ids)} chunks, "
                    f"too few for groups {list(group_sizes)}"
                )
            for ref in refs:
                engine_pointers = np.empty(group_size, dtype=np.uint64)
                primary_pointers = np.empty(group_size, dtype=np.uint64)
                if resolved is None:
                    compute_sub_block_ptrs(
                        group_block_ids, 1, engine_pointers, self._engine[ref.tensor_idx]
                    )
                else:
                    engine_pointers[:] = resolved.ptrs[resolved_at : resolved_at + group_size]
                    resolved_at += group_size
                compute_sub_block_ptrs(
                    group_chunk_ids,
                    self._blocks_per_chunk,
                    primary_pointers,
                    self._primary[ref.tensor_idx],
                    skip_count=skip,
                )
                runs.append(_CopyRun(engine_pointers, primary_pointers, ref.page_size_bytes))
            block_offset += group_size
            chunk_offset += group_chunks
        if block_offset != len(block_ids) or chunk_offset != len(chunk_ids):
            raise ValueError(
                f"job has {len(block_ids)} blocks and {len(chunk_ids)} chunks, "
                f"groups {list(group_sizes)} use {block_offset} and {chunk_offset}"
            )
        return runs

    def _check_resolved(self, resolved: _ResolvedPointers) -> None:
        """Every address of a resolved job starts a whole page of the tensor its KV
        reference names, with the page size of that reference (invariants 4 and 6)."""
        counts = tuple(len(refs) for refs in self._group_refs)
        if tuple(resolved.group_data_ref_counts) != counts:
            raise ValueError(f"job has KV references {tuple(resolved.group_data_ref_counts)}, "
                             f"the worker has {counts}")  # fmt: skip
        at = 0
        for refs, group_size in zip(self._group_refs, resolved.group_block_counts, strict=True):
            for ref in refs:
                ptrs = np.asarray(resolved.ptrs[at : at + group_size], dtype=np.uint64)
                sizes = np.asarray(resolved.sizes[at : at + group_size], dtype=np.uint64)
                if len(ptrs) != group_size or len(sizes) != group_size:
                    raise ValueError(f"job resolves {len(resolved.ptrs)} addresses, too few "
                                     f"for groups {list(resolved.group_block_counts)}")  # fmt: skip
                at += group_size
                if group_size == 0:
                    continue
                engine = self._engine[ref.tensor_idx]
                base, page = engine.data_ptr(), int(engine.shape[1])
                offsets = ptrs.astype(np.int64) - base
                if (sizes != ref.page_size_bytes).any() or (offsets < 0).any() or (
                    offsets % page
                ).any() or int(offsets.max()) // page >= int(engine.shape[0]):
                    raise IndexError(
                        f"an address of the job is not a page of KV tensor {ref.tensor_idx}"
                    )
        if at != len(resolved.ptrs):
            raise ValueError(f"job resolves {len(resolved.ptrs)} addresses, groups use {at}")

    @staticmethod
    def _check_bounds(kind: str, ids: npt.NDArray[np.int32], tensors: list[torch.Tensor]) -> None:
        if len(ids) == 0 or not tensors:
            return
        rows = min(int(tensor.shape[0]) for tensor in tensors)
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= rows:
            raise IndexError(f"{kind} id out of range [0, {rows}): min {low}, max {high}")


class CpuOffloadingSpec(CPUOffloadingSpec):
    """``CPUOffloadingSpec`` with the CPU copy worker: plain CPU offload, no tiers.

    The primary is a private tensor of the worker (vLLM maps a shared region only on
    CUDA-alike and XPU platforms, and nothing else reads this one).
    """

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        self._cpu_worker: CpuCopyOffloadingWorker | None = None

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        """The worker of this spec, built on first call (platform check skipped)."""
        if self._cpu_worker is None:
            _refuse_canonical_layout(self.config)
            self._cpu_worker = CpuCopyOffloadingWorker(
                kv_caches, self.blocks_per_chunk, self.num_chunks
            )
        return self._cpu_worker


class KVPeerTieringOffloadingSpec(TieringOffloadingSpec):
    """``TieringOffloadingSpec`` whose manager promotes kvpeer pulls inside the lookup
    that found them (:class:`kvpeer.integrations.vllm.manager.KVPeerTieringManager`).

    A drop-in for vLLM's own spec on GPU engines (``"spec_name":
    "KVPeerTieringOffloadingSpec", "spec_module_path":
    "kvpeer.integrations.vllm.cpu_spec"``): configuration, primary tier, secondary
    tiers and worker are vLLM's; only the manager's lookup differs, and only for
    kvpeer tiers.
    """

    def get_manager(self) -> OffloadingManager:
        manager = super().get_manager()
        if isinstance(manager, KVPeerTieringManager):
            return manager
        assert isinstance(manager, TieringOffloadingManager)
        # vLLM 0.33+ gives its manager a tier-poll thread (for tiers that opt in, such as
        # vLLM's p2p), started as it is built: stopped before kvpeer's manager takes the
        # same tiers, or two threads would call them under two locks. Feature-detected,
        # as is the interval kvpeer's manager (a TieringOffloadingManager too) polls at.
        stop = getattr(manager, "_stop_tier_poll_thread", None)
        if stop is not None:
            stop()
        options: dict[str, float] = {}
        interval = getattr(self, "tier_poll_interval_s", None)
        if interval is not None and "tier_poll_interval_s" in inspect.signature(
            TieringOffloadingManager.__init__
        ).parameters:
            options["tier_poll_interval_s"] = float(interval)
        # vLLM built the tiers; the same parts go into kvpeer's manager, which takes
        # the place of vLLM's before anyone holds it (the spec caches its manager).
        ours = KVPeerTieringManager(manager.primary_tier, manager.secondary_tiers, **options)
        self._manager = ours
        return ours


class CpuTieringOffloadingSpec(KVPeerTieringOffloadingSpec):
    """``TieringOffloadingSpec`` (CPU primary + secondary tiers) with the CPU copy worker
    and kvpeer's manager (:class:`KVPeerTieringOffloadingSpec`).

    The worker maps ``/dev/shm/vllm_offload_<engine_id>.mmap`` exactly as vLLM's
    tiering worker does (this rank's slot of each chunk row), which is the region the
    scheduler-side primary tier hands to secondary tiers as ``primary_kv_view``.
    """

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        self._cpu_worker: CpuCopyOffloadingWorker | None = None

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        """The worker of this spec, built on first call (platform check skipped)."""
        if self._cpu_worker is None:
            _refuse_canonical_layout(self.config)
            rank = 0 if self.replicated_layout else self.config.parallel.rank
            region = SharedOffloadRegion(
                engine_id=self.config.engine_id,
                num_chunks=self.num_chunks,
                rank=rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
            )
            try:
                self._cpu_worker = CpuCopyOffloadingWorker(
                    kv_caches, self.blocks_per_chunk, self.num_chunks, region
                )
            except Exception:
                region.cleanup()
                raise
        return self._cpu_worker


def _refuse_canonical_layout(config: OffloadingConfig) -> None:
    if config.canonical_layout:
        raise ValueError(
            "canonical_layout is not supported by kvpeer's CPU offloading specs; "
            "remove it from kv_connector_extra_config"
        )
