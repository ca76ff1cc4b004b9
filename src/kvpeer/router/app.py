"""The router's HTTP edge: an aiohttp server in front of vLLM OpenAI servers.

Per generation request (``/v1/completions``, ``/v1/chat/completions``):

1. Parse the body, strip what a client may not set (:func:`params.sanitize`), take the
   prompt's token ids (given, or one ``/tokenize`` call; on any failure route by load).
2. Ask the policy for a :class:`Plan` over the healthy engines (the health filter:
   :mod:`kvpeer.router.candidates`). A policy that raises or names an engine it may
   not use costs the request nothing: the edge falls back to :class:`LoadOnlyPolicy`
   (or drops the invalid source / prefill engine; :mod:`kvpeer.router.planner`).
3. PD: run the prefill leg to completion; if it fails the request goes on decode-only
   (counted as a fallback), never to a client error.
4. Send the serving leg. Before the client's first byte — connect errors, 5xx, a hang
   past ``read_timeout_s``, a stream that ends before its first event — the request is
   retried on another healthy engine, at most ``retries`` times. After the first byte
   nothing is retried: an engine that dies mid-stream ends the client's stream with an
   SSE error event, and the connection closes. 4xx answers pass through unchanged.
5. Stream events go to the client as they arrive; usage is read on the way (and the
   usage chunk the router asked for is dropped), then the policy hears the outcome.
6. When no engine is healthy, the request goes to one that is down but not known to be
   gone or unwell (:meth:`EngineHealth.reachable`: a missed check, a verdict pending), by
   load and computing locally, with the same retries; a 503 only when there is none.
   Under load a health check can miss while the engine still serves, and with the
   other engine dead that one miss made every request a 503
   (``kvpeer_router_last_resort_total`` counts these).

Load (requests in flight, prompt tokens whose first byte is not back) is counted per
engine (:mod:`kvpeer.router.load`) and handed to the policy with every plan.

Construction points one way: the edge builds the health filter, the :class:`Planner`
over it and the policy, and the :class:`Forwarder` given that planner (steps 3-5:
:mod:`kvpeer.router.forward`); it calls the forwarder, which calls the planner, and
nothing calls back up.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest

from kvpeer.errors import ConfigError
from kvpeer.router import params
from kvpeer.router.ahead import CurveClient, PrefetchSender
from kvpeer.router.candidates import Candidates
from kvpeer.router.config import RouterConfig
from kvpeer.router.cost import CostModel, CostPriors
from kvpeer.router.decide import DecideConfig, RouterPolicy
from kvpeer.router.engineload import EngineLoadFeed
from kvpeer.router.feedwatch import FeedWatch
from kvpeer.router.forward import (
    FORWARDED_HEADERS,
    SOURCE_HEADER,
    Forwarder,
    engine_headers,
    error_response,
    failure_reason,
)
from kvpeer.router.health import EngineHealth
from kvpeer.router.index import PrefixIndex
from kvpeer.router.load import Load, Loads
from kvpeer.router.loadonly import LoadOnlyPolicy
from kvpeer.router.metrics import LiveCollector, RouterMetrics
from kvpeer.router.peeraddr import PeerAddresses
from kvpeer.router.planner import Planner
from kvpeer.router.policy import Mode, Policy
from kvpeer.router.routed import RoutedRequest, Served
from kvpeer.router.server_socket import bind
from kvpeer.router.subscriber import EventSubscriber
from kvpeer.router.witness import FeedWitness, StartTimeWitness

__all__ = ["ACCESS_LOGGER", "PIN_HEADER", "Router", "RouterStatistics"]

log = logging.getLogger(__name__)
#: One INFO line per request when the config's ``access_log`` is on.
ACCESS_LOGGER = "kvpeer.router.access"
access_log = logging.getLogger(ACCESS_LOGGER)

PIN_HEADER = "X-Kvpeer-Engine"  # honoured with config.allow_pinning only
DNS_CACHE_S = 10  # seconds an answer for an engine URL's host name is reused
FEED_WATCH_S = 1.0  # how often the engines' event feeds are looked at for the log
CUT_AFTER_DRAIN_S = 1.0  # what aiohttp waits for handlers still running after the drain


@dataclass(frozen=True, slots=True)
class RouterStatistics:
    requests: int
    retries: int
    prefill_fallbacks: int
    policy_errors: int
    stripped_client_params: int
    in_flight: Mapping[str, int]


class Router:
    """One router: its aiohttp app, client session, health loop and metrics."""

    def __init__(
        self,
        config: RouterConfig,
        policy: Policy | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.config = config
        self._fallback = LoadOnlyPolicy(config.specs, config.mode)
        self.index: PrefixIndex | None = None
        self.subscribers: dict[str, EventSubscriber] = {}
        if policy is None and config.policy == "load":
            policy = self._fallback
        if policy is None:
            # The decision core, fed by every engine's KV events (engines without an
            # event endpoint stay unlearned: load only for them).
            self.index = PrefixIndex()
            priors = CostPriors(step_tokens=config.engine_step_tokens)
            policy = RouterPolicy(config.specs, config.mode, self.index, cost=CostModel(priors),
                                  config=DecideConfig(pulls=config.policy == "pull"))
            self.subscribers = {
                spec.name: EventSubscriber(
                    spec.name, spec.kv_events, self.index, replay_endpoint=spec.kv_events_replay
                )
                for spec in config.specs
                if spec.kv_events is not None
            }
        self.policy: Policy = policy
        self._events_stop = asyncio.Event()
        self._event_tasks: list[asyncio.Task[None]] = []
        self.registry = registry or CollectorRegistry()
        self._metrics = RouterMetrics(self.registry)
        self.registry.register(LiveCollector(self))
        self.health = EngineHealth(
            config.engines,
            self._on_restart,
            interval_s=config.health_interval_s,
            timeout_s=config.health_timeout_s,
            restart_failures=config.health_restart_failures,
            witnesses={  # down -> up: restarted or a flap (health rule 3)
                "feed": FeedWitness(self.subscribers),
                "start_time": StartTimeWitness(
                    {e.name: e.spec.url for e in config.engines}, lambda: self.session),
            },
            on_flap=lambda name: self._metrics.flaps.inc(),
        )
        # Engines dial each other's tiers by IP address: peer names resolved (peeraddr).
        self.peers = PeerAddresses(config.specs, timeout_s=config.health_timeout_s)
        self._loads = Loads(entry.name for entry in config.engines)
        self.engine_load: EngineLoadFeed | None = None
        if config.load_scrape_interval_s > 0:
            self.engine_load = EngineLoadFeed(
                config.engines,
                lambda name: (self._loads[name].in_flight, self._loads[name].queued),
                interval_s=config.load_scrape_interval_s,
                timeout_s=config.health_timeout_s,
                clock=time.monotonic,
            )
        self._load_task: asyncio.Task[None] | None = None
        self._timeout = aiohttp.ClientTimeout(
            total=None,
            sock_connect=config.connect_timeout_s,
            sock_read=config.read_timeout_s,
        )
        self._session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._peers_task: asyncio.Task[None] | None = None
        self._watch_task: asyncio.Task[None] | None = None
        self._active = 0  # generation requests being answered (the drain waits for them)
        # Stopping: a request that still arrives on a kept-alive connection is refused
        # (503, Connection: close) so the client retries elsewhere; the drain waits only
        # for requests that came before.
        self._draining = False
        self._idle = asyncio.Event()
        self._idle.set()
        self._runner: web.AppRunner | None = None
        self._counts = {"requests": 0, "retries": 0, "fallbacks": 0, "policy_errors": 0,
                        "stripped": 0}
        #: prefetches to tiers that pull ahead (engine key ``ahead``; shared mode only)
        self.ahead: PrefetchSender | None = None
        if config.mode is Mode.SHARED and any(e.spec.pulls_ahead for e in config.engines):
            counter = self._metrics.prefetches
            curve = None
            if config.prefetch_curve_key:
                curve = CurveClient.load(config.prefetch_curve_key,
                                         config.prefetch_curve_server_key)  # fmt: skip
            self.ahead = PrefetchSender(count=lambda outcome: counter.labels(outcome).inc(),
                                        curve=curve)  # fmt: skip
        candidates = Candidates(config, self.health, self._loads, self.engine_load)
        self._planner = Planner(config, self.policy, self._fallback, candidates,
                                lambda: self.peers, self._metrics, self._counts)  # fmt: skip
        self._forwarder = Forwarder(
            config, self._planner, lambda: self.session, self._loads, self._metrics,
            self.health, lambda: self.peers, self._counts, ahead=self.ahead,
        )  # fmt: skip
        self.url = ""
        app = web.Application(client_max_size=config.max_body_bytes)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics_page)
        self.app = app

    # -- lifecycle -------------------------------------------------------------------

    async def start(
        self, host: str | None = None, port: int | None = None,
        listening: socket.socket | None = None,
    ) -> str:
        """Check every engine once, then listen; returns ``http://host:port``.

        A listening address that cannot be bound (in use, not this host's) raises
        :class:`ConfigError` naming it, before anything else starts. ``listening``: a
        socket already bound to serve on instead (kvpeer.router.generations hands each
        generation a duplicate of one); the router closes it when it stops."""
        host = self.config.listen_host if host is None else host
        port = self.config.listen_port if port is None else port
        try:
            sock = bind(host, port) if listening is None else listening
        except OSError as exc:
            raise ConfigError(f"listen {host}:{port}: {exc.strerror or exc}") from exc
        self._session = aiohttp.ClientSession(
            # Engine URLs may be names whose address changes (a rescheduled Kubernetes
            # pod): a cached answer may keep an engine down for its whole lifetime.
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=DNS_CACHE_S),
            timeout=self._timeout,
        )
        if self.index is not None:
            if self.index.native:
                log.info("KV event intake: C loops (kvpeer.router._intake)")
            else:
                log.warning("KV event intake: Python loops, about twice the CPU per event: "
                            "kvpeer.router._intake was not built (install kvpeer with a C "
                            "compiler and the Python headers; docs/scale.md)")
        self._event_tasks = [
            asyncio.create_task(sub.run(self._events_stop), name=f"kv-events-{name}")
            for name, sub in self.subscribers.items()
        ]
        await asyncio.gather(self.health.check_once(self._session), self.peers.refresh())
        down = self.health.statistics().down
        if down:  # named now: a check round that fails again says nothing more
            log.warning("engine(s) %s not up at start: not routed to until a health check "
                        "passes", ", ".join(down))
        self._watch_task = asyncio.create_task(self._watch_feeds())
        if self.ahead is not None:
            tiers = (self.peers.dialable(e.spec) for e in self.config.engines if e.spec.pulls_ahead)
            self.ahead.connect(tier for tier in tiers if tier is not None)
        self._health_task = asyncio.create_task(self.health.run(self._session))
        self._peers_task = asyncio.create_task(self.peers.run(self.config.health_interval_s))
        if self.engine_load is not None:
            self._load_task = asyncio.create_task(self.engine_load.run())
        self._runner = web.AppRunner(
            self.app, access_log=None, handler_cancellation=True,
            shutdown_timeout=CUT_AFTER_DRAIN_S,
        )
        await self._runner.setup()
        await web.SockSite(self._runner, sock).start()
        bound = sock.getsockname()[1]
        self.url = f"http://[{host}]:{bound}" if ":" in host else f"http://{host}:{bound}"
        return self.url

    async def stop(self) -> None:
        """Stop listening, drain the requests in flight (at most ``drain_timeout_s``;
        what is left then is cut), then stop the feeds and loops."""
        runner, self._runner = self._runner, None  # a second stop() has nothing to do
        self._draining = True
        if runner is not None:
            for site in list(runner.sites):
                await site.stop()  # no new connections; requests in flight go on
            await self._drain()
            await runner.cleanup()
        self._events_stop.set()
        await asyncio.gather(*self._event_tasks, return_exceptions=True)
        tasks = [t for t in (self._health_task, self._peers_task, self._load_task,
                             self._watch_task) if t is not None]  # fmt: skip
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
        if self.ahead is not None:
            self.ahead.close()

    async def _drain(self) -> None:
        """Wait for the requests in flight, at most ``drain_timeout_s``."""
        in_flight = self._active
        if not in_flight:
            return
        timeout = self.config.drain_timeout_s
        log.info("draining %d request(s) in flight (at most %g s)", in_flight, timeout)
        try:
            async with asyncio.timeout(timeout):
                await self._idle.wait()
        except TimeoutError:
            pass
        cut = self._active
        self._metrics.drained.labels("finished").inc(in_flight - cut)
        self._metrics.drained.labels("cut").inc(cut)
        if cut:
            log.warning("drain: %d of %d request(s) still in flight after %g s: cut",
                        cut, in_flight, timeout)
        else:
            log.info("drain: all %d request(s) finished", in_flight)

    async def _watch_feeds(self) -> None:
        """Log what changes in each engine's KV event feed (kvpeer.router.feedwatch)."""
        now = time.monotonic()
        watches = {name: FeedWatch(name, sub.endpoint, now)
                   for name, sub in self.subscribers.items()}  # fmt: skip
        await self._resolve_feeds()
        while watches:
            now = time.monotonic()
            for name, watch in watches.items():
                for note in watch.observe(self.subscribers[name].statistics(), now):
                    log.log(note.level, "%s", note.text)
            await asyncio.sleep(FEED_WATCH_S)

    async def _resolve_feeds(self) -> None:
        """Warn at start about an event endpoint whose host does not resolve (ZMQ would
        retry it quietly for ever); one that resolves but never answers is the watch's
        rule 3."""
        loop = asyncio.get_running_loop()
        for name, sub in self.subscribers.items():
            scheme, _, rest = sub.endpoint.partition("://")
            host = rest.rpartition(":")[0].strip("[]")
            if scheme != "tcp" or not host:
                continue
            try:
                async with asyncio.timeout(self.config.health_timeout_s):
                    await loop.getaddrinfo(host, None)
            except (OSError, TimeoutError) as exc:
                log.warning("engine %s: kv_events %s: host %r does not resolve (%s): no KV "
                            "events from it, routed by load only", name, sub.endpoint, host,
                            exc or "timed out")

    @property
    def feeds(self) -> Sequence[EventSubscriber]:
        """The engines' KV event feeds (engines with a ``kv_events`` endpoint)."""
        return tuple(self.subscribers.values())

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "Router.start() first"
        return self._session

    def load_of(self, name: str) -> Load:
        return self._loads[name]

    def statistics(self) -> RouterStatistics:
        c = self._counts
        return RouterStatistics(
            c["requests"], c["retries"], c["fallbacks"], c["policy_errors"], c["stripped"],
            {name: load.in_flight for name, load in self._loads.items()},
        )

    # -- engine restarts ---------------------------------------------------------------

    def _on_restart(self, name: str) -> None:
        self._metrics.restarts.inc()
        subscriber = self.subscribers.get(name)
        if subscriber is not None:
            subscriber.resync()  # a new process: its event sequence starts over
        self._planner.engine_restarted(name)

    # -- handlers --------------------------------------------------------------------

    async def _health(self, request: web.Request) -> web.Response:
        if self._draining:
            refused = web.json_response({"status": "shutting down"}, status=503)
            refused.force_close()
            return refused
        stats = self.health.statistics()
        status = 200 if stats.up else 503
        return web.json_response(
            {"status": "ok" if stats.up else "no healthy engine", "up": list(stats.up),
             "down": list(stats.down)}, status=status)

    async def _metrics_page(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry),
                            headers={"Content-Type": "text/plain; version=0.0.4"})

    async def _models(self, request: web.Request) -> web.Response:
        timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s * 5)
        for entry in self.config.engines:
            if not self.health.healthy(entry.name):
                continue
            try:
                async with self.session.get(f"{entry.spec.url}/v1/models", timeout=timeout,
                                            headers=engine_headers(entry, request)) as resp:
                    body = await resp.read()
                    if resp.status == 200:
                        return web.Response(body=body, status=200,
                                            content_type="application/json")
            except (aiohttp.ClientError, TimeoutError) as exc:
                self._metrics.upstream_errors.labels(failure_reason(exc)).inc()
        return error_response(503, "no healthy engine answered /v1/models", "service_unavailable")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generation(request, chat=False)

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generation(request, chat=True)

    async def _generation(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        if self._draining:
            refused = error_response(503, "router shutting down: send it again",
                                     "service_unavailable")
            refused.force_close()
            return refused
        started = time.monotonic()
        mode = self.config.mode.value
        self._counts["requests"] += 1
        self._active += 1
        self._idle.clear()
        outcome = "cancelled"
        served = Served()
        request_id = uuid.uuid4().hex
        status: int | None = None
        try:
            try:
                raw = await request.json()
            except (ValueError, UnicodeDecodeError):
                outcome = "bad_request"
                return error_response(400, "request body is not JSON", "invalid_request_error")
            if not isinstance(raw, dict):
                outcome = "bad_request"
                return error_response(
                    400, "request body is not a JSON object", "invalid_request_error"
                )
            body, removed = params.sanitize(raw)
            if removed:
                self._counts["stripped"] += 1
                self._metrics.stripped.inc()
                # debug: a client must not be able to flood the log (counted in metrics)
                log.debug("client request carried %s: removed (the router owns them)",
                          ", ".join(removed))
            pinning = self.config.allow_pinning
            serve_on = request.headers.get(PIN_HEADER) if pinning else None
            pull_from = request.headers.get(SOURCE_HEADER) if pinning else None
            for header, name in ((PIN_HEADER, serve_on), (SOURCE_HEADER, pull_from)):
                if name is not None and not self.config.has(name):
                    outcome = "bad_request"
                    return error_response(400, f"{header}: no engine named {name!r:.80}",
                                  "invalid_request_error")
            tokens = params.prompt_token_ids(body, chat=chat)
            if tokens is None:
                tokens = await self._tokenize(request, body, chat=chat)
            ctx = RoutedRequest(
                request_id=request_id,
                path="/v1/chat/completions" if chat else "/v1/completions",
                chat=chat,
                body=body,
                tokens=tokens,
                stream=body.get("stream") is True,
                started=started,
                headers={k: request.headers[k] for k in FORWARDED_HEADERS
                         if k in request.headers},
                serve_on=serve_on,
                pull_from=pull_from,
            )
            response, outcome = await self._forwarder.route(request, ctx, served)
            status = response.status
            return response
        finally:
            elapsed = time.monotonic() - started
            self._metrics.requests.labels(mode, outcome, served.engine).inc()
            self._metrics.duration.labels(mode, served.engine).observe(elapsed)
            if self.config.access_log:
                self._access(request, request_id, status, outcome, served, elapsed)
            self._active -= 1
            if not self._active:
                self._idle.set()

    def _access(self, request: web.Request, request_id: str, status: int | None,
                outcome: str, served: Served, elapsed: float) -> None:
        """The request's access line: who asked for what, where it went and why, how fast."""
        plan = served.plan
        source = plan.source or plan.prefill_engine if plan is not None else None
        fields = [
            f"id={request_id}",
            f"client_id={json.dumps(request.headers.get('X-Request-Id', '')[:128])}",
            f"peer={request.remote or '-'}",
            f"{request.method} {request.path}",
            f"status={status if status is not None else '-'}",
            f"outcome={outcome}",
            f"engine={served.engine or '-'}",
            f"source={source or '-'}",
            f"plan={json.dumps(plan.reason if plan is not None else '')}",
            f"ttft_s={served.ttft_s:.4f}" if served.ttft_s is not None else "ttft_s=-",
            f"duration_s={elapsed:.4f}",
        ]
        access_log.info("%s", " ".join(fields))

    async def _tokenize(self, request: web.Request, body: Mapping[str, Any], *,
                        chat: bool) -> list[int]:
        """The prompt's token ids from the least-loaded healthy engine, or [] (load only)."""
        query = params.tokenize_body(body, chat=chat) if self.config.tokenize else None
        healthy = [e for e in self.config.engines if self.health.healthy(e.name)]
        if query is None or not healthy:
            return []
        entry = min(healthy, key=lambda e: (self._loads[e.name].in_flight,
                                            self._loads[e.name].queued_prompt_tokens))
        try:
            async with self.session.post(
                f"{entry.spec.url}/tokenize", json=query,
                headers=engine_headers(entry, request),
                timeout=aiohttp.ClientTimeout(total=self.config.tokenize_timeout_s),
            ) as resp:
                document = await resp.json(content_type=None) if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.debug("tokenize on %s failed (%s): routing by load", entry.name, exc)
            document = None
        tokens = document.get("tokens") if isinstance(document, dict) else None
        if isinstance(tokens, list) and all(type(t) is int for t in tokens):
            return tokens
        self._metrics.tokenize_failures.inc()
        return []
