"""Drive one workload phase through the router's OpenAI API, concurrently, and record
what each request saw.

The sync ``OpenAIClient`` of the demo sends one request at a time; Poisson arrivals need
requests in flight together, so this is an aiohttp client of ``/v1/completions``
measuring the same things: streamed, greedy, ``ignore_eos`` (fixed output length),
``return_token_ids``; TTFT is send → the first chunk carrying a generated token; usage
(``include_usage``) gives ``cached_tokens``; the router's ``X-Kvpeer-*`` headers say
which engine served and which peer it was told to pull from.

A request that fails (HTTP status, a broken stream, a timeout) becomes a record with its
``error`` set: one bad request must not end the arm, and errors are counted in the table.

Unpinned workloads are sent the way vLLM's own benchmark client sends them: its request
function (``vllm.benchmarks.lib.endpoint_request_func.async_request_openai_completions``,
imported) with the workload's text prompt; the arrival times stay ours (seeded, the same
for every arm). vLLM's function does not report ``cached_tokens`` (``None`` in the record:
the engines' prefix-cache counters say it instead); the router's headers are read from
the response by an aiohttp trace hook.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import json
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import SimpleNamespace
from typing import Any, Literal

import aiohttp

from kvpeer.lab.bench.serve_stats import RequestRecord
from kvpeer.lab.bench.serve_workloads import BenchRequest
from kvpeer.lab.engines.model import token_text

__all__ = ["MODEL_NAME", "PIN_HEADER", "Sender", "run_phase", "send", "send_like_vllm"]

MODEL_NAME = "kvpeer-demo"  # ServeSpec's --served-model-name
PIN_HEADER = "X-Kvpeer-Engine"
SOURCE_HEADER = "X-Kvpeer-Source"
REQUEST_TIMEOUT_S = 300.0
TAG_HEADER = "X-Kvpeer-Bench-Tag"  # pairs vLLM's request with its response's headers

Sender = Literal["kvpeer", "vllm"]
Send = Callable[
    [aiohttp.ClientSession, str, BenchRequest, str], Awaitable[tuple[float, RequestRecord]]
]


async def send(
    session: aiohttp.ClientSession, base_url: str, request: BenchRequest, model: str
) -> tuple[float, RequestRecord]:
    """Send ``request``; return its send time (monotonic) and its record (times relative
    to that send; the caller rebases ``sent_s``)."""
    body = {
        "model": model,
        "prompt": list(request.prompt),
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
        "ignore_eos": True,
    }
    headers = {PIN_HEADER: request.pin} if request.pin else {}
    if request.source:
        headers[SOURCE_HEADER] = request.source
    started = time.monotonic()
    ttft: float | None = None
    output = 0
    usage: Mapping[str, Any] = {}
    answer_headers: Mapping[str, str] = {}
    try:
        async with session.post(f"{base_url}/v1/completions", json=body, headers=headers) as resp:
            answer_headers = resp.headers
            if resp.status != 200:
                text = (await resp.text())[:200]
                raise _Failed(f"HTTP {resp.status}: {text}")
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise _Failed(f"stream error: {chunk['error']}")
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or ():
                    ids = choice.get("token_ids") or []
                    produced = len(ids) if ids else int(bool(choice.get("text")))
                    if produced and ttft is None:
                        ttft = time.monotonic() - started
                    output += produced
    except (TimeoutError, _Failed, aiohttp.ClientError, json.JSONDecodeError) as exc:
        seconds = time.monotonic() - started
        return started, RequestRecord(
            0.0, seconds, seconds, len(request.prompt), 0, 0,
            error=f"{type(exc).__name__}: {exc}",
        )  # fmt: skip
    seconds = time.monotonic() - started
    details = usage.get("prompt_tokens_details") or {}
    return started, RequestRecord(
        sent_s=0.0,
        ttft_s=seconds if ttft is None else ttft,
        latency_s=seconds,
        prompt_tokens=int(usage.get("prompt_tokens") or len(request.prompt)),
        output_tokens=int(usage.get("completion_tokens") or output),
        cached_tokens=int(details.get("cached_tokens") or 0),
        **_route(answer_headers),
    )


class _Failed(Exception):
    """The engine or router answered, but not with a completion."""


_tags = itertools.count()


async def send_like_vllm(
    session: aiohttp.ClientSession, base_url: str, request: BenchRequest, model: str,
    answers: dict[str, dict[str, str]],
) -> tuple[float, RequestRecord]:
    """Send ``request`` with vLLM's benchmark request function (greedy, ``ignore_eos``);
    ``session`` carries :func:`header_trace`, which files the router's answer headers in
    ``answers``."""
    from vllm.benchmarks.lib.endpoint_request_func import (
        RequestFuncInput,
        async_request_openai_completions,
    )

    tag = str(next(_tags))
    headers = {TAG_HEADER: tag}
    if request.pin:
        headers[PIN_HEADER] = request.pin
    if request.source:
        headers[SOURCE_HEADER] = request.source
    # Users send text: a prompt made of token ids goes as the text that tokenizes to them.
    prompt = request.text if request.text is not None else token_text(list(request.prompt))
    func_input = RequestFuncInput(
        prompt=prompt, api_url=f"{base_url}/v1/completions", prompt_len=len(request.prompt),
        output_len=request.max_tokens, model=model, ignore_eos=True,
        extra_headers=headers, extra_body={"temperature": 0.0},
    )  # fmt: skip
    started = time.monotonic()
    output = await async_request_openai_completions(func_input, session)
    seconds = time.monotonic() - started
    answer: Mapping[str, str] = answers.pop(tag, {})
    if not output.success:
        error = (output.error or "failed").strip().splitlines()[-1][:200]
        return started, RequestRecord(0.0, seconds, seconds, len(request.prompt), 0, None,
                                      error=error)  # fmt: skip
    return started, RequestRecord(
        sent_s=0.0,
        ttft_s=output.ttft,
        latency_s=output.latency,
        prompt_tokens=output.prompt_len or len(request.prompt),
        output_tokens=output.output_tokens or 0,
        cached_tokens=None,
        **_route(answer),
    )


def _route(headers: Mapping[str, str]) -> dict[str, Any]:
    """What the router's answer headers say of the request's route and plan."""
    return {
        "engine": headers.get("X-Kvpeer-Engine"),
        "source": headers.get("X-Kvpeer-Source"),
        "request_id": headers.get("X-Kvpeer-Request-Id"),
        "plan": headers.get("X-Kvpeer-Plan"),
        "predicted_ttft_s": _seconds(headers.get("X-Kvpeer-Predicted-Ttft-Seconds")),
        "rejected_pull_ttft_s": _seconds(headers.get("X-Kvpeer-Rejected-Pull-Ttft-Seconds")),
    }


def _seconds(text: str | None) -> float | None:
    try:
        return None if text is None else float(text)
    except ValueError:
        return None


def header_trace() -> tuple[aiohttp.TraceConfig, dict[str, dict[str, str]]]:
    """A trace hook keeping each tagged request's answer headers, and where it keeps them."""
    answers: dict[str, dict[str, str]] = {}

    async def on_end(
        _session: aiohttp.ClientSession, _ctx: SimpleNamespace,
        params: aiohttp.TraceRequestEndParams,
    ) -> None:
        tag = params.headers.get(TAG_HEADER)
        if tag is not None:
            answers[tag] = dict(params.response.headers)

    trace = aiohttp.TraceConfig()
    trace.on_request_end.append(on_end)
    return trace, answers



