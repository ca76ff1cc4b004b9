"""Request bodies the router sends: the client's fields, and ``kv_transfer_params`` it owns.

Invariants:

1. Nothing a client sends reaches an engine as transfer routing: ``kv_transfer_params``
   and ``ec_transfer_params`` are removed, and so are those keys inside ``vllm_xargs``
   (vLLM merges ``vllm_xargs`` into the same ``extra_args`` its connector reads). An
   engine only ever dials a peer address taken from the router's configuration.
2. Every other field the client sent goes to the serving engine unchanged, except that a
   stream asks for usage (the router learns ``cached_tokens`` from it); the caller strips
   the extra usage chunk again when the client did not ask for it.
3. The prefill leg is a different request: ``max_tokens = 1``, not streamed, no
   ``min_tokens`` (which would contradict ``max_tokens``), one choice.

Builders return new dicts; the client's body is never mutated, so a retry starts from
the same clean body.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpeer.router.policy import EngineSpec

__all__ = [
    "StreamFilter",
    "Usage",
    "decode_leg",
    "prefill_leg",
    "prompt_token_ids",
    "read_usage",
    "sanitize",
    "shared_leg",
    "tokenize_body",
    "want_usage",
]

ROUTER_OWNED = ("kv_transfer_params", "ec_transfer_params")


def sanitize(body: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The client's body without routing fields it may not set, and what was removed."""
    clean = {k: v for k, v in body.items() if k not in ROUTER_OWNED}
    removed = [k for k in ROUTER_OWNED if k in body]
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, Mapping) and any(k in xargs for k in ROUTER_OWNED):
        clean["vllm_xargs"] = {k: v for k, v in xargs.items() if k not in ROUTER_OWNED}
        removed += [f"vllm_xargs.{k}" for k in ROUTER_OWNED if k in xargs]
    return clean, removed


def _target(kv_request_id: str, peer: EngineSpec) -> dict[str, Any]:
    return {"kv_request_id": kv_request_id, "remote_host": peer.peer_host,
            "remote_port": peer.peer_port}


def prefill_leg(body: Mapping[str, Any], kv_request_id: str, *, chat: bool) -> dict[str, Any]:
    """The PD producer leg: compute the prompt's KV and park it for ``kv_request_id``."""
    leg = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "min_tokens")}
    leg["max_tokens"] = 1
    if chat:
        leg["max_completion_tokens"] = 1
    leg["stream"] = False
    leg["n"] = 1
    leg["kv_transfer_params"] = {"remote_decoder": {"kv_request_id": kv_request_id}}
    return leg


def decode_leg(
    body: Mapping[str, Any], kv_request_id: str, prefill: EngineSpec | None
) -> dict[str, Any]:
    """The PD consumer leg: the client's request, pulling every block from ``prefill``.

    ``prefill`` is None when the prefill leg failed or was not planned (decode-only).
    The leg is sent after the prefill leg answered, and says so (``prefill_done``, a
    kvpeer extension vLLM's tier ignores): a producer that restarted since fails the
    pull at once instead of waiting for a prefill that will never come to it.
    """
    leg = dict(body)
    if prefill is not None:
        target = _target(kv_request_id, prefill) | {"prefill_done": True}
        leg["kv_transfer_params"] = {"remote_prefiller": target}
    return leg


def shared_leg(
    body: Mapping[str, Any],
    kv_request_id: str,
    source: EngineSpec | None,
    held_tokens: int | None = None,
    give_up_s: float | None = None,
) -> dict[str, Any]:
    """A whole request; with ``source`` it pulls the prefix that peer holds.

    ``held_tokens`` (a kvpeer extension vLLM's tier ignores) is how much of the prompt
    the router saw ``source`` hold: a kvpeer consumer then fetches that much without
    asking the peer first, which saves the engine step that waits for the answer.
    ``give_up_s`` (another): a kvpeer consumer whose pull has not landed that long
    after it started computes the blocks instead.
    """
    leg = dict(body)
    if source is not None:
        target = _target(kv_request_id, source)
        if held_tokens is not None and held_tokens > 0:
            target["held_tokens"] = held_tokens
        if give_up_s is not None:
            target["give_up_s"] = round(give_up_s, 3)
        leg["kv_transfer_params"] = {"remote_kv_source": target}
    return leg


