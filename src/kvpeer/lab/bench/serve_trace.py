"""``kvpeer bench serve --trace``: one slow request's timeline across router and engines.

With ``--trace`` the engines run their tier with ``KVPEER_TRACE=1`` (each pull's steps on
logger ``kvpeer.trace``, in the engine's log file; :mod:`kvpeer.node.trace`) and the
in-process routers log one ``kvpeer.trace`` line per request (:class:`RouterCapture`
keeps them). After the run the slowest measured kvpeer request of each workload is
picked, and every line naming its ``kv_request_id`` — the router's and both engines' —
is merged by wall-clock time into one timeline, relative to the router's send::

    +0.000 router  sent to b (source a, pull: predicted faster), predicted TTFT 0.412 s
    +0.012 b       lookup_asked peer=a
    ...
    +0.731 router  first byte (TTFT 0.731 s)

Everything here reads text: tested on recorded lines, no engine needed.
"""

from __future__ import annotations

import logging
import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvpeer.lab.bench.serve_stats import RequestRecord
from kvpeer.node.trace import TRACE_ENV, TRACE_LOGGER

__all__ = [
    "TRACE_ENV",
    "RouterCapture",
    "Slowest",
    "TraceEvent",
    "parse_line",
    "parse_lines",
    "render_timeline",
    "timeline",
]

ROUTER_NODE = "router"
_MARK = re.compile(r"kvpeer\.trace (t=\S+ .*)$")


@dataclass(frozen=True, slots=True)
class TraceEvent:
    """One trace line: when (wall clock), which node, which request, what."""

    t: float
    node: str
    kv_request_id: str
    event: str
    fields: Mapping[str, str] = field(default_factory=dict)


def parse_line(line: str) -> TraceEvent | None:
    """The trace event in ``line`` (any log prefix before it), or None."""
    match = _MARK.search(line.rstrip("\n"))
    if match is None:
        return None
    try:
        tokens = shlex.split(match.group(1))
    except ValueError:
        return None  # a line cut short (a process killed mid-write)
    values = dict(token.split("=", 1) for token in tokens if "=" in token)
    try:
        t = float(values.pop("t"))
        node, kv_request_id, event = values.pop("node"), values.pop("id"), values.pop("event")
    except (KeyError, ValueError):
        return None
    return TraceEvent(t, node, kv_request_id, event, values)


def parse_lines(lines: Iterable[str]) -> list[TraceEvent]:
    return [e for e in map(parse_line, lines) if e is not None]


def read_logs(paths: Iterable[Path]) -> list[TraceEvent]:
    """Every trace event of these log files (missing files are skipped)."""
    found: list[TraceEvent] = []
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        found.extend(parse_lines(text.splitlines()))
    return found


def timeline(events: Iterable[TraceEvent], kv_request_id: str) -> list[TraceEvent]:
    """The request's events, by wall-clock time; a router event's first byte is its own
    entry (``first_byte``, at send + TTFT)."""
    picked: list[TraceEvent] = []
    for e in events:
        if e.kv_request_id != kv_request_id:
            continue
        picked.append(e)
        if e.node == ROUTER_NODE and e.event == "sent" and "first_byte_s" in e.fields:
            first = e.t + float(e.fields["first_byte_s"])
            picked.append(TraceEvent(first, e.node, e.kv_request_id, "first_byte", e.fields))
    return sorted(picked, key=lambda e: e.t)


def render_timeline(events: Sequence[TraceEvent], names: Mapping[str, str]) -> list[str]:
    """One line per event, ``+seconds`` from the first; ``names`` maps peer ids
    (``host:port``) to engine names."""
    if not events:
        return []
    start = events[0].t
    width = max(len(names.get(e.node, e.node)) for e in events)
    return [
        f"+{e.t - start:7.3f} {names.get(e.node, e.node):<{width}}  {_describe(e, names)}"
        for e in events
    ]


def _describe(e: TraceEvent, names: Mapping[str, str]) -> str:
    f = e.fields
    if e.node == ROUTER_NODE:
        if e.event == "first_byte":
            return f"first byte (TTFT {float(f['first_byte_s']):.3f} s)"
        source = f.get("source", "-")
        text = f"sent to {f.get('engine', '?')} (source {source}, {f.get('reason', '')})"
        if "predicted_ttft_s" in f:
            text += f", predicted TTFT {float(f['predicted_ttft_s']):.3f} s"
        if "prefill_leg_s" in f:
            text += f", prefill leg {float(f['prefill_leg_s']):.3f} s"
        return text
    shown = " ".join(f"{k}={names.get(v, v)}" for k, v in f.items())
    return f"{e.event} {shown}".rstrip()


class Slowest:
    """The slowest measured request (by TTFT) of each workload of one arm, over every
    repeat."""

    def __init__(self, arm: str) -> None:
        self.arm = arm
        self.picked: dict[str, RequestRecord] = {}

    def __call__(self, arm: str, workload: str, records: Sequence[RequestRecord]) -> None:
        if arm != self.arm:
            return
        traced = [r for r in records if r.request_id is not None and r.error is None]
        before = self.picked.get(workload)
        if before is not None:
            traced.append(before)
        if traced:
            self.picked[workload] = max(traced, key=lambda r: r.ttft_s)

    def timelines(self, events: Sequence[TraceEvent], names: Mapping[str, str]) -> list[str]:
        """Each picked request's timeline, rendered, under a heading line."""
        out: list[str] = []
        for workload, record in self.picked.items():
            request_id = record.request_id or ""
            out.append(f"{workload}: slowest {self.arm} request {request_id} "
                       f"(TTFT {record.ttft_s:.3f} s, engine {record.engine}, "
                       f"source {record.source or '-'}, cached {record.cached_tokens}"
                       f"/{record.prompt_tokens})")  # fmt: skip
            lines = render_timeline(timeline(events, request_id), names)
            out.extend(f"  {line}" for line in lines or ["(no trace lines)"])
        return out


class RouterCapture(logging.Handler):
    """Keeps this process's ``kvpeer.trace`` lines (the in-process routers') while
    installed; :meth:`install` turns the router's trace on."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self._previous = logging.NOTSET

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def install(self) -> RouterCapture:
        logger = logging.getLogger(TRACE_LOGGER)
        self._previous = logger.level
        logger.setLevel(logging.INFO)
        logger.addHandler(self)
        logger.propagate = False  # kept here, not printed amid the progress lines
        return self

    def remove(self) -> None:
        logger = logging.getLogger(TRACE_LOGGER)
        logger.removeHandler(self)
        logger.setLevel(self._previous)
        logger.propagate = True

    def events(self) -> list[TraceEvent]:
        return parse_lines(self.lines)
