"""What every real-network test shares: constants, waits, ports, keys, configs."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from kvpeer.config import TierConfig
from kvpeer.lab.engines import launcher
from kvpeer.node.synthetic import synthetic_key
from kvpeer.types import Key

__all__ = [
    "BLOCK_LEN",
    "DEADLINE_S",
    "HASH_SEED",
    "SHM_PREFIX",
    "START_DEADLINE_S",
    "cpu_seconds",
    "free_port",
    "keys_of",
    "plane_params",
    "tier_config",
    "unique_shm_path",
    "wait_until",
]

HASH_SEED = "vllm-none-hash"
BLOCK_LEN = 64 * 1024
#: Upper bound of every wait in these tests.
DEADLINE_S = 10.0
#: Starting a node process (imports, NIXL/UCX set-up) on a busy 2-core machine.
START_DEADLINE_S = 60.0
SHM_PREFIX = "/dev/shm/kvpeer-nettest-"


def wait_until(
    predicate: Callable[[], bool], timeout_s: float = DEADLINE_S, interval_s: float = 0.01
) -> bool:
    """Poll ``predicate`` until it holds (True) or ``timeout_s`` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now, outside the kernel's ephemeral range."""
    return launcher.free_port(host)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time process ``pid`` used so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def plane_params() -> list[object]:
    """Every data plane as pytest parameters; nixl is skipped only where it is missing."""
    import pytest

    from kvpeer.transport.data.nixl import INSTALL_HINT, NixlBackend

    # Slow: real NIXL agents in two processes take seconds to set up (and a lost peer
    # tens of seconds to notice); tests/transport covers nixl in the fast loop.
    nixl = pytest.param(
        "nixl",
        marks=[
            pytest.mark.slow,
            pytest.mark.skipif(not NixlBackend.available(), reason=INSTALL_HINT),
        ],
    )
    return ["tcp", "shm", nixl]


def keys_of(indexes: Sequence[int]) -> list[Key]:
    return [synthetic_key(i) for i in indexes]


def unique_shm_path(tag: str) -> str:
    return f"{SHM_PREFIX}{os.getpid()}-{tag}-{uuid.uuid4().hex[:8]}"


def tier_config(
    plane: str | Sequence[str], host: str = "127.0.0.1", port: int = 0, **overrides: object
) -> TierConfig:
    planes = [plane] if isinstance(plane, str) else list(plane)
    mapping: dict[str, object] = {
        "host": host,
        "port": port,
        "data_transports": planes,
        "hash_seed": HASH_SEED,
    }
    if "nixl" in planes:
        mapping["nixl_peers"] = ["127.0.0.0/8"]  # every node of these tests is local
    mapping.update(overrides)
    return TierConfig.from_dict(mapping)