def want_usage(body: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
    """Ask a stream for its final usage chunk; True if the client did not ask itself."""
    if body.get("stream") is not True:
        return dict(body), False
    options = body.get("stream_options")
    if isinstance(options, Mapping) and options.get("include_usage") is True:
        return dict(body), False
    leg = dict(body)
    leg["stream_options"] = {**(options if isinstance(options, Mapping) else {}),
                             "include_usage": True}
    return leg, True


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int | None
    cached_tokens: int | None


def read_usage(document: object) -> Usage | None:
    """``usage`` of a completion or a stream chunk, or None if it carries none."""
    if not isinstance(document, Mapping):
        return None
    usage = document.get("usage")
    if not isinstance(usage, Mapping):
        return None
    prompt = usage.get("prompt_tokens")
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
    return Usage(
        prompt if isinstance(prompt, int) and not isinstance(prompt, bool) else None,
        cached if isinstance(cached, int) and not isinstance(cached, bool) else None,
    )


def _is_token_list(value: object) -> bool:
    # map(type) runs in C: this is on every request's path, over every prompt token
    return (
        isinstance(value, list)
        and bool(value)
        and set(map(type, value)) == {int}
        and min(value) >= 0
    )


def prompt_token_ids(body: Mapping[str, Any], *, chat: bool) -> list[int] | None:
    """The prompt's token ids when the client sent them (one ``prompt`` of ints)."""
    prompt = body.get("prompt")
    if chat or not _is_token_list(prompt):
        return None
    assert isinstance(prompt, list)
    return prompt


def tokenize_body(body: Mapping[str, Any], *, chat: bool) -> dict[str, Any] | None:
    """The ``/tokenize`` request for this prompt, or None if it has no single prompt."""
    out: dict[str, Any] = {}
    if "model" in body:
        out["model"] = body["model"]
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        out["messages"] = messages
        for key in ("add_generation_prompt", "continue_final_message", "chat_template",
                    "chat_template_kwargs", "tools"):
            if key in body:
                out[key] = body[key]
        return out
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        return None
    out["prompt"] = prompt
    return out


class StreamFilter:
    """Passes a stream's SSE events on whole, reads usage, drops the usage chunk we added.

    Bytes go out as soon as an event is complete (``\\n\\n``), never held longer; the
    event carrying ``usage`` is the only one parsed. With ``strip_usage`` (the client did
    not ask for usage, the router did) the final ``choices: []`` usage chunk is dropped.
    """

    def __init__(self, *, strip_usage: bool) -> None:
        self._strip = strip_usage
        self._pending = b""
        self.usage: Usage | None = None

    def feed(self, data: bytes) -> bytes:
        """The complete events in ``data`` (plus what was pending) to send on."""
        buffer = self._pending + data
        end = buffer.rfind(b"\n\n")
        if end < 0:
            self._pending = buffer
            return b""
        complete, self._pending = buffer[: end + 2], buffer[end + 2 :]
        if b'"usage"' not in complete:
            return complete
        kept = [event for event in complete.split(b"\n\n")[:-1] if self._keep(event)]
        return b"".join(event + b"\n\n" for event in kept)

    def flush(self) -> bytes:
        """What remains at the end of the stream (an unterminated last event)."""
        rest, self._pending = self._pending, b""
        return rest if self._keep(rest) else b""

    def _keep(self, event: bytes) -> bool:
        if b'"usage"' not in event:
            return True
        data = event.strip()
        if not data.startswith(b"data:"):
            return True
        try:
            document = json.loads(data[5:])
        except ValueError:
            return True
        usage = read_usage(document)
        if usage is None:
            return True
        self.usage = usage
        return not (self._strip and isinstance(document, dict) and document.get("choices") == [])
