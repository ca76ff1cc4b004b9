"""Which engines may receive requests: active health checks plus what requests observe.

Rules:

1. An engine is up only after a ``GET /health`` answered 200 within the timeout; every
   engine starts down until the first check round (run before the router listens).
2. A failed check, or a request that could not connect to it, marks it down at once; only
   a later successful check brings it back. Engines that share one URL (DP ranks behind
   one API server) share one check and one state.
3. Up -> down -> up is a restart unless the engine *proves* it is the process that went
   down (:meth:`ProcessWitness.same_process`, asked once per engine when its check
   passes again, bounded by the timeout; the edge's witness is the KV-event feed, which
   has the publisher replay the last batch it saw before the engine went down). A
   restart tells the decision core (``on_restart``) so it forgets what that engine held
   and no request is sent to pull from a cache that is gone; a proven flap keeps it
   (``on_flap``). The engine stays down until the verdict, so nothing is routed on an
   index that may be void. Anything short of proof -- no witness, no event feed, no
   replay endpoint, a timeout, an error -- is a restart. An engine never seen up is not
   "restarted".
4. Checks run concurrently, each bounded by the timeout, so one hung engine cannot delay
   the verdict on the others.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import aiohttp

from kvpeer.router.config import EngineEntry

__all__ = ["EngineHealth", "HealthStatistics", "ProcessWitness"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class HealthStatistics:
    up: tuple[str, ...]
    down: tuple[str, ...]
    checks: int
    check_failures: int
    marked_down: int  # by requests that could not reach an engine
    restarts: int  # returns (per URL) where some engine was not proven the same process
    flaps: int  # returns (per URL) where every engine was proven the same process


class ProcessWitness(Protocol):
    """What can prove that an engine that answers again is the process that went down."""

    def went_down(self, name: str) -> None:
        """``name`` just went down: remember where its process stood."""

    async def same_process(self, name: str) -> bool:
        """True only if ``name`` is proven the process that went down."""


@dataclass(slots=True)
class _State:
    up: bool = False
    seen_up: bool = False
    reason: str = "not checked yet"


class EngineHealth:
    """The up/down state of every engine and the loop that keeps it current."""

    def __init__(
        self,
        engines: Sequence[EngineEntry],
        on_restart: Callable[[str], None],
        *,
        interval_s: float,
        timeout_s: float,
        witness: ProcessWitness | None = None,
        on_flap: Callable[[str], None] | None = None,
    ) -> None:
        self._entries = tuple(engines)
        self._on_restart = on_restart
        self._witness = witness
        self._on_flap = on_flap
        self._timeout_s = timeout_s
        self._interval_s = interval_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._urls: dict[str, list[str]] = {}
        for entry in self._entries:
            self._urls.setdefault(entry.spec.url, []).append(entry.name)
        self._states = {url: _State() for url in self._urls}
        self._url_of = {entry.name: entry.spec.url for entry in self._entries}
        self._changed = asyncio.Event()  # replaced (after set) at every change
        self._checks = 0
        self._failures = 0
        self._marked_down = 0
        self._restarts = 0
        self._flaps = 0

    def healthy(self, name: str) -> bool:
        return self._states[self._url_of[name]].up

    def any_healthy(self) -> bool:
        return any(state.up for state in self._states.values())

    def mark_down(self, name: str, reason: str) -> None:
        """A request could not reach ``name``: stop routing to it until a check passes."""
        state = self._states[self._url_of[name]]
        if state.up:
            self._marked_down += 1
            log.warning("engine %s marked down: %s", name, reason)
            self._set(self._url_of[name], up=False, reason=reason)

    def _set(self, url: str, *, up: bool, reason: str,
             same: frozenset[str] = frozenset()) -> None:
        """``same``: the engines at ``url`` proven the process that went down (rule 3)."""
        state = self._states[url]
        was_up = state.up
        state.up, state.reason = up, reason
        names = self._urls[url]
        if up and not was_up:
            if state.seen_up:
                if same.issuperset(names):
                    self._flaps += 1
                else:
                    self._restarts += 1
                for name in names:
                    if name in same:
                        log.warning("engine %s is back, proven the same process: a flap, "
                                    "what it holds is kept", name)
                        if self._on_flap is not None:
                            self._on_flap(name)
                    else:
                        log.warning("engine %s is back: treating it as restarted", name)
                        self._on_restart(name)
            else:
                log.info("engine(s) %s up", ",".join(names))
            state.seen_up = True
        elif was_up and not up:
            log.warning("engine(s) %s down: %s", ",".join(names), reason)
            if self._witness is not None:
                for name in names:
                    self._witness.went_down(name)
        if up != was_up:
            changed, self._changed = self._changed, asyncio.Event()
            changed.set()

    async def wait_for(self, predicate: Callable[[EngineHealth], bool], timeout: float) -> None:
        """Wait until ``predicate(self)`` holds (tests; raises TimeoutError)."""
        async with asyncio.timeout(timeout):
            while not predicate(self):
                await self._changed.wait()

    async def _check(self, session: aiohttp.ClientSession, url: str) -> None:
        self._checks += 1
        try:
            async with session.get(f"{url}/health", timeout=self._timeout) as response:
                await response.read()
                ok, reason = response.status == 200, f"/health answered {response.status}"
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            ok, reason = False, f"/health failed: {type(exc).__name__}"
        if not ok:
            self._failures += 1
        state = self._states[url]
        same = await self._proven_same(url) if ok and not state.up and state.seen_up else None
        self._set(url, up=ok, reason=reason, same=same or frozenset())

    async def _proven_same(self, url: str) -> frozenset[str]:
        """The engines at ``url`` the witness proves unchanged, within the timeout."""
        if self._witness is None:
            return frozenset()
        names = self._urls[url]
        try:
            async with asyncio.timeout(self._timeout_s):
                verdicts = await asyncio.gather(
                    *(self._witness.same_process(name) for name in names)
                )
        except TimeoutError:
            log.warning("engine(s) %s: no proof of the same process within %.1f s",
                        ",".join(names), self._timeout_s)
            return frozenset()
        except Exception:
            log.exception("engine(s) %s: proving the same process failed", ",".join(names))
            return frozenset()
        return frozenset(name for name, same in zip(names, verdicts, strict=True)
                         if same is True)

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
        return HealthStatistics(
            up, down, self._checks, self._failures, self._marked_down, self._restarts,
            self._flaps,
        )
