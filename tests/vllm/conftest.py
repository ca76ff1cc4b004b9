"""Fixtures of the real-vLLM tests: the tiny checkpoint and the engine launcher.

Engines run as subprocesses through :class:`kvpeer.lab.engines.launcher.EngineLauncher`
(the code ``kvpeer demo`` uses too). Independent scenarios start together so their
imports and start-up overlap on the machine's cores; ``KVPEER_VLLM_JOBS`` caps how many
scenarios run at once (default: the number of cores, at most 3; ``1`` runs them one
after another). Every engine gets a unique ``engine_id``; whatever happens, the module's
finalizer stops the processes still running and removes the
``/dev/shm/vllm_offload_<engine_id>.mmap`` files they left.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpeer.lab.engines.launcher import MAX_JOBS, EngineLauncher
from kvpeer.lab.engines.model import SERVE_LLAMA_CONFIG, ensure_llama, ensure_tiny_llama


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama checkpoint every engine of the session loads."""
    return ensure_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="session")
def serve_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The serving demo's larger random Llama (pulling a prompt beats computing it)."""
    return ensure_llama(tmp_path_factory.mktemp("model") / "serve-llama", SERVE_LLAMA_CONFIG)


@pytest.fixture(scope="module")
def launcher(
    tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineLauncher]:
    default_jobs = max(1, min(MAX_JOBS, os.cpu_count() or 1))
    jobs = int(os.environ.get("KVPEER_VLLM_JOBS", str(default_jobs)))
    engines = EngineLauncher(tiny_llama, tmp_path_factory.mktemp("engine-logs"), jobs)
    try:
        yield engines
    finally:
        engines.close()
