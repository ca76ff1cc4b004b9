"""A node in the test process serving synthetic blocks through a :class:`TieringHost`
stepped by a thread (:class:`ServingNode`)."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from types import TracebackType

from kvpeer.host import TieringHost
from kvpeer.node.tier import TierStatistics
from tests.net.common import BLOCK_LEN, DEADLINE_S
from tests.net.localnode import open_pool_node

__all__ = [
    "ServingNode",
]

class ServingNode:
    """A node serving ``synthetic`` preloaded blocks; a thread steps its host.

    Only the stepping thread touches the host; tests read the tier under its lock.
    """

    def __init__(
        self,
        plane: str | Sequence[str] = "tcp",
        *,
        synthetic: int = 64,
        num_blocks: int = 64,
        block_len: int = BLOCK_LEN,
        host: str = "127.0.0.1",
        port: int = 0,
        config: Mapping[str, object] | None = None,
        **overrides: object,
    ) -> None:
        self.pool, self.node = open_pool_node(
            "serving",
            plane,
            num_blocks,
            block_len,
            host,
            port,
            {**(config or {}), **overrides},
            synthetic=synthetic,
        )
        self.host = TieringHost(self.pool, [self.node])
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="test-serving-host", daemon=True)
        self._thread.start()

    @property
    def peer_id(self) -> str:
        return self.node.tier.peer_id

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.node.wait_for_work(0.05)
                self.host.step()
        except BaseException as exc:  # reported by close() and the tests
            self.error = exc

    def statistics(self) -> TierStatistics:
        with self.node.locked():
            return self.node.tier.statistics()

    def has_session(self, peer_id: str) -> bool:
        with self.node.locked():
            return self.node.tier.session(peer_id) is not None

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(DEADLINE_S)
        try:
            if not self._thread.is_alive():
                self.host.shutdown()
            else:  # pragma: no cover - a hung host; still stop the node
                self.node.shutdown()
        finally:
            self.pool.close()
        if self.error is not None:
            raise AssertionError(f"the serving host failed: {self.error!r}") from self.error

    def __enter__(self) -> ServingNode:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
