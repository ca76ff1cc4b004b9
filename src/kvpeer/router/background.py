"""A router on its own event-loop thread, for programs that are not asyncio themselves
(``kvpeer demo``, ``kvpeer bench serve``, tests): start, read its URL, ask its loop a
question (``call``), stop. The router is the same object ``kvpeer router`` serves;
only the loop it runs on differs.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

from kvpeer.router.app import Router
from kvpeer.router.config import RouterConfig
from kvpeer.router.policy import Policy

__all__ = ["BackgroundRouter"]

T = TypeVar("T")
R = TypeVar("R")
START_TIMEOUT_S = 60.0


class BackgroundRouter:
    """``Router(config, policy)`` served from a daemon thread until :meth:`stop`."""

    def __init__(self, config: RouterConfig, policy: Policy | None = None) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="kvpeer-router", daemon=True
        )
        self._thread.start()
        self.router: Router = self.call(lambda: Router(config, policy))
        self.url: str = self._run(self.router.start(), START_TIMEOUT_S)

    def call(self, fn: Callable[[], T], timeout_s: float = 10.0) -> T:
        """``fn()`` on the router's loop (its state has no locks: read it there)."""

        async def inside() -> T:
            return fn()

        return self._run(inside(), timeout_s)

    def stop(self) -> None:
        if not self._loop.is_running():
            return
        try:
            self._run(self.router.stop(), 30.0)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30.0)
            self._loop.close()

    def __enter__(self) -> BackgroundRouter:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def _run(self, coro: Coroutine[Any, Any, R], timeout_s: float) -> R:
        future: Future[R] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result(timeout=timeout_s)
