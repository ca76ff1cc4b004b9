"""``kvpeer serve``: a standalone node over a reference host, for operators and tests."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from kvpeer.config import TierConfig
from kvpeer.host import BlockPool, TieringHost
from kvpeer.node.build import open_node
from kvpeer.node.driver import DrivenTier, DriverCrashed
from kvpeer.node.synthetic import synthetic_block, synthetic_key
from kvpeer.transport.data.base import PrimaryRegion

__all__ = ["serve"]

STATS_EVERY_S = 10.0


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.4g} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def preload_synthetic(pool: BlockPool, count: int) -> None:
    """Store synthetic blocks ``0..count-1`` as READY slots of ``pool``."""
    if count > pool.num_blocks:
        raise ValueError(
            f"--synthetic-blocks {count} exceeds the region's {pool.num_blocks} blocks"
        )
    for index in range(count):
        slot = pool.allocate(synthetic_key(index))
        if slot is None:
            raise RuntimeError(f"no free slot for synthetic block {index}")
        pool.write(slot, synthetic_block(index, pool.block_len))
        pool.complete_write(slot, True)


def serve(
    config: TierConfig,
    *,
    num_blocks: int,
    block_len: int,
    synthetic_blocks: int = 0,
    duration_s: float | None = None,
    ready_file: str | None = None,
    attach: Callable[[DrivenTier], Callable[[], None]] | None = None,
    out: TextIO,
    trim_heap: bool = True,
) -> int:
    """Run until interrupted (or ``duration_s``); returns the exit status.

    ``attach`` is called with the node once it listens (e.g. to serve its
    metrics, a layer above this one); what it returns is called at the end.
    ``trim_heap``: the node owns this process, so its driver hands freed heap
    memory back to the system (:mod:`kvpeer.node.trim`)."""
    shm_path = None
    if "shm" in config.data_transports:
        shm_path = f"/dev/shm/kvpeer-serve-{os.getpid()}-{config.port}"
    pool = BlockPool(num_blocks, block_len, shm_path=shm_path)
    status = 0
    try:
        preload_synthetic(pool, synthetic_blocks)
        region = PrimaryRegion(pool.view, num_blocks, block_len, pool.shm_path)
        node = open_node(config, region, trim_heap=trim_heap)
        host = TieringHost(pool, [node])
        peer_id = node.tier.peer_id
        print(
            f"kvpeer serve: node {peer_id}, {num_blocks} blocks x {_human(block_len)} "
            f"({_human(num_blocks * block_len)}), data planes "
            f"{','.join(node.tier.data_planes)}, hash seed {config.hash_seed!r}",
            file=out,
            flush=True,
        )
        if synthetic_blocks:
            print(
                f"kvpeer serve: preloaded {synthetic_blocks} synthetic blocks", file=out, flush=True
            )
        try:
            detach = attach(node) if attach is not None else None
        except BaseException:  # e.g. its port in use: the node must not outlive it
            host.shutdown()
            raise
        if ready_file:
            Path(ready_file).write_text(peer_id)
        print("kvpeer serve: serving; Ctrl-C to stop", file=out, flush=True)
        started = last_stats = time.monotonic()
        stop = _StopOnSignal(node)
        try:
            while not stop.requested and (
                duration_s is None or time.monotonic() - started < duration_s
            ):
                node.wait_for_work(0.5)
                host.step()
                if time.monotonic() - last_stats >= STATS_EVERY_S:
                    last_stats = time.monotonic()
                    stats = node.statistics()
                    print(
                        f"kvpeer serve: sessions={stats.sessions} "
                        f"transfers_in_flight={stats.transfers_in_flight} "
                        f"pinned={stats.pinned_blocks}",
                        file=out,
                        flush=True,
                    )
            if stop.requested:
                print(f"kvpeer serve: stopping ({stop.requested})", file=out, flush=True)
        except KeyboardInterrupt:
            print("kvpeer serve: stopping", file=out, flush=True)
        except DriverCrashed as exc:
            print(f"kvpeer serve: stopping: {exc}", file=out, flush=True)
            status = 1
        finally:
            stop.restore()
            if detach is not None:
                detach()
            host.shutdown()
    finally:
        pool.close()
    return status


class _StopOnSignal:
    """SIGINT and SIGTERM ask the serve loop to stop instead of raising where they
    land: this thread also polls the tier (:meth:`DrivenTier.wait_for_work`), and an
    exception raised in the middle of a poll would be taken for a driver crash. The
    handler only sets a flag and writes the loop's wake-up descriptor (no lock)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, node: DrivenTier) -> None:
        self.requested = ""
        self._node = node
        self._previous = {signum: signal.signal(signum, self._handle) for signum in self.SIGNALS}

    def _handle(self, signum: int, frame: object) -> None:
        self.requested = signal.Signals(signum).name
        self._node.loop.wake()

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
