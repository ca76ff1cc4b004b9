"""Discovered engines served without a restart: one Router per engine set, one socket.

A :class:`~kvpeer.router.app.Router` is built for a fixed set of engines (its index,
policy, health checks, event feeds and metrics all are). With a ``[discovery]`` table,
each change of what is discovered (:mod:`kvpeer.router.discovery`) starts a new
*generation*: a Router for the static engines plus the discovered ones, serving a
duplicate of the same listening socket. Once it listens, the one before stops accepting,
drains its requests in flight (``drain_timeout_s``) and stops.

Invariants:

1. The socket is bound once, at start; each generation serves a duplicate of it, so
   stopping one never closes the listener and no connection is refused during a swap.
2. Swaps are serialized. While one runs, both generations accept; each serves what it
   knows correctly. Once it is done, only the new one accepts.
3. A discovered set that makes no valid configuration (pd mode with one engine, ...)
   starts nothing: the running generation stays, and the error is logged once.
4. With no engine at all, a placeholder answers: 503 with the reason on every request
   and ``/health``, ``/metrics`` with the discovery's own families (the process is alive,
   not ready).

A client's idle keep-alive connection to a retiring generation is closed when that
generation stops; a request sent on it at that very moment fails as at any server's
shutdown, and HTTP clients retry it on a new connection (the OpenAI SDK does).

What a swap costs: the new generation learns what each engine holds from the engines'
KV event replay (as a router started late does, docs/router.md), its cost model starts
from its priors, and the router's counters start again from zero (Prometheus' ``rate``
treats that as a counter reset). Membership's ``leave_after_s`` keeps a flapping engine
from causing swaps.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvpeer.errors import ConfigError
from kvpeer.router.app import Router
from kvpeer.router.config import RouterConfig, engine_entries
from kvpeer.router.discovery import (
    SERVICE_ACCOUNT,
    DiscoveryLoop,
    DnsSource,
    Found,
    KubernetesSource,
    Membership,
    Resolver,
    engine_table,
    source_for,
)
from kvpeer.router.server_socket import bind

__all__ = ["DiscoveringRouter"]

log = logging.getLogger(__name__)


class DiscoveringRouter:
    """``kvpeer router`` with ``[discovery]``: the same start/stop/url as a Router."""

    def __init__(
        self,
        config: RouterConfig,
        *,
        resolver: Resolver | None = None,
        service_account: Path = SERVICE_ACCOUNT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if config.discovery is None:
            raise ValueError("DiscoveringRouter needs a config with [discovery]")
        self.config = config
        self.discovery = config.discovery
        self._session: aiohttp.ClientSession | None = None
        self.source = source_for(self.discovery, lambda: self.session, resolver,
                                 service_account)  # fmt: skip
        self.membership = Membership(self.discovery.leave_after_s)
        self.loop = DiscoveryLoop(self.source, self.membership, self._apply,
                                  interval_s=self.discovery.interval_s, clock=clock)  # fmt: skip
        self.current: Router | _Placeholder | None = None
        self.generations = 0
        self._sock: socket.socket | None = None
        self._swap = asyncio.Lock()
        self._retiring: set[asyncio.Task[None]] = set()
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._rejected = ""
        self.url = ""

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "DiscoveringRouter.start() first"
        return self._session

    @property
    def router(self) -> Router | None:
        """The generation serving now, if it has engines."""
        return self.current if isinstance(self.current, Router) else None

    async def start(self, host: str | None = None, port: int | None = None) -> str:
        """Bind, observe once, serve that generation, then follow the source."""
        host = self.config.listen_host if host is None else host
        port = self.config.listen_port if port is None else port
        try:
            self._sock = bind(host, port)
        except OSError as exc:
            raise ConfigError(f"listen {host}:{port}: {exc.strerror or exc}") from exc
        bound = self._sock.getsockname()[1]
        self.url = f"http://[{host}]:{bound}" if ":" in host else f"http://{host}:{bound}"
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        if not await self.loop.observe_once():
            await self._apply(self.membership.members)  # nothing found (yet): serve anyway
        self._task = asyncio.create_task(self.loop.run(self._stop), name="engine-discovery")
        return self.url

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        async with self._swap:
            if self.current is not None:
                await self.current.stop()
                self.current = None
        await asyncio.gather(*self._retiring, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
        if self._sock is not None:
            self._sock.close()

    async def _apply(self, found: tuple[Found, ...]) -> None:
        """Start the generation for ``found`` and retire the one before (invariant 2)."""
        async with self._swap:
            assert self._sock is not None
            registry = CollectorRegistry()
            registry.register(_DiscoveryCollector(self))
            tables = [engine_table(self.discovery, f) for f in found]
            nxt: Router | _Placeholder
            try:
                engines = (*self.config.engines, *engine_entries(tables, "discovered engine"))
                if not engines:
                    nxt = _Placeholder(registry, "no engine discovered yet")
                else:
                    nxt = Router(replace(self.config, engines=engines), registry=registry)
            except ConfigError as exc:
                if str(exc) != self._rejected:
                    log.error("discovered engines make no valid router config; the running "
                              "generation stays: %s", exc)
                self._rejected = str(exc)
                if self.current is not None:
                    return
                nxt = _Placeholder(registry, f"discovered engines are not usable: {exc}")
            else:
                self._rejected = ""
            sock = self._sock.dup()
            try:
                await nxt.start(listening=sock)
            except BaseException:
                sock.close()
                await nxt.stop()
                raise
            self.generations += 1
            log.info("router generation %d: %d engine(s)", self.generations,
                     len(nxt.config.engines) if isinstance(nxt, Router) else 0)
            old, self.current = self.current, nxt
            if old is not None:
                task = asyncio.create_task(old.stop(), name="retire-generation")
                self._retiring.add(task)
                task.add_done_callback(self._retiring.discard)


class _Placeholder:
    """Serves while there is no engine (invariant 4)."""

    def __init__(self, registry: CollectorRegistry, reason: str) -> None:
        self.registry = registry
        self.reason = reason
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_route("*", "/{tail:.*}", self._unavailable)
        self._runner = web.AppRunner(app, access_log=None)

    async def start(self, listening: socket.socket) -> None:
        await self._runner.setup()
        await web.SockSite(self._runner, listening).start()

    async def stop(self) -> None:
        await self._runner.cleanup()

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry),
                            headers={"Content-Type": "text/plain; version=0.0.4"})  # fmt: skip

    async def _unavailable(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"status": self.reason, "error": {"message": self.reason, "type": "unavailable",
                                              "code": 503}}, status=503)  # fmt: skip


class _DiscoveryCollector(Collector):
    """``kvpeer_router_discovery_*``: what the source answers and what changed."""

    def __init__(self, router: DiscoveringRouter) -> None:
        self._router = router

    def collect(self) -> Iterator[Metric]:
        stats = self._router.membership.statistics()
        prefix = "kvpeer_router_discovery_"
        engines = GaugeMetricFamily(f"{prefix}engines", "engines discovered now")
        engines.add_metric([], stats.engines)
        yield engines
        observations = CounterMetricFamily(
            f"{prefix}observations", "observations of the source by result", labels=["result"]
        )
        observations.add_metric(["ok"], stats.observations - stats.failures)
        observations.add_metric(["failed"], stats.failures)
        yield observations
        changes = CounterMetricFamily(
            f"{prefix}changes", "engines that joined, left or moved (a new address)",
            labels=["change"],
        )
        for change in ("joined", "left", "moved"):
            changes.add_metric([change], getattr(stats, change))
        yield changes
        generations = CounterMetricFamily(
            f"{prefix}generations", "router generations started (one per change)"
        )
        generations.add_metric([], self._router.generations)
        yield generations
        source = self._router.source
        skipped = source.skipped if isinstance(source, DnsSource | KubernetesSource) else 0
        records = CounterMetricFamily(
            f"{prefix}skipped_records", "records a source answered that were no usable engine"
        )
        records.add_metric([], skipped)
        yield records
