"""A request's way to the engines: the prefill leg, the serving leg, the stream relayed.

:class:`kvpeer.router.app.Router` parses a generation request and builds a
:class:`~kvpeer.router.routed.RoutedRequest`; :meth:`Forwarder.route` runs the edge's
steps 3-5 (the app's docstring): the PD prefill leg to completion, then the serving
leg (:meth:`Forwarder.forward`), retried on another healthy engine while nothing has
reached the client (:class:`BeforeFirstByte`), the stream relayed as it arrives.
Each attempt is planned by the :class:`~kvpeer.router.planner.Planner` the forwarder
is given, which is told what was sent and how it went; the forwarder calls nothing
of the edge's. This router's load per engine (:mod:`kvpeer.router.load`) is counted
here as legs are sent and answered.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import aiohttp
from aiohttp import web

from kvpeer.router import params
from kvpeer.router.ahead import PrefetchSender
from kvpeer.router.config import EngineEntry, RouterConfig
from kvpeer.router.health import EngineHealth, is_refused
from kvpeer.router.load import Loads
from kvpeer.router.metrics import RouterMetrics
from kvpeer.router.peeraddr import PeerAddresses
from kvpeer.router.planner import Planner
from kvpeer.router.policy import EngineSpec, Mode, Outcome, Plan
from kvpeer.router.routed import REQUEST_ID_HEADER, RoutedRequest, Served

__all__ = [
    "FORWARDED_HEADERS",
    "SOURCE_HEADER",
    "BeforeFirstByte",
    "Forwarder",
    "engine_headers",
    "error_response",
    "failure_reason",
]

log = logging.getLogger("kvpeer.router.app")  # the edge's log, as before the split
# One line per request when this logger is at INFO (``KVPEER_TRACE=1``; kvpeer.node.trace).
trace_log = logging.getLogger("kvpeer.trace")

FORWARDED_HEADERS = ("Authorization", REQUEST_ID_HEADER)
SOURCE_HEADER = "X-Kvpeer-Source"  # honoured with config.allow_pinning; answers carry it


def error_response(status: int, message: str, kind: str) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": kind, "code": status}}, status=status
    )


class BeforeFirstByte(Exception):
    """The serving leg failed before anything reached the client: it may be retried."""

    def __init__(self, reason: str, status: int | None = None, body: bytes = b"",
                 content_type: str = "application/json") -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status
        self.body = body
        self.content_type = content_type


def failure_reason(exc: BaseException) -> str:
    """One engine-free word for an aiohttp failure (a metric label)."""
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "connect"
    if isinstance(exc, aiohttp.ClientPayloadError | aiohttp.ServerDisconnectedError):
        return "disconnect"
    return "connection"


def engine_headers(entry: EngineEntry, request: web.Request | None = None,
                   request_id: str | None = None) -> dict[str, str]:
    """The headers of a request to ``entry``: its own, the client's that pass, the id."""
    headers = entry.headers()
    if request is not None:
        headers.update({k: request.headers[k] for k in FORWARDED_HEADERS
                        if k in request.headers})
    if request_id is not None:  # the client's own id, if it sent one, is kept
        headers.setdefault(REQUEST_ID_HEADER, request_id)
    return headers


