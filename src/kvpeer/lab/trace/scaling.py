"""Fitting a trace to a served model and a machine: block size, speed, a window of it.

Rules (each keeps a block id's meaning: ids are never renumbered, so ids shared in the
trace stay shared, and a scaled trace's infinite-cache reuse counts the same blocks):

1. ``block_tokens``: every id stands for that many tokens instead of 512; prompt and
   output lengths scale by the same factor, and a prompt keeps its number of blocks (its
   last block stays partial, or full, as it was).
2. ``time_scale``: every timestamp is multiplied by it (2.0 replays at half the rate).
3. ``window``: only requests whose trace time lies in ``[start, start + duration)``
   seconds are kept, their timestamps made relative to ``start`` (before rule 2).
4. :func:`fit_context`: a request is fitted to an engine's context: its output kept to a
   quarter of it (at least 1 token), its prompt cut to what then fits, keeping its first
   blocks (a prefix of a prefix is still shared as it was). ``kvpeer bench trace`` and
   ``kvpeer lab fleet --context`` fit alike, so the model sees the bench's requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpeer.errors import ConfigError
from kvpeer.lab.trace.mooncake import MOONCAKE_BLOCK_TOKENS, TraceRequest

__all__ = ["TraceScale", "fit_context", "scale_trace"]


@dataclass(frozen=True, slots=True)
class TraceScale:
    block_tokens: int = MOONCAKE_BLOCK_TOKENS
    time_scale: float = 1.0
    window_start_s: float = 0.0
    window_s: float | None = None  # None: to the trace's end

    def __post_init__(self) -> None:
        if self.block_tokens < 1:
            raise ConfigError(f"block_tokens must be >= 1, not {self.block_tokens}")
        if not self.time_scale > 0 or self.time_scale == float("inf"):
            raise ConfigError(f"time_scale must be a positive number, not {self.time_scale}")
        if self.window_start_s < 0:
            raise ConfigError(f"window start must be >= 0 s, not {self.window_start_s}")
        if self.window_s is not None and not self.window_s > 0:
            raise ConfigError(f"window must be > 0 s, not {self.window_s}")


def scale_trace(requests: Sequence[TraceRequest], scale: TraceScale) -> list[TraceRequest]:
    """The requests of ``requests`` that ``scale`` keeps, scaled (module docstring)."""
    start_ms = scale.window_start_s * 1000.0
    end_ms = float("inf") if scale.window_s is None else start_ms + scale.window_s * 1000.0
    out = []
    for request in requests:
        if not start_ms <= request.timestamp_ms < end_ms:
            continue
        out.append(_scaled(request, scale, start_ms))
    return out


def _scaled(request: TraceRequest, scale: TraceScale, start_ms: float) -> TraceRequest:
    size = scale.block_tokens
    factor = size / request.block_tokens
    blocks = len(request.hash_ids)
    full = request.input_length // request.block_tokens
    tail = request.input_length - full * request.block_tokens
    # Rule 1: full blocks stay full, a partial last block stays partial (1..size-1).
    input_length = full * size + (min(size - 1, max(1, round(tail * factor))) if tail else 0)
    if blocks and input_length == 0:
        input_length = 1
    output_length = request.output_length and max(1, round(request.output_length * factor))
    return TraceRequest(
        request.line,
        (request.timestamp_ms - start_ms) * scale.time_scale,
        input_length,
        output_length,
        request.hash_ids,
        size,
    )


def fit_context(request: TraceRequest, context: int) -> TraceRequest:
    """Rule 4: ``request`` as an engine of ``context`` tokens can serve it."""
    output = max(1, min(request.output_length, context // 4))
    length = min(request.input_length, context - output - 1)
    blocks = request.hash_ids[: -(-length // request.block_tokens)]
    return TraceRequest(request.line, request.timestamp_ms, length, output, blocks,
                        request.block_tokens)
