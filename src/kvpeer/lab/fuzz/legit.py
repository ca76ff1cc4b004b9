"""A legitimate peer: a real kvpeer consumer node that pulls synthetic blocks byte-exact.

Each :class:`LegitConsumer` is a node on one data plane (so the node under test
must write into it over that plane), over its own block pool, driven the way an
engine would through :class:`~kvpeer.lab.pull.Puller`.
"""

from __future__ import annotations

import os
import random
import time
import uuid
from dataclasses import dataclass

from kvpeer.config import TierConfig
from kvpeer.host import BlockPool
from kvpeer.lab.pull import Puller
from kvpeer.node.build import open_node
from kvpeer.node.driver import DrivenTier
from kvpeer.node.synthetic import synthetic_block, synthetic_key
from kvpeer.transport.data.base import PrimaryRegion

__all__ = ["LegitConsumer", "PullOutcome"]

PULL_BLOCKS = 16


@dataclass(frozen=True, slots=True)
class PullOutcome:
    plane: str
    ok: bool
    detail: str
    seconds: float

    def to_json(self) -> dict[str, object]:
        return {"plane": self.plane, "ok": self.ok, "detail": self.detail, "seconds": self.seconds}


class LegitConsumer:
    """A consumer node over ``plane`` only, with ``2 * PULL_BLOCKS`` slots."""

    def __init__(self, plane: str, block_len: int, hash_seed: str) -> None:
        self.plane = plane
        self.block_len = block_len
        num_blocks = 2 * PULL_BLOCKS
        shm_path = None
        if plane == "shm":
            shm_path = f"/dev/shm/kvpeer-fuzz-legit-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.pool = BlockPool(num_blocks, block_len, shm_path=shm_path)
        try:
            config = TierConfig.from_dict(
                {
                    "host": "127.0.0.1",
                    "port": 0,
                    "data_transports": [plane],
                    "hash_seed": hash_seed,
                }
            )
            region = PrimaryRegion(self.pool.view, num_blocks, block_len, self.pool.shm_path)
            self.node: DrivenTier = open_node(config, region)
        except BaseException:
            self.pool.close()
            raise
        self._jobs = 1
        self._closed = False

    @property
    def peer_id(self) -> str:
        return self.node.tier.peer_id

    def pull(
        self, node_id: str, synthetic_blocks: int, rng: random.Random, timeout_s: float = 30.0
    ) -> PullOutcome:
        """Pull ``PULL_BLOCKS`` consecutive synthetic blocks into zeroed slots; check bytes."""
        count = min(PULL_BLOCKS, synthetic_blocks)
        first = rng.randrange(synthetic_blocks - count + 1)
        indexes = list(range(first, first + count))
        slots = rng.sample(range(self.pool.num_blocks), count)
        for slot in slots:
            self.pool.slot_view(slot)[:] = bytes(self.block_len)
        puller = Puller(self.node, node_id, job_ids_from=self._jobs)
        self._jobs += 1 << 20
        started = time.monotonic()
        try:
            result = puller.pull([synthetic_key(i) for i in indexes], slots, timeout_s=timeout_s)
        except Exception as exc:  # a crashed consumer driver is a failed pull, reported
            return PullOutcome(self.plane, False, f"{exc!r}", time.monotonic() - started)
        seconds = time.monotonic() - started
        if result.hits != count or not result.loaded:
            detail = f"{result.hits}/{count} hits, loaded={result.loaded}; {self._state()}"
            return PullOutcome(self.plane, False, detail, seconds)
        wrong = [
            index
            for index, slot in zip(indexes, slots, strict=True)
            if self.pool.slot_view(slot) != synthetic_block(index, self.block_len)
        ]
        if wrong:
            return PullOutcome(self.plane, False, f"wrong bytes for blocks {wrong}", seconds)
        return PullOutcome(self.plane, True, "", seconds)

    def _state(self) -> str:
        """What this consumer's own node says, for a failed pull."""
        if self.node.crashed:
            return "the consumer's driver crashed"
        with self.node.locked():
            stats = self.node.tier.statistics()
        return (
            f"consumer sessions={stats.sessions} refused={stats.peers_refused} "
            f"failed_ids={stats.failed_ids}"
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.node.shutdown()
        finally:
            self.pool.close()