class Forwarder:
    """Runs each routed request's legs (what the edge's policy planned)."""

    def __init__(
        self,
        config: RouterConfig,
        planner: Planner,
        session: Callable[[], aiohttp.ClientSession],
        loads: Loads,
        metrics: RouterMetrics,
        health: EngineHealth,
        peers: Callable[[], PeerAddresses],
        counts: dict[str, int],
        *,
        ahead: PrefetchSender | None = None,
    ) -> None:
        """``planner`` plans each attempt and hears what was sent and how it went;
        ``session`` and ``peers`` are read when used (the edge's, which start() opens
        and a test may replace)."""
        self._config = config
        self._planner = planner
        self._ahead = ahead
        self._session = session
        self._loads = loads
        self._metrics = metrics
        self._health = health
        self._peers = peers
        self._counts = counts

    async def route(
        self, request: web.Request, ctx: RoutedRequest, served: Served | None = None
    ) -> tuple[web.StreamResponse, str]:
        """Plan, run the prefill leg if any, then the serving leg with its retries: the
        client's answer and the request's outcome (a metric label). ``served`` is
        filled in with the serving engine, its plan and the TTFT as they are known."""
        served = served if served is not None else Served()
        tried: set[str] = set()
        plan = self._planner.plan(ctx, tried)
        if plan is None:
            return error_response(503, "no healthy engine", "service_unavailable"), "unavailable"
        prefill: EngineSpec | None = None
        prefill_s: float | None = None
        if plan.prefill_engine is not None:
            prefill, prefill_s = await self._prefill_leg(request, ctx, plan.prefill_engine)
        failure: BeforeFirstByte | None = None
        for attempt in range(self._config.retries + 1):
            if attempt:
                replanned = self._planner.plan(ctx, tried)
                if replanned is None:
                    break
                # PD: the prefill leg already ran (or failed); the retry's plan says so
                plan = replace(replanned, prefill_engine=prefill.name if prefill else None)
                self._counts["retries"] += 1
                self._metrics.retries.inc()
            entry = self._config.entry(plan.engine)
            served.engine, served.plan = entry.name, plan
            if self._config.mode is Mode.PD:
                named = prefill if prefill is not None and prefill.name != entry.name else None
                leg = params.decode_leg(ctx.body, ctx.request_id, self._peers().dialable(named))
            else:
                source = self._config.entry(plan.source).spec if plan.source else None
                source = self._peers().dialable(source)
                leg = params.shared_leg(ctx.body, ctx.request_id, source, plan.source_held_tokens,
                                        plan.give_up_s)  # fmt: skip
                self._pull_ahead(ctx, entry.spec, source, plan.source_held_tokens)
            self._planner.sent(ctx, plan)
            try:
                return await self.forward(request, ctx, entry, leg, plan, prefill_s, served)
            except BeforeFirstByte as exc:
                failure = exc
                tried.add(entry.name)
                self._metrics.upstream_errors.labels(exc.reason).inc()
                log.warning("request %s on %s failed before its first byte: %s",
                            ctx.request_id, entry.name, exc.reason)
        if failure is not None and failure.status is not None:
            return web.Response(body=failure.body, status=failure.status,
                                content_type=failure.content_type), "upstream_error"
        if failure is None:
            return error_response(503, "no healthy engine", "service_unavailable"), "unavailable"
        failed = error_response(502, f"engines failed: {failure.reason}", "upstream_error")
        return failed, "upstream_error"

    def _pull_ahead(self, ctx: RoutedRequest, engine: EngineSpec, source: EngineSpec | None,
                    held_tokens: int | None) -> None:  # fmt: skip
        """Tell ``engine``'s tier to fetch the prefix ``source`` holds now (kvpeer.router.ahead),
        if it pulls ahead; the request itself goes out right after, unchanged."""
        if self._ahead is None or source is None or not engine.pulls_ahead or not held_tokens:
            return
        tier = self._peers().dialable(engine)
        if tier is not None:
            self._ahead.send(tier, ctx.request_id, source, ctx.tokens[:held_tokens])

    async def _prefill_leg(self, request: web.Request, ctx: RoutedRequest,
                           name: str) -> tuple[EngineSpec | None, float | None]:
        """Run the producer leg to completion; (its engine, seconds) or (None, None)."""
        entry = self._config.entry(name)
        leg = params.prefill_leg(ctx.body, ctx.request_id, chat=ctx.chat)
        load = self._loads[name]
        load.sent(len(ctx.tokens))
        sent = time.monotonic()
        try:
            async with self._session().post(
                entry.spec.url + ctx.path, json=leg,
                headers=engine_headers(entry, request, ctx.request_id),
                timeout=aiohttp.ClientTimeout(total=self._config.prefill_timeout_s,
                                              sock_connect=self._config.connect_timeout_s),
            ) as resp:
                await resp.read()
                if resp.status == 200:
                    elapsed = time.monotonic() - sent
                    self._metrics.prefill_leg.labels(name).observe(elapsed)
                    return entry.spec, elapsed
                reason = f"status_{resp.status // 100}xx"
        except (aiohttp.ClientError, TimeoutError) as exc:
            reason = failure_reason(exc)
            if reason == "connect":
                self._health.mark_down(name, str(exc), refused=is_refused(exc))
        finally:
            load.in_flight -= 1
            load.answering(len(ctx.tokens))
        self._metrics.upstream_errors.labels(reason).inc()
        self._metrics.fallbacks.inc()
        self._counts["fallbacks"] += 1
        log.warning("request %s: prefill leg on %s failed (%s): decode-only",
                    ctx.request_id, name, reason)
        return None, None

    async def forward(self, request: web.Request, ctx: RoutedRequest, entry: EngineEntry,
                       leg: dict[str, Any], plan: Plan, prefill_s: float | None,
                       served: Served | None = None) -> tuple[web.StreamResponse, str]:
        """Send the serving leg and answer the client from it.

        Raises :class:`BeforeFirstByte` while nothing has been sent to the client.
        """
        leg, strip_usage = params.want_usage(leg)
        served = served if served is not None else Served()
        ttft_series = self._metrics.ttft.labels(self._config.mode.value, entry.name)
        load = self._loads.serving(entry.name, len(ctx.tokens))
        queued = True
        sent, sent_wall = time.monotonic(), time.time()
        ok = False
        usage: params.Usage | None = None
        ttft: float | None = None
        upstream: aiohttp.ClientResponse | None = None
        try:
            try:
                upstream = await self._session().post(
                    entry.spec.url + ctx.path, json=leg,
                    headers=engine_headers(entry, request, ctx.request_id),
                )
            except (aiohttp.ClientError, TimeoutError) as exc:
                if isinstance(exc, aiohttp.ClientConnectorError):
                    self._health.mark_down(entry.name, str(exc), refused=is_refused(exc))
                raise BeforeFirstByte(failure_reason(exc)) from exc
            content_type = upstream.headers.get("Content-Type", "application/json")
            if upstream.status >= 500:
                raise BeforeFirstByte(f"status_{upstream.status // 100}xx", upstream.status,
                                       await _read_quietly(upstream),
                                       content_type.split(";")[0])
            if not ctx.stream or upstream.status != 200 or "event-stream" not in content_type:
                try:
                    data = await upstream.read()
                except (aiohttp.ClientError, TimeoutError) as exc:
                    raise BeforeFirstByte(failure_reason(exc)) from exc
                ok = upstream.status == 200
                if ok:
                    data, usage = _finished_body(data)
                served.ttft_s = time.monotonic() - ctx.started
                ttft_series.observe(served.ttft_s)
                response = web.Response(body=data, status=upstream.status,
                                        content_type=content_type.split(";")[0],
                                        headers=_route_headers(ctx, plan, prefill_s))
                return response, "ok" if ok else "client_error"
            stream = params.StreamFilter(strip_usage=strip_usage)
            first = b""
            try:
                while not first:
                    chunk = await upstream.content.readany()
                    if not chunk:
                        first = stream.flush()
                        break
                    first = stream.feed(chunk)
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise BeforeFirstByte(failure_reason(exc)) from exc
            if not first:
                raise BeforeFirstByte("empty_stream")
            client = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                 "Cache-Control": "no-cache",
                                                 **_route_headers(ctx, plan, prefill_s)})
            try:
                await client.prepare(request)
                await client.write(first)
                now = time.monotonic()
                ttft = now - sent
                served.ttft_s = now - ctx.started
                ttft_series.observe(served.ttft_s)
                load.answering(len(ctx.tokens))
                queued = False
                failed = await self._relay(upstream, client, stream)
            except ConnectionResetError:
                log.debug("request %s: the client went away mid-stream", ctx.request_id)
                return client, "client_gone"
            usage = stream.usage
            if failed is not None:
                self._metrics.upstream_errors.labels(failed).inc()
                log.warning("request %s: %s died mid-stream (%s)", ctx.request_id, entry.name,
                            failed)
                message = {"error": {"message": f"engine failed mid-stream: {failed}",
                                     "type": "upstream_error", "code": 502}}
                with contextlib.suppress(ConnectionResetError):  # the client left too
                    await client.write(f"data: {json.dumps(message)}\n\n".encode())
                    await client.write_eof()
                return client, "stream_error"
            ok = True
            with contextlib.suppress(ConnectionResetError):  # left after the last event
                await client.write_eof()
            return client, "ok"
        finally:
            if upstream is not None:
                if not ok:
                    upstream.close()  # never hand a half-read connection back to the pool
                upstream.release()
            load.in_flight -= 1
            if queued:
                load.answering(len(ctx.tokens))
            self._finished(ctx, entry, plan, ok, usage, ttft, prefill_s)
            if trace_log.isEnabledFor(logging.INFO):
                _trace(ctx.request_id, entry.name, plan, sent_wall, ttft, prefill_s, ok)

    async def _relay(self, upstream: aiohttp.ClientResponse, client: web.StreamResponse,
                     stream: params.StreamFilter) -> str | None:
        """Copy the rest of the stream; the engine-side failure reason, or None at its end.

        A client that went away raises out of ``client.write`` (ConnectionResetError).
        """
        while True:
            try:
                chunk = await upstream.content.readany()
            except (aiohttp.ClientError, TimeoutError) as exc:
                return failure_reason(exc)
            if not chunk:
                tail = stream.flush()
                if tail:
                    await client.write(tail)
                return None
            out = stream.feed(chunk)
            if out:
                await client.write(out)

    def _finished(self, ctx: RoutedRequest, entry: EngineEntry, plan: Plan, ok: bool,
                  usage: params.Usage | None, ttft: float | None,
                  prefill_s: float | None) -> None:
        cached = usage.cached_tokens if usage is not None else None
        prompt = usage.prompt_tokens if usage is not None and usage.prompt_tokens else None
        if ok and cached is not None:
            self._metrics.predicted_cached.inc(plan.predicted_cached_tokens)
            self._metrics.actual_cached.inc(cached)
        self._planner.outcome(Outcome(
            request_id=ctx.request_id,
            engine=entry.name,
            ok=ok,
            prompt_tokens=prompt if prompt is not None else len(ctx.tokens),
            cached_tokens=cached,
            ttft_s=ttft,
            prefill_leg_s=prefill_s,
        ))


