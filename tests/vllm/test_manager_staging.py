"""kvpeer's tiering manager and the staging rows of pulling ahead, on vLLM's own CPU tier:
rows are withheld from vLLM's allocator at start and again after vLLM's cache reset
(which clears the allocator), and a staged prompt is exchanged into the cache without a
copy: each key's chunk points at its staging row, and the rows vLLM had allocated become
staging rows (manager invariants 5 and 6)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import OffloadKey, ReqContext, make_offload_key
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager, TransferJob
from vllm.v1.kv_offload.tiering.manager import CPUPrimaryTierOffloadingManager

from kvpeer.integrations.vllm.manager import KVPeerTieringManager
from kvpeer.integrations.vllm.secondary_tier import KVPeerTier

CHUNKS, ROW = 16, 64


class Region:
    """What the CPU tier needs of its region: a (chunks, row) view."""

    def create_kv_memoryview(self) -> memoryview:
        return memoryview(bytearray(CHUNKS * ROW)).cast("B", (CHUNKS, ROW))

    def cleanup(self) -> None:
        pass


class StubTier(KVPeerTier):
    """A kvpeer tier without a node: holds its staging rows, hands some out."""

    def __init__(self, wanted: int, view: memoryview) -> None:
        SecondaryTierManager.__init__(self, None, view, "kvpeer")  # type: ignore[arg-type]
        self.wanted = wanted
        self.rows: set[int] = set()
        self.staged: dict[OffloadKey, int] = {}
        self.resets = 0

    def staging_wanted(self) -> int:
        return self.wanted

    def configure_staging(self, rows: list[int]) -> None:
        self.rows = set(rows)

    def reset_staging(self) -> frozenset[int]:
        self.resets += 1
        self.staged.clear()
        return frozenset(self.rows)

    def stages(self, key: OffloadKey, req_context: ReqContext) -> bool:
        return key in self.staged

    def take_staged(self, job: Any) -> list[int] | None:
        keys = list(job.keys)
        if any(key not in self.staged for key in keys):
            return None
        taken = [self.staged.pop(key) for key in keys]
        self.rows.difference_update(taken)
        self.rows.update(int(c) for c in job.chunk_ids)
        return taken

    def drain_jobs(self) -> None:
        pass

    def get_finished_jobs(self) -> list[Any]:
        return []


def keys(*numbers: int) -> list[OffloadKey]:
    return [make_offload_key(bytes([n]) * 32, 0) for n in numbers]


def manager(wanted: int) -> tuple[KVPeerTieringManager, CPUPrimaryTierOffloadingManager, StubTier]:
    primary = CPUPrimaryTierOffloadingManager(CHUNKS, Region())  # type: ignore[arg-type]
    tier = StubTier(wanted, primary.get_kv_memoryview())
    return KVPeerTieringManager(primary, [tier]), primary, tier


def fill(primary: CPUPrimaryTierOffloadingManager, wanted: Sequence[OffloadKey]) -> list[int]:
    """Store ``wanted`` in the CPU tier; the rows it put them in."""
    context = ReqContext("fill")
    out = primary.prepare_store(list(wanted), context)
    assert out is not None
    primary.complete_store(list(wanted), context, True)
    return [int(c) for c in out.store_spec.chunk_ids]  # type: ignore[attr-defined]


def test_staging_rows_are_never_vllms_even_after_a_cache_reset() -> None:
    ours, primary, tier = manager(4)
    assert len(tier.rows) == 4
    assert primary._get_num_free_chunks() == CHUNKS - 4
    assert not set(fill(primary, keys(*range(CHUNKS - 4)))) & tier.rows
    assert not set(fill(primary, keys(99))) & tier.rows  # a full tier evicts: not into staging
    ours.reset_cache()
    assert tier.resets == 1
    assert primary._get_num_free_chunks() == CHUNKS - 4
    assert not set(fill(primary, keys(*range(50, 50 + CHUNKS - 4)))) & tier.rows


def test_a_staged_prompt_is_exchanged_into_the_cache_without_a_copy() -> None:
    ours, primary, tier = manager(4)
    staging = sorted(tier.rows)
    wanted = keys(1, 2)
    tier.staged = dict(zip(wanted, staging[:2], strict=True))
    context = ReqContext("r")
    reserved = primary.prepare_write(wanted, context)
    assert reserved is not None
    allocated = [int(c) for c in reserved.store_spec.chunk_ids]  # type: ignore[attr-defined]
    job = TransferJob(1, wanted, np.asarray(allocated, dtype=np.int32), True, context)
    assert ours._adopt_staged(tier, job) == staging[:2]
    assert [int(c) for c in job.chunk_ids] == allocated  # the caller sets them
    primary.complete_write(wanted, context, True)
    loaded = primary.prepare_load(wanted, context)
    assert [int(c) for c in loaded.chunk_ids] == staging[:2]  # type: ignore[attr-defined]
    assert tier.rows == set(staging[2:]) | set(allocated)  # the exchange, row for row
    assert ours.adopted_promotions == 1


def test_nothing_is_exchanged_when_the_cpu_tier_is_not_as_expected() -> None:
    ours, primary, tier = manager(4)
    wanted = keys(1)
    staged_row = min(tier.rows)
    tier.staged = {wanted[0]: staged_row}
    context = ReqContext("r")
    assert primary.prepare_write(wanted, context) is not None
    job = TransferJob(1, wanted, np.asarray([CHUNKS - 1], dtype=np.int32), True, context)
    assert ours._adopt_staged(tier, job) is None  # the chunk ids do not match the job
    assert tier.staged == {wanted[0]: staged_row}  # the tier gave nothing away
