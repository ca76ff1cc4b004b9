"""A client of vLLM's OpenAI HTTP API that records what kvpeer's demo and benchmarks need.

It is the official ``openai`` client (what users run), streaming, so the time to first
token is what a user would see: from sending the request to the first generated token.
vLLM's extensions ride in ``extra_body``: ``return_token_ids`` (exact generated token
ids, so outputs compare token for token), ``ignore_eos`` (a fixed output length) and
greedy sampling; ``stream_options.include_usage`` brings the usage, whose
``prompt_tokens_details.cached_tokens`` says how many prompt tokens the engine did not
compute (from its own cache or pulled from a peer).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Completion", "OpenAIClient"]

REQUEST_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Completion:
    """One streamed completion as the client saw it."""

    tokens: list[int]
    logprobs: list[float]
    ttft_s: float  # request sent → first generated token received
    seconds: float  # request sent → stream ended
    prompt_tokens: int
    cached_tokens: int  # prompt tokens the engine did not compute
    headers: dict[str, str] = field(default_factory=dict)

    def max_logprob_delta(self, other: Completion) -> float:
        pairs = zip(self.logprobs, other.logprobs, strict=True)
        return max((abs(a - b) for a, b in pairs), default=0.0)


class OpenAIClient:
    """Streams completions and chat completions from one OpenAI-compatible base URL."""

    def __init__(self, base_url: str, model: str, timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        from openai import OpenAI

        # The typed overloads want literal model names: the boundary is this one name.
        self._client: Any = OpenAI(
            base_url=f"{base_url}/v1", api_key="unused", timeout=timeout_s, max_retries=0
        )
        self.model = model

    def close(self) -> None:
        self._client.close()

    def complete(
        self,
        prompt: str | Sequence[int],
        max_tokens: int,
        headers: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> Completion:
        """A greedy completion of ``prompt`` (text, or token ids); ``extra``: more vLLM
        request fields (e.g. ``cache_salt``)."""
        body: Any = prompt if isinstance(prompt, str) else list(prompt)
        started = time.monotonic()
        raw = self._client.completions.with_raw_response.create(
            model=self.model,
            prompt=body,
            max_tokens=max_tokens,
            temperature=0.0,
            logprobs=1,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"return_token_ids": True, "ignore_eos": True, **(extra or {})},
            extra_headers=headers,
        )
        return _collect(raw, started, chat=False)

    def chat(
        self,
        messages: list[dict[str, str]],
        max_tokens: int,
        headers: dict[str, str] | None = None,
    ) -> Completion:
        """A greedy chat completion of ``messages``."""
        started = time.monotonic()
        raw = self._client.chat.completions.with_raw_response.create(
            model=self.model,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0.0,
            logprobs=True,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"return_token_ids": True, "ignore_eos": True},
            extra_headers=headers,
        )
        return _collect(raw, started, chat=True)


def _collect(raw: Any, started: float, *, chat: bool) -> Completion:
    """Read a raw streamed response to its end: tokens, logprobs, TTFT, usage."""
    headers = {key.lower(): value for key, value in raw.headers.items()}
    tokens: list[int] = []
    logprobs: list[float] = []
    ttft: float | None = None
    usage: Any = None
    for chunk in raw.parse():
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            extra = choice.model_extra or {}
            ids = extra.get("token_ids") or []
            if ids and ttft is None:
                ttft = time.monotonic() - started
            tokens.extend(int(token) for token in ids)
            logprobs.extend(_logprobs(choice, chat=chat))
    seconds = time.monotonic() - started
    details = getattr(usage, "prompt_tokens_details", None)
    return Completion(
        tokens=tokens,
        logprobs=logprobs,
        ttft_s=seconds if ttft is None else ttft,
        seconds=seconds,
        prompt_tokens=int(getattr(usage, "prompt_tokens", 0) or 0),
        cached_tokens=int(getattr(details, "cached_tokens", 0) or 0),
        headers=headers,
    )


def _logprobs(choice: Any, *, chat: bool) -> list[float]:
    logprobs = choice.logprobs
    if logprobs is None:
        return []
    if chat:
        return [float(item.logprob) for item in (logprobs.content or [])]
    return [float(value) for value in (logprobs.token_logprobs or []) if value is not None]