def _trace(request_id: str, engine: str, plan: Plan, sent_wall: float, ttft: float | None,
           prefill_s: float | None, ok: bool) -> None:
    """The request's trace line: t is when the serving leg was sent (wall clock)."""
    values = {"engine": engine, "source": plan.source or plan.prefill_engine,
              "reason": plan.reason, "predicted_ttft_s": plan.predicted_ttft_s,
              "first_byte_s": ttft, "prefill_leg_s": prefill_s, "ok": int(ok)}
    fields = []
    for name, value in values.items():
        if isinstance(value, str):
            fields.append(f"{name}={json.dumps(value)}")  # quoted: reasons have spaces
        elif isinstance(value, float):
            fields.append(f"{name}={value:.6f}")
        elif value is not None:
            fields.append(f"{name}={value}")
    trace_log.info("kvpeer.trace t=%.6f node=router id=%s event=sent %s",
                   sent_wall, request_id, " ".join(fields))


def _route_headers(ctx: RoutedRequest, plan: Plan, prefill_s: float | None) -> dict[str, str]:
    """Where the request went, for clients that measure (names from the router's config,
    never addresses): the serving engine, the peer it pulled from, the prefill leg."""
    headers = {"X-Kvpeer-Request-Id": ctx.request_id, "X-Kvpeer-Engine": plan.engine,
               REQUEST_ID_HEADER: ctx.client_request_id,
               "X-Kvpeer-Predicted-Cached-Tokens": str(plan.predicted_cached_tokens),
               "X-Kvpeer-Plan": plan.reason}
    if plan.predicted_ttft_s is not None:
        headers["X-Kvpeer-Predicted-Ttft-Seconds"] = f"{plan.predicted_ttft_s:.6f}"
    if plan.rejected_pull_ttft_s is not None:  # the pull passed over, predicted
        headers["X-Kvpeer-Rejected-Pull-Ttft-Seconds"] = f"{plan.rejected_pull_ttft_s:.6f}"
    source = plan.prefill_engine if prefill_s is not None else plan.source
    if source is not None:
        headers[SOURCE_HEADER] = source
    if prefill_s is not None:
        headers["X-Kvpeer-Prefill-Seconds"] = f"{prefill_s:.6f}"
    return headers


def _finished_body(data: bytes) -> tuple[bytes, params.Usage | None]:
    """A whole answer's usage, and the answer without ``kv_transfer_params`` (an engine's
    routing data, which may name internal peer addresses, is not the client's)."""
    try:
        document = json.loads(data)
    except ValueError:
        return data, None
    if isinstance(document, dict) and "kv_transfer_params" in document:
        del document["kv_transfer_params"]
        data = json.dumps(document).encode()
    return data, params.read_usage(document)


async def _read_quietly(response: aiohttp.ClientResponse) -> bytes:
    try:
        return await response.read()
    except (aiohttp.ClientError, TimeoutError):
        return b""
