"""The health filter: which engines a request may use now, with the load each is planned with.

Rules:

1. An engine may serve a request while its health checks pass (:meth:`EngineHealth.healthy`)
   and the request has not failed on it yet (``exclude``: the engines its earlier
   attempts failed on); in PD mode only engines in a decode role serve. Any engine
   that passes may be named as a source or prefill engine (the planner checks its role).
2. The load each engine is planned with is this router's own (:mod:`kvpeer.router.load`),
   combined with what the engines report when load scraping is on
   (:meth:`EngineLoadFeed.combine`, at this router's mean prompt length), and with
   the share of peers' lookups its tier answered from held blocks
   (:mod:`kvpeer.router.heldshare`; 1.0 without scraping) and its tier's bound on a
   peer's wait for its engine (rule 6 of :mod:`kvpeer.router.engineload`; None without
   scraping or report).
3. With no engine to serve, the last resort (rule 6 of :mod:`kvpeer.router.app`):
   engines down but not known to be gone or unwell (:meth:`EngineHealth.reachable`),
   not excluded, in a serving role.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvpeer.router.config import RouterConfig
from kvpeer.router.engineload import EngineLoadFeed
from kvpeer.router.health import EngineHealth
from kvpeer.router.load import Loads
from kvpeer.router.loadonly import DECODE_ROLES
from kvpeer.router.policy import EngineLoad, Mode

__all__ = ["Candidates"]


class Candidates:
    """The engines a plan may use, by health and load."""

    def __init__(
        self,
        config: RouterConfig,
        health: EngineHealth,
        loads: Loads,
        engine_load: EngineLoadFeed | None = None,
    ) -> None:
        self._config = config
        self._health = health
        self._loads = loads
        self._engine_load = engine_load

    def loads(self, exclude: set[str]) -> dict[str, EngineLoad]:
        """Every engine's load, ``healthy`` if it may be used (rules 1 and 2)."""
        loads = {}
        for name, load in self._loads.items():
            in_flight, queued = load.in_flight, load.queued_prompt_tokens
            held, wait = 1.0, None
            if self._engine_load is not None:  # what other routers sent there too
                in_flight, queued = self._engine_load.combine(
                    name, in_flight, queued, self._loads.mean_prompt_tokens)
                held = self._engine_load.held_share.share(name)
                wait = self._engine_load.engine_wait_s(name)
            loads[name] = EngineLoad(
                healthy=name not in exclude and self._health.healthy(name),
                in_flight=in_flight,
                queued_prompt_tokens=queued,
                held_share=held,
                engine_wait_s=wait,
            )
        return loads

    def servers(self, loads: Mapping[str, EngineLoad]) -> list[str]:
        """The engines that may serve, in config order (rule 1)."""
        pd = self._config.mode is Mode.PD
        return [e.name for e in self._config.engines
                if loads[e.name].healthy and (not pd or e.spec.role in DECODE_ROLES)]  # fmt: skip

    def last_resort(self, exclude: set[str]) -> list[str]:
        """Engines down but not known to be gone, that may serve (rule 3)."""
        pd = self._config.mode is Mode.PD
        return [e.name for e in self._config.engines
                if e.name not in exclude and self._health.reachable(e.name)
                and (not pd or e.spec.role in DECODE_ROLES)]  # fmt: skip
