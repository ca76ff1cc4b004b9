"""What the engines report of their own load, so that routers sharing them agree.

One router judges an engine's load by its own requests in flight; two routers in front of
the same engines each see half the truth. Every vLLM engine reports on its ``/metrics``
how many requests its scheduler is running and how many wait
(``vllm:num_requests_running``, ``vllm:num_requests_waiting``): the truth of every router
together, a scrape late. :class:`EngineLoadFeed` scrapes each engine every
``load_scrape_interval_s`` and :meth:`EngineLoadFeed.combine` folds the report into the
router's own count.

Rules:

1. The combined load is the router's own count plus what the others had in flight at
   the report: ``own_now + max(0, reported - own_at_report)`` requests (with one router,
   ``reported`` is about ``own_at_report``, and nothing changes). Waiting requests of the
   others count as queued prompt tokens at this router's mean prompt length.
2. No decision rests on a stale report: one older than ``STALE_INTERVALS`` intervals
   (a scrape that failed, an engine that stopped answering) is ignored, and the router
   falls back to its own count, which is never too low for its own requests.
3. An engine is hostile input like any peer: only the two series are read, a value
   must be a finite number within ``0..MAX_REPORTED``, anything else is ignored, and a
   page is read up to ``MAX_PAGE_BYTES``. A scrape is bounded by the health timeout,
   runs concurrently for every URL, and never raises into the router.
4. Engines behind one URL (data-parallel ranks of one API server) are told apart by the
   ``engine`` label vLLM puts on each series (the rank); one URL per engine sums every
   label.
5. The same page carries the tier's count of peers' lookups answered from held blocks
   and in serve windows: each scrape feeds them to :attr:`EngineLoadFeed.held_share`
   (:mod:`kvpeer.router.heldshare`), read the same way (rules 3 and 4).
6. It also carries the tier's bound on a peer's wait for its busy engine
   (``vllm:kvpeer_engine_wait_seconds``, its ``engine_wait_s``; ``+Inf``: none):
   :meth:`EngineLoadFeed.engine_wait_s` is what the engine's last good scrape said.
   A value must be ``+Inf`` or within ``0..MAX_ENGINE_WAIT_S`` (the tier's own
   config limit); anything else, or no such series, is not reported (the cost model's
   prior stands). One URL per engine with several labels takes the longest bound.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import aiohttp

from kvpeer.router.config import EngineEntry
from kvpeer.router.heldshare import MAX_COUNT, HeldShare
from kvpeer.router.policy import MAX_ENGINE_WAIT_S

__all__ = ["EngineLoadFeed", "Report", "parse_engine_wait", "parse_peer_lookups",
           "parse_reported"]

log = logging.getLogger(__name__)

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
STALE_INTERVALS = 3.0
MAX_REPORTED = 1_000_000.0
MAX_PAGE_BYTES = 8 << 20
_LINE = re.compile(r'^(vllm:num_requests_(?:running|waiting))(\{[^}]*\})?\s+(\S+)')
_LOOKUPS = re.compile(r'^(vllm:kvpeer_peer_lookups_total)(\{[^}]*\})\s+(\S+)')
_ENGINE_WAIT = re.compile(r'^(vllm:kvpeer_engine_wait_seconds)(\{[^}]*\})?\s+(\S+)')
_PATH_LABEL = re.compile(r'(?:^|[{,])path="(held|engine)"')
_ENGINE_LABEL = re.compile(r'(?:^|[{,])engine="([^"]*)"')


@dataclass(frozen=True, slots=True)
class Report:
    """One engine's scheduler, as its ``/metrics`` said at ``at`` (monotonic seconds)."""

    running: float
    waiting: float
    at: float
    own_in_flight: int  # this router's requests in flight then
    own_queued: int  # ...of which not yet answered with a first token


def parse_reported(page: str) -> dict[str, tuple[float, float]]:
    """``engine`` label -> (running, waiting) from a vLLM ``/metrics`` page (rule 3);
    series without the label count under ``""``."""
    found: dict[str, list[float]] = {}
    for key, match, value in _samples(page, _LINE, MAX_REPORTED):
        pair = found.setdefault(key, [0.0, 0.0])
        pair[0 if match.group(1) == RUNNING else 1] += value
    return {key: (pair[0], pair[1]) for key, pair in found.items()}


def parse_peer_lookups(page: str) -> dict[str, tuple[float, float]]:
    """``engine`` label -> (held, engine) counts of a kvpeer tier's peer lookups from a
    vLLM ``/metrics`` page (rules 3 and 5, up to :data:`~kvpeer.router.heldshare.MAX_COUNT`):
    a label without both series is left out."""
    found: dict[str, list[float]] = {}
    paths: dict[str, set[str]] = {}
    for key, match, value in _samples(page, _LOOKUPS, MAX_COUNT):
        path = _PATH_LABEL.search(match.group(2))
        if path is None:
            continue
        pair = found.setdefault(key, [0.0, 0.0])
        pair[0 if path.group(1) == "held" else 1] += value
        paths.setdefault(key, set()).add(path.group(1))
    return {key: (pair[0], pair[1]) for key, pair in found.items() if len(paths[key]) == 2}


def parse_engine_wait(page: str) -> dict[str, float]:
    """``engine`` label -> a kvpeer tier's ``engine_wait_s`` from a vLLM ``/metrics``
    page (rule 6: ``+Inf`` for none, else within ``0..MAX_ENGINE_WAIT_S``; several
    lines of one label: the longest)."""
    found: dict[str, float] = {}
    for key, _match, value in _samples(page, _ENGINE_WAIT, MAX_ENGINE_WAIT_S, unbounded=True):
        found[key] = max(value, found.get(key, 0.0))
    return found