async def run_phase(
    requests: Sequence[BenchRequest],
    urls: Mapping[str, str],
    *,
    model: str = MODEL_NAME,
    timeout_s: float = REQUEST_TIMEOUT_S,
    sender: Sender = "kvpeer",
) -> list[RequestRecord]:
    """Send ``requests`` at their arrival times (after their ``after`` request and its
    think time), all concurrently; ``urls`` maps a router kind (``shared``, ``pd``) to its
    URL. Returns one record per request, in ``requests`` order, ``sent_s`` relative to
    the phase's start. ``sender`` ``vllm`` sends with vLLM's benchmark request function."""
    for index, request in enumerate(requests):
        if request.after is not None and not 0 <= request.after < index:
            raise ValueError(f"request {index}: after={request.after} is not an earlier request")
        if request.router not in urls:
            raise ValueError(f"request {index}: no URL for router {request.router!r}")
    done = [asyncio.Event() for _ in requests]
    records: list[RequestRecord | None] = [None] * len(requests)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = aiohttp.TCPConnector(limit=0)
    trace, answers = header_trace()
    send_one: Send = send
    if sender == "vllm":
        send_one = functools.partial(send_like_vllm, answers=answers)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=connector, trace_configs=[trace]
    ) as session:
        start = time.monotonic()

        async def one(index: int, request: BenchRequest) -> None:
            try:
                await asyncio.sleep(max(0.0, start + request.at_s - time.monotonic()))
                if request.after is not None:
                    await done[request.after].wait()
                    await asyncio.sleep(request.think_s)  # the user reads the answer
                sent, record = await send_one(session, urls[request.router], request, model)
                records[index] = _rebased(record, sent - start)
            finally:
                done[index].set()

        await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    return [r for r in records if r is not None]


def _rebased(record: RequestRecord, sent_s: float) -> RequestRecord:
    return dataclasses.replace(record, sent_s=sent_s)
