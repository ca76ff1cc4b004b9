"""Which engines may receive requests: active health checks plus what requests observe.

Rules:

1. An engine is up only after a ``GET /health`` answered 200 within the timeout; every
   engine starts down until the first check round (run before the router listens).
2. A failed check, or a request that could not connect to it, marks it down at once; only
   a later successful check brings it back. Engines that share one URL (DP ranks behind
   one API server) share one check and one state.
3. Down is not restarted. When an engine seen up before passes a check again, it stays
   down until a verdict: *restarted* (``on_restart``: the decision core forgets what it
   held, so no request is sent to pull from a cache that is gone) or a *flap*
   (``on_flap``: what it holds is kept). The witnesses (:class:`ProcessWitness`; the
   event feed's replay, the API server's start time) are asked once per engine, each
   bounded by the timeout, and the first rule that applies decides:

   a. a witness proved another process: restarted;
   b. a witness proved the same process: a flap;
   c. a connection to it was refused while it was down (nothing listened: the process
      was gone): restarted;
   d. ``restart_failures`` consecutive checks failed: restarted (down that long, a
      restart cannot be ruled out);
   e. otherwise a flap: a check or two missed under load proves nothing, and the index
      corrects itself anyway if it was wrong (a new process's event ``seq`` starts over).

   ``restart_failures = 1`` is the strict judgment: any return without proof of the same
   process is a restart. An engine never seen up is not "restarted".
4. Checks run concurrently, each bounded by the timeout, so one hung engine cannot delay
   the verdict on the others.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol, TypeVar

import aiohttp

from kvpeer.router.config import EngineEntry
from kvpeer.router.feed import Continuity

__all__ = ["EngineHealth", "Evidence", "HealthStatistics", "ProcessWitness", "judge"]

log = logging.getLogger(__name__)
T = TypeVar("T")


class Evidence(StrEnum):
    """What decided a returning engine's verdict (rule 3)."""

    WITNESS_NEW = "witness_new"  # 3a, restarted
    WITNESS_SAME = "witness_same"  # 3b, a flap
    REFUSED = "refused"  # 3c, restarted
    FAILURES = "failures"  # 3d, restarted
    NONE = "none"  # 3e, a flap


def judge(witnessed: Continuity, *, refused: bool, failures: int,
          restart_failures: int) -> Evidence:
    """Rule 3: the evidence that decides; a restart for NEW, REFUSED, FAILURES."""
    if witnessed is Continuity.NEW:
        return Evidence.WITNESS_NEW
    if witnessed is Continuity.SAME:
        return Evidence.WITNESS_SAME
    if refused:
        return Evidence.REFUSED
    if failures >= restart_failures:
        return Evidence.FAILURES
    return Evidence.NONE


RESTARTED = frozenset({Evidence.WITNESS_NEW, Evidence.REFUSED, Evidence.FAILURES})


@dataclass(frozen=True, slots=True)
class HealthStatistics:
    up: tuple[str, ...]
    down: tuple[str, ...]
    checks: int
    check_failures: int
    marked_down: int  # by requests that could not reach an engine
    restarts: int  # returns (per URL) where some engine was judged restarted
    flaps: int  # returns (per URL) where every engine was judged the same process
    #: per-engine verdicts by the evidence that decided them (rule 3), sorted
    verdicts: tuple[tuple[str, int], ...] = ()


class ProcessWitness(Protocol):
    """What can tell whether an engine that answers again is the process that went down."""

    async def came_up(self, name: str) -> None:
        """``name`` is up for the first time: remember which process it is."""

    def went_down(self, name: str) -> None:
        """``name`` just went down: remember where its process stood."""

    async def same_process(self, name: str) -> Continuity:
        """SAME or NEW only on proof; UNKNOWN otherwise. Remembers what it found."""


@dataclass(slots=True)
class _State:
    up: bool = False
    seen_up: bool = False
    reason: str = "not checked yet"
    failures: int = 0  # consecutive failed checks while down
    refused: bool = False  # a connection was refused while down
    said_unhealthy: bool = False  # its last check answered, with another status than 200