def _samples(
    page: str, series: re.Pattern[str], most: float, *, unbounded: bool = False
) -> Iterator[tuple[str, re.Match[str], float]]:
    """(``engine`` label or ``""``, match, value) of each line of ``series`` whose value is
    a finite number within ``0..most`` (rule 3), or ``+Inf`` if ``unbounded``."""
    for line in page.splitlines():
        match = series.match(line)
        if match is None:
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        if (math.isfinite(value) and 0.0 <= value <= most) or (unbounded and value == math.inf):
            engine = _ENGINE_LABEL.search(match.group(2) or "")
            yield engine.group(1) if engine else "", match, value


class EngineLoadFeed:
    """Scrapes every engine's reported load and folds it into the router's own count."""

    def __init__(
        self,
        engines: Sequence[EngineEntry],
        own: Callable[[str], tuple[int, int]],
        *,
        interval_s: float,
        timeout_s: float,
        clock: Callable[[], float],
    ) -> None:
        """``own(name)``: this router's (in flight, awaiting a first token) for ``name``."""
        self._entries = tuple(engines)
        self._own = own
        self._interval_s = interval_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._clock = clock
        self._urls: dict[str, list[EngineEntry]] = {}
        for entry in self._entries:
            self._urls.setdefault(entry.spec.url, []).append(entry)
        self._reports: dict[str, Report] = {}
        self.held_share = HeldShare()  # rule 5
        self._engine_wait: dict[str, float] = {}  # rule 6
        self._scrapes = 0
        self._failures = 0

    def report(self, name: str) -> Report | None:
        """The latest report for ``name`` that is not stale (rule 2)."""
        report = self._reports.get(name)
        if report is None:
            return None
        if self._clock() - report.at > STALE_INTERVALS * self._interval_s:
            return None
        return report

    def engine_wait_s(self, name: str) -> float | None:
        """``name``'s tier's bound on a peer's wait for its engine, as its last good
        scrape reported it (``inf``: none); None when not reported (rule 6)."""
        return self._engine_wait.get(name)

    def combine(
        self, name: str, in_flight: int, queued_tokens: int, mean_prompt_tokens: float
    ) -> tuple[int, int]:
        """(in flight, queued prompt tokens) of ``name`` for every router (rule 1)."""
        report = self.report(name)
        if report is None:
            return in_flight, queued_tokens
        others = max(0, round(report.running + report.waiting) - report.own_in_flight)
        others_waiting = max(0, round(report.waiting) - report.own_queued)
        return in_flight + others, queued_tokens + round(others_waiting * mean_prompt_tokens)

    def statistics(self) -> Mapping[str, float]:
        out = {"scrapes_total": float(self._scrapes),
               "scrape_failures_total": float(self._failures)}
        for name in (entry.name for entry in self._entries):
            report = self.report(name)
            if report is not None:
                out[f"reported_requests:{name}"] = report.running + report.waiting
        return out

    async def scrape_once(self, session: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(self._scrape(session, url) for url in self._urls))

    async def run(self) -> None:
        """Scrape every ``interval_s`` until cancelled, on a session of its own that keeps
        no idle connection: the router's pool (requests, health checks) is not widened by
        a scrape that overlaps them, and between scrapes nothing is held open."""
        connector = aiohttp.TCPConnector(force_close=True, limit=len(self._urls) or 1)
        async with aiohttp.ClientSession(connector=connector) as session:
            while True:
                await self.scrape_once(session)
                await asyncio.sleep(self._interval_s)

    async def _scrape(self, session: aiohttp.ClientSession, url: str) -> None:
        self._scrapes += 1
        entries = self._urls[url]
        own = {entry.name: self._own(entry.name) for entry in entries}
        try:
            async with session.get(f"{url}/metrics", timeout=self._timeout) as response:
                if response.status != 200:
                    raise ValueError(f"/metrics answered {response.status}")
                raw = await response.content.read(MAX_PAGE_BYTES)
            page = raw.decode("utf-8", errors="replace")
            by_engine = parse_reported(page)
            lookups = parse_peer_lookups(page)
            waits = parse_engine_wait(page)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
            self._failures += 1
            log.debug("engine load from %s: %s", url, exc)
            return
        at = self._clock()
        for entry in entries:
            counts = _of_engine(lookups, entry) if lookups else None
            if counts is not None:
                self.held_share.observe(entry.name, *counts)
            wait = _wait_of_engine(waits, entry)
            if wait is None:
                self._engine_wait.pop(entry.name, None)
            else:
                self._engine_wait[entry.name] = wait
            pair = _of_engine(by_engine, entry)
            if pair is None:
                continue
            running, waiting = pair
            in_flight, queued = own[entry.name]
            self._reports[entry.name] = Report(running, waiting, at, in_flight, queued)


def _of_engine(
    by_engine: Mapping[str, tuple[float, float]], entry: EngineEntry
) -> tuple[float, float] | None:
    """``entry``'s pair of a page's series by ``engine`` label: its rank's, or every
    label's sum for one engine per URL (rule 4); None when its rank has none."""
    if entry.dp_rank is None:
        return (sum(pair[0] for pair in by_engine.values()),
                sum(pair[1] for pair in by_engine.values()))
    return by_engine.get(str(entry.dp_rank))


def _wait_of_engine(by_engine: Mapping[str, float], entry: EngineEntry) -> float | None:
    """``entry``'s bound of a page's by ``engine`` label: its rank's, or the longest of
    every label's for one engine per URL (rules 4 and 6)."""
    if entry.dp_rank is None:
        return max(by_engine.values(), default=None)
    return by_engine.get(str(entry.dp_rank))
