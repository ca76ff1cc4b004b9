"""``kvpeer router`` as a process: serve one :class:`Router` until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from pathlib import Path

from kvpeer.router.app import Router
from kvpeer.router.config import RouterConfig
from kvpeer.router.generations import DiscoveringRouter
from kvpeer.router.policy import Policy
from kvpeer.router.server_socket import write_ready_file

__all__ = ["run", "serve"]

log = logging.getLogger("kvpeer.router.app")


async def serve(
    config: RouterConfig,
    policy: Policy | None = None,
    ready_file: Path | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Run until SIGINT/SIGTERM (or ``stop``), then close cleanly."""
    router: Router | DiscoveringRouter = (
        Router(config, policy) if config.discovery is None else DiscoveringRouter(config)
    )
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        url = await router.start()
        log.warning("kvpeer router (%s mode, %d engines) on %s", config.mode.value,
                    len(config.engines), url)
        if ready_file is not None:
            write_ready_file(ready_file, url)
        await stop.wait()
    finally:
        await router.stop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)


def run(config: RouterConfig, ready_file: Path | None = None) -> int:
    """Serve until a signal; on uvloop when it is installed (vLLM ships it): the edge is
    event-loop bound, and uvloop cuts its per-request cost."""
    try:
        import uvloop

        loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(serve(config, ready_file=ready_file))
    return 0