@dataclass(slots=True)
class _Counts:
    checks: int = 0
    failures: int = 0
    marked_down: int = 0
    restarts: int = 0
    flaps: int = 0
    verdicts: dict[Evidence, int] = field(default_factory=dict)


class EngineHealth:
    """The up/down state of every engine and the loop that keeps it current."""

    def __init__(
        self,
        engines: Sequence[EngineEntry],
        on_restart: Callable[[str], None],
        *,
        interval_s: float,
        timeout_s: float,
        restart_failures: int = 1,
        witnesses: Mapping[str, ProcessWitness] | None = None,
        on_flap: Callable[[str], None] | None = None,
    ) -> None:
        if restart_failures < 1:
            raise ValueError(f"restart_failures {restart_failures!r} must be at least 1")
        self._entries = tuple(engines)
        self._on_restart = on_restart
        self._witnesses = dict(witnesses or {})
        self._on_flap = on_flap
        self._timeout_s = timeout_s
        self._interval_s = interval_s
        self._restart_failures = restart_failures
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._urls: dict[str, list[str]] = {}
        for entry in self._entries:
            self._urls.setdefault(entry.spec.url, []).append(entry.name)
        self._states = {url: _State() for url in self._urls}
        self._url_of = {entry.name: entry.spec.url for entry in self._entries}
        self._changed = asyncio.Event()  # replaced (after set) at every change
        self._counts = _Counts()

    def healthy(self, name: str) -> bool:
        return self._states[self._url_of[name]].up

    def reachable(self, name: str) -> bool:
        """Down, but not known to be gone or unwell: seen up before, no connection to it
        refused since, and its last check did not answer with an error status (a check
        timed out or failed to connect otherwise, or it answered 200 and awaits a
        verdict). A last resort when no engine is healthy (rule 6 of
        :mod:`kvpeer.router.app`)."""
        state = self._states[self._url_of[name]]
        return not state.up and state.seen_up and not state.refused and not state.said_unhealthy

    def any_healthy(self) -> bool:
        return any(state.up for state in self._states.values())

    def mark_down(self, name: str, reason: str, *, refused: bool = False) -> None:
        """A request could not reach ``name``: stop routing to it until a check passes.
        ``refused``: the connection was refused (rule 3c)."""
        url = self._url_of[name]
        state = self._states[url]
        if state.up:
            self._counts.marked_down += 1
            log.warning("engine %s marked down: %s", name, reason)
            self._set(url, up=False, reason=reason)
        if refused and state.seen_up:
            state.refused = True

    def _set(self, url: str, *, up: bool, reason: str,
             verdicts: Mapping[str, Evidence] | None = None) -> None:
        """``verdicts``: per engine at ``url``, what decided its return (rule 3)."""
        state = self._states[url]
        was_up = state.up
        state.up, state.reason = up, reason
        names = self._urls[url]
        if up and not was_up:
            if state.seen_up:
                self._returned(url, verdicts or {})
            else:
                log.info("engine(s) %s up", ",".join(names))
            state.seen_up = True
            state.failures, state.refused = 0, False
        elif was_up and not up:
            log.warning("engine(s) %s down: %s", ",".join(names), reason)
            for witness in self._witnesses.values():
                for name in names:
                    witness.went_down(name)
        if up != was_up:
            changed, self._changed = self._changed, asyncio.Event()
            changed.set()

    def _returned(self, url: str, verdicts: Mapping[str, Evidence]) -> None:
        state = self._states[url]
        names = self._urls[url]
        counts = self._counts
        if any(verdicts.get(name, Evidence.FAILURES) in RESTARTED for name in names):
            counts.restarts += 1
        else:
            counts.flaps += 1
        for name in names:
            evidence = verdicts.get(name, Evidence.FAILURES)
            counts.verdicts[evidence] = counts.verdicts.get(evidence, 0) + 1
            if evidence in RESTARTED:
                log.warning("engine %s is back after %d failed check(s): restarted (%s)",
                            name, state.failures, evidence.value)
                self._on_restart(name)
            else:
                log.warning("engine %s is back after %d failed check(s): a flap (%s), what "
                            "it holds is kept", name, state.failures, evidence.value)
                if self._on_flap is not None:
                    self._on_flap(name)

    async def wait_for(self, predicate: Callable[[EngineHealth], bool], timeout: float) -> None:
        """Wait until ``predicate(self)`` holds (tests; raises TimeoutError)."""
        async with asyncio.timeout(timeout):
            while not predicate(self):
                await self._changed.wait()

    async def _check(self, session: aiohttp.ClientSession, url: str) -> None:
        self._counts.checks += 1
        refused = False
        answered = False
        try:
            async with session.get(f"{url}/health", timeout=self._timeout) as response:
                await response.read()
                ok, reason = response.status == 200, f"/health answered {response.status}"
                answered = True
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            ok, reason = False, f"/health failed: {type(exc).__name__}"
            refused = is_refused(exc)
        state = self._states[url]
        state.said_unhealthy = answered and not ok
        if not ok:
            self._counts.failures += 1
            if state.seen_up:
                state.failures += 1
                state.refused = state.refused or refused
            self._set(url, up=False, reason=reason)
            return
        if state.up:
            return
        if not state.seen_up:
            await self._identify(url)
            self._set(url, up=True, reason=reason)
            return
        self._set(url, up=True, reason=reason, verdicts=await self._verdicts(url))

    async def _identify(self, url: str) -> None:
        """Rule 3's witnesses learn which process answers at ``url`` for the first time."""
        calls = [witness.came_up(name) for witness in self._witnesses.values()
                 for name in self._urls[url]]
        for outcome in await asyncio.gather(*(self._bounded(c) for c in calls),
                                            return_exceptions=True):
            if isinstance(outcome, BaseException) and not isinstance(outcome, TimeoutError):
                log.error("engine(s) at %s: a witness failed on first contact",
                          url, exc_info=outcome)

    async def _verdicts(self, url: str) -> dict[str, Evidence]:
        """Rule 3 for every engine at ``url``: ask every witness, within the timeout."""
        state = self._states[url]
        names = self._urls[url]
        kinds = list(self._witnesses)
        asked = [(name, kind) for name in names for kind in kinds]
        outcomes = await asyncio.gather(
            *(self._bounded(self._witnesses[kind].same_process(name)) for name, kind in asked),
            return_exceptions=True,
        )
        found: dict[str, list[Continuity]] = {name: [] for name in names}
        for (name, kind), outcome in zip(asked, outcomes, strict=True):
            if isinstance(outcome, Continuity):
                found[name].append(outcome)
            elif isinstance(outcome, TimeoutError):
                log.warning("engine %s: witness %s gave no answer within %.1f s",
                            name, kind, self._timeout_s)
            else:
                log.error("engine %s: witness %s failed", name, kind, exc_info=outcome)
        return {name: judge(_combined(found[name]), refused=state.refused,
                            failures=state.failures, restart_failures=self._restart_failures)
                for name in names}

    async def _bounded(self, call: Awaitable[T]) -> T:
        async with asyncio.timeout(self._timeout_s):
            return await call

    async def check_once(self, session: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(self._check(session, url) for url in self._states))

    async def run(self, session: aiohttp.ClientSession) -> None:
        """Check every ``interval_s`` until cancelled (the first round is the caller's)."""
        while True:
            await asyncio.sleep(self._interval_s)
            await self.check_once(session)

    def statistics(self) -> HealthStatistics:
        up = tuple(e.name for e in self._entries if self.healthy(e.name))
        down = tuple(e.name for e in self._entries if not self.healthy(e.name))
        c = self._counts
        return HealthStatistics(
            up, down, c.checks, c.failures, c.marked_down, c.restarts, c.flaps,
            tuple(sorted((e.value, n) for e, n in c.verdicts.items())),
        )


def _combined(found: Sequence[Continuity]) -> Continuity:
    """One witness's proof of another process outweighs another's of the same one."""
    if Continuity.NEW in found:
        return Continuity.NEW
    if Continuity.SAME in found:
        return Continuity.SAME
    return Continuity.UNKNOWN


def is_refused(exc: BaseException) -> bool:
    """Whether ``exc`` (from connecting to an engine) says nothing listened there."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, ConnectionRefusedError):
            return True
        if isinstance(cause, aiohttp.ClientConnectorError):
            return isinstance(cause.os_error, ConnectionRefusedError)
        cause = cause.__cause__
    return False
