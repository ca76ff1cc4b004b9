"""``kvpeer router`` as a process: serve one :class:`Router` until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from pathlib import Path

from kvpeer.router.app import ACCESS_LOGGER, Router
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
    if config.access_log:  # its lines show whatever the log level of the rest
        logging.getLogger(ACCESS_LOGGER).setLevel(logging.INFO)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    url = ""
    try:
        url = await router.start()
        log.info("kvpeer router started: %s mode, policy %s, %d engine(s) (%s), on %s",
                 config.mode.value, config.policy, len(config.engines),
                 ", ".join(e.name for e in config.engines), url)
        if ready_file is not None:
            write_ready_file(ready_file, url)
        await stop.wait()
        log.info("kvpeer router stopping")
    finally:
        await router.stop()
        if url:  # it started
            log.info("kvpeer router stopped")
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
