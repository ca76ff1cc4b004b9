"""A fake vLLM OpenAI server: the router's tests and its overhead bench run against it.

It speaks the subset of vLLM's API the router uses — ``/v1/completions`` and
``/v1/chat/completions`` (streamed as SSE ``data:`` events ending in ``[DONE]``, a final
``choices: []`` usage chunk only when ``stream_options.include_usage``), ``usage`` with
``prompt_tokens_details.cached_tokens``, ``/tokenize``, ``/health``, ``/v1/models``,
``/metrics`` (``process_start_time_seconds``: when this fake started) —
records what it received (bodies and headers, so tests check ``kv_transfer_params``), and
can be told to misbehave: answer an error status, hang before answering, hold the last
stream chunk until released, drop the connection mid-stream, or answer ``/health`` late.

In-process (tests): :class:`FakeEngine` on the test's event loop, steered through its
``behaviour`` and ``release_last``. As a process (the bench, process-death tests):
``python -m kvpeer.lab.engines.fakeengine --ready-file F``, steered through ``POST
/_fake/behaviour`` and ``POST /_fake/release``, read through ``GET /_fake/received``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from aiohttp import web

from kvpeer.router.server_socket import bind, write_ready_file

__all__ = ["Behaviour", "FakeEngine", "Received", "main"]

MODEL = "fake-model"


@dataclass(slots=True)
class Behaviour:
    """What the fake does with generation requests (``/v1/*completions``)."""

    fail_status: int | None = None  # answer with this status...
    fail_count: int | None = None  # ...this many times (None: always)
    hang: bool = False  # never answer until the engine stops
    chunks: int = 3  # content chunks of a stream
    hold_last: bool = False  # wait for ``release_last`` before the last content chunk
    drop_after_chunks: int | None = None  # stream: close the connection after N chunks
    cached_tokens: int = 0
    health_status: int = 200
    health_delay_s: float = 0.0  # answer /health this late (a loaded API server)
    start_time: bool = True  # /metrics has process_start_time_seconds (when it started)
    #: /metrics has a kvpeer tier's vllm:kvpeer_engine_wait_seconds, this value as written
    #: (its engine_wait_s: "0.25", "+Inf"; anything, for a hostile engine); None: no tier
    engine_wait: str | None = None
    tokenize_status: int = 200
    record: bool = True
    answer_kv_params: dict[str, Any] | None = None  # put in whole answers, as vLLM may


@dataclass(frozen=True, slots=True)
class Received:
    path: str
    body: dict[str, Any]
    headers: dict[str, str]


def _prompt_len(body: Mapping[str, Any]) -> int:
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return len(prompt)
    if isinstance(prompt, str):
        return len(prompt)
    messages = body.get("messages")
    if isinstance(messages, list):
        return sum(len(str(m.get("content", ""))) for m in messages if isinstance(m, dict))
    return 0


class FakeEngine:
    """One fake OpenAI server on loopback."""

    def __init__(
        self,
        name: str = "fake",
        behaviour: Behaviour | None = None,
        journal: list[str] | None = None,
    ) -> None:
        self.name = name
        self.journal = journal if journal is not None else []  # "NAME:start" / "NAME:end"
        self.behaviour = behaviour or Behaviour()
        self.received: list[Received] = []
        self.release_last = asyncio.Event()
        self.stream_started = asyncio.Event()  # a stream's first chunk was written
        self._runner: web.AppRunner | None = None
        self._transports: set[asyncio.Transport] = set()
        self.port = 0
        self.running = 0  # generations in progress (reported on /metrics as vLLM does)
        self.started_at = 0.0  # wall clock of start(): this fake's process identity
        app = web.Application()
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/_fake/behaviour", self._set_behaviour)
        app.router.add_post("/_fake/release", self._release)
        app.router.add_get("/_fake/received", self._received)
        self._app = app

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def generation_bodies(self) -> list[dict[str, Any]]:
        return [r.body for r in self.received if r.path.endswith("completions")]

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._runner = web.AppRunner(self._app, access_log=None, shutdown_timeout=0.2)
        await self._runner.setup()
        self.started_at = time.time()
        sock = bind(host, port)
        self.port = sock.getsockname()[1]
        await web.SockSite(self._runner, sock).start()

    async def stop(self) -> None:
        """Die: stop listening and drop every open connection, mid-answer or not."""
        for transport in list(self._transports):
            transport.abort()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _track(self, request: web.Request) -> None:
        if isinstance(request.transport, asyncio.Transport):
            self._transports.add(request.transport)

    async def _record(self, request: web.Request) -> dict[str, Any]:
        self._track(request)
        body = await request.json()
        assert isinstance(body, dict)
        if self.behaviour.record:
            self.received.append(Received(request.path, body, dict(request.headers)))
        return body

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        body = await self._record(request)
        self.journal.append(f"{self.name}:start")
        self.running += 1
        try:
            return await self._answer(request, body, chat=chat)
        finally:
            self.running -= 1
            self.journal.append(f"{self.name}:end")

    async def _answer(
        self, request: web.Request, body: dict[str, Any], *, chat: bool
    ) -> web.StreamResponse:
        b = self.behaviour
        if b.fail_status is not None and (b.fail_count is None or b.fail_count > 0):
            if b.fail_count is not None:
                b.fail_count -= 1
            return web.json_response(
                {"error": {"message": f"{self.name} told to fail", "code": b.fail_status}},
                status=b.fail_status,
            )
        if b.hang:
            await asyncio.Event().wait()
        prompt_tokens = _prompt_len(body)
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or b.chunks
        chunks = max(1, min(int(max_tokens), b.chunks))
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": chunks,
            "total_tokens": prompt_tokens + chunks,
            "prompt_tokens_details": {"cached_tokens": b.cached_tokens},
        }
        rid = f"cmpl-{self.name}-{len(self.received)}"
        kind = "chat.completion" if chat else "text_completion"
        if body.get("stream") is not True:
            if chat:
                choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "message": {
                    "role": "assistant", "content": "".join(f"t{i} " for i in range(chunks))}}
            else:
                choice = {"index": 0, "finish_reason": "length",
                          "text": "".join(f"t{i} " for i in range(chunks))}
            whole = {"id": rid, "object": kind, "created": int(time.time()), "model": MODEL,
                     "choices": [choice], "usage": usage}
            if b.answer_kv_params is not None:
                whole["kv_transfer_params"] = b.answer_kv_params
            return web.json_response(whole)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and options.get("include_usage") is True
        for i in range(chunks):
            if b.drop_after_chunks is not None and i >= b.drop_after_chunks:
                assert request.transport is not None
                request.transport.abort()
                return response
            if i == chunks - 1 and b.hold_last:
                await self.release_last.wait()
            last = i == chunks - 1
            if chat:
                choice = {"index": 0, "delta": {"content": f"t{i} "},
                          "finish_reason": "length" if last else None}
            else:
                choice = {"index": 0, "text": f"t{i} ", "finish_reason": "length" if last else None}
            chunk = {"id": rid, "object": f"{kind}.chunk" if chat else kind, "model": MODEL,
                     "choices": [choice]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.stream_started.set()
        if include_usage:
            final = {"id": rid, "object": kind, "model": MODEL, "choices": [], "usage": usage}
            await response.write(f"data: {json.dumps(final)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await self._record(request)
        if self.behaviour.tokenize_status != 200:
            return web.json_response({"error": "no tokenizer"},
                                     status=self.behaviour.tokenize_status)
        if isinstance(body.get("prompt"), str):
            text = body["prompt"]
        else:
            text = "".join(str(m.get("content", "")) for m in body.get("messages", []))
        tokens = [ord(c) % 512 for c in text]
        return web.json_response({"count": len(tokens), "max_model_len": 4096, "tokens": tokens})

    async def _health(self, request: web.Request) -> web.Response:
        if self.behaviour.health_delay_s > 0:
            await asyncio.sleep(self.behaviour.health_delay_s)
        return web.Response(status=self.behaviour.health_status)

    async def _metrics(self, request: web.Request) -> web.Response:
        """vLLM's ``/metrics`` as the router reads it: the two scheduler gauges (running:
        this fake's generations in progress), with ``start_time`` the API server's
        ``process_start_time_seconds``, and with ``engine_wait`` a kvpeer tier's bound."""
        labels = f'engine="0",model_name="{MODEL}"'
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} {float(self.running)}",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{labels}}} 0.0",
        ]
        if self.behaviour.start_time:
            lines += ["# TYPE process_start_time_seconds gauge",
                      f"process_start_time_seconds {self.started_at!r}"]
        if self.behaviour.engine_wait is not None:
            lines += ["# TYPE vllm:kvpeer_engine_wait_seconds gauge",
                      f"vllm:kvpeer_engine_wait_seconds{{{labels}}} {self.behaviour.engine_wait}"]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": MODEL, "object": "model", "owned_by": self.name}]})

    async def _set_behaviour(self, request: web.Request) -> web.Response:
        changes = await request.json()
        known = {f.name for f in fields(Behaviour)}
        if not isinstance(changes, dict) or not set(changes) <= known:
            return web.json_response({"error": f"known keys: {sorted(known)}"}, status=400)
        for key, value in changes.items():
            setattr(self.behaviour, key, value)
        return web.json_response(asdict(self.behaviour))

    async def _release(self, request: web.Request) -> web.Response:
        self.release_last.set()
        return web.json_response({})

    async def _received(self, request: web.Request) -> web.Response:
        return web.json_response([asdict(r) for r in self.received])


async def _serve(port: int, ready_file: Path | None, behaviour: Behaviour) -> None:
    engine = FakeEngine(behaviour=behaviour)
    await engine.start(port=port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    if ready_file is not None:
        write_ready_file(ready_file, engine.url)
    print(engine.url, flush=True)
    await stop.wait()
    await engine.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="a fake vLLM OpenAI server")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--ready-file", help="write its URL here once listening")
    parser.add_argument("--chunks", type=int, default=3)
    parser.add_argument("--no-record", action="store_true", help="keep no request log")
    args = parser.parse_args(argv)
    behaviour = Behaviour(chunks=args.chunks, record=not args.no_record)
    asyncio.run(_serve(args.port, Path(args.ready_file) if args.ready_file else None, behaviour))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
