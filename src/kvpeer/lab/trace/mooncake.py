"""Reading Mooncake's FAST'25 trace format: one JSON object a line.

Each line is one request: ``timestamp`` (ms from the trace's start), ``input_length``
and ``output_length`` (tokens), ``hash_ids`` (one id per block of
:data:`MOONCAKE_BLOCK_TOKENS` prompt tokens, the last block possibly partial; an id that
appears in two requests names the same prefix block). Invariants:

1. A bad line is an error naming the file, the line number and the field
   (:class:`~kvpeer.errors.ConfigError`): a trace is user input, and a silently skipped
   line would change every reuse figure measured on it.
2. Requests come out in file order; timestamps never decrease (a trace replayed at its
   timestamps must be in time order).
3. ``hash_ids`` covers the prompt: ``len(hash_ids) == ceil(input_length / block)``.
   Blank lines are skipped.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from kvpeer.errors import ConfigError

__all__ = ["MOONCAKE_BLOCK_TOKENS", "TraceRequest", "parse_lines", "read_trace"]

MOONCAKE_BLOCK_TOKENS: Final = 512
_FIELDS: Final = ("timestamp", "input_length", "output_length", "hash_ids")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace; ``block_tokens`` tokens per id of ``hash_ids``."""

    line: int  # 1-based line number in its file
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    block_tokens: int = MOONCAKE_BLOCK_TOKENS

    @property
    def full_blocks(self) -> tuple[int, ...]:
        """The ids of the prompt's full blocks: what a prefix cache can hold."""
        return self.hash_ids[: self.input_length // self.block_tokens]


def read_trace(path: str | Path) -> list[TraceRequest]:
    """Every request of the trace file at ``path`` (invariant 1 on a bad line)."""
    try:
        with open(path, encoding="utf-8") as lines:
            return list(parse_lines(lines, str(path)))
    except OSError as exc:
        raise ConfigError(f"trace {path}: {exc.strerror or exc}") from exc


def parse_lines(lines: Iterable[str], name: str = "trace") -> Iterator[TraceRequest]:
    """Requests of a trace's lines; ``name`` prefixes every error."""
    last = float("-inf")
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        where = f"{name}:{number}"
        try:
            row = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}: not JSON ({exc.msg})") from exc
        if not isinstance(row, dict):
            raise ConfigError(f"{where}: not a JSON object")
        for field in _FIELDS:
            if field not in row:
                raise ConfigError(f"{where}: field {field!r} missing")
        timestamp = _number(row["timestamp"], where, "timestamp")
        if timestamp < last:
            raise ConfigError(f"{where}: field 'timestamp' {timestamp:g} is before the "
                              f"previous line's {last:g}")
        last = timestamp
        input_length = _count(row["input_length"], where, "input_length", least=1)
        output_length = _count(row["output_length"], where, "output_length", least=0)
        ids = row["hash_ids"]
        if not isinstance(ids, list) or not all(
            isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 63 for x in ids
        ):
            raise ConfigError(f"{where}: field 'hash_ids' must be a list of integers "
                              "in [0, 2**63)")
        blocks = -(-input_length // MOONCAKE_BLOCK_TOKENS)
        if len(ids) != blocks:
            raise ConfigError(
                f"{where}: field 'hash_ids' has {len(ids)} ids; input_length {input_length} "
                f"is {blocks} blocks of {MOONCAKE_BLOCK_TOKENS}"
            )
        yield TraceRequest(number, timestamp, input_length, output_length, tuple(ids))


def _number(value: object, where: str, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{where}: field {field!r} must be a number, not {value!r}")
    if value < 0 or not math.isfinite(value):
        raise ConfigError(f"{where}: field {field!r} must be finite and >= 0, not {value!r}")
    return float(value)


def _count(value: object, where: str, field: str, *, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"{where}: field {field!r} must be an integer >= {least}, "
                          f"not {value!r}")
    return value
