"""Answering the engine's lookups: staged blocks, the router's word, or a probe of the source.

A key is answered, in this order: HIT if it is pulled ahead (:mod:`kvpeer.node.ahead`)
for a request that may take staged blocks; MISS for a local request or a failed id;
HIT for a PD consumer (its prefiller will have every block); MISS if the source has
no live session; the router's word (``held_tokens``: HIT up to that position, MISS
past it) if the peer resolves fetches itself; else the session's probe (RETRY while
it waits for the peer's answer).

Invariants:

1. A key answered by the router's word is fetched with ``resolve``: a block the peer
   no longer holds fails the load, and the engine computes it (consumer invariant 1
   keeps it MISS).
2. The engine waits in a lookup (:meth:`Lookups.pull_confirmed`) only for a source
   that holds the blocks over a ready session and that :mod:`kvpeer.node.pullwaits`
   allows (the tier's invariant 7).
3. Time comes in as ``now`` and the engine's step as ``step``; nothing here reads a clock.
"""

from __future__ import annotations

from typing import Final

from kvpeer.node.ahead import PullAhead
from kvpeer.node.counters import TierCounters
from kvpeer.node.params import Source
from kvpeer.node.peertable import PeerTable
from kvpeer.node.pullwaits import PullWaits
from kvpeer.node.requests import OpenRequests
from kvpeer.node.trace import Trace
from kvpeer.types import Key, LookupResult, RequestContext

__all__ = ["Lookups"]

# Members the hot paths compare against, bound once: ``Enum.MEMBER`` goes through
# EnumType.__getattr__ on Python 3.11 (~0.2 us an access, millions per simulated world).
_HIT: Final = LookupResult.HIT
_MISS: Final = LookupResult.MISS
_RETRY: Final = LookupResult.RETRY


class Lookups:
    """The engine's lookups answered, and its waits for pulls remembered."""

    def __init__(
        self,
        peers: PeerTable,
        requests: OpenRequests,
        ahead: PullAhead,
        waits: PullWaits,
        counters: TierCounters,
        trace: Trace,
    ) -> None:
        self._peers = peers
        self._requests = requests
        self._ahead = ahead
        self._waits = waits
        self._counters = counters
        self._trace = trace

    def answer(self, key: Key, request: RequestContext, now: float, step: int) -> LookupResult:
        result = self._answer(key, request, now, step)
        self._counters.lookups[result.name] += 1
        return result

    def _answer(self, key: Key, request: RequestContext, now: float, step: int) -> LookupResult:
        source = self._requests.source(request.req_id)
        source_peer = source.peer_id if source is not None else None
        if (source is None or source.probe) and self._ahead.holds(key, source_peer):
            # pulled ahead (kvpeer.node.ahead): no peer to ask. Not for a PD consumer:
            # its producer parks its stores for one fetch of them all.
            self._ahead.found(request.req_id)
            return _HIT
        if source is None or self._requests.failed(source.kv_request_id):
            return _MISS
        if not source.probe:
            if self._trace.enabled:
                self._trace.lookup_hit(source.kv_request_id, source.peer_id, step)
            return _HIT  # PD: the prefiller will have every block
        peer = self._peers.get(source.peer_id)
        if peer is None or not peer.session.alive:
            return _MISS
        peer.last_used = now
        held = self._held_answer(key, request, source, peer.session.resolves_fetches, step)
        if held is not None:
            return held
        if self._trace.enabled:
            self._trace.lookup_asked(source.kv_request_id, source.peer_id, step)
        answer = peer.session.register_probe(source.kv_request_id, key, now)
        if answer is None:
            return _RETRY
        if answer and self._trace.enabled:
            self._trace.lookup_hit(source.kv_request_id, source.peer_id, step)
        return _HIT if answer else _MISS

    def _held_answer(
        self, key: Key, request: RequestContext, source: Source, resolves: bool, step: int
    ) -> LookupResult | None:
        """The router's word for ``key`` (``held_tokens``), if the peer can be asked to
        resolve the fetch itself (invariant 1); None: probe it."""
        if source.held_tokens is None or not resolves or request.key_position is None:
            return None
        position = request.key_position(key)
        if position is None:
            return None
        if position > source.held_tokens:
            return _MISS
        if self._trace.enabled:
            self._trace.lookup_hit(source.kv_request_id, source.peer_id, step)
        return _HIT

    def pull_confirmed(self, request: RequestContext, now: float) -> bool:
        """Whether ``request`` pulls blocks its source already holds, over a session that
        is ready, so a load is worth waiting for on the engine thread: confirmed by a
        probe or named by the router (symmetric), or a PD prefill the orchestrator saw
        answer (``prefill_done``); a PD consumer sent before that may wait for a prefill
        still being computed, and a session still shaking hands is slow by nature."""
        if self._ahead.confirmed(request.req_id):
            return True  # its keys are staged, or being fetched into staging now
        source = self._requests.source(request.req_id)
        if source is None or self._requests.failed(source.kv_request_id):
            return False
        peer = self._peers.get(source.peer_id)
        if peer is None or not peer.session.ready:
            return False
        if not self._waits.allowed(source.peer_id, now):
            return False  # it made the engine wait in vain: not waited for now
        return source.probe or source.prefill_done

    def promotion_waited(
        self, request: RequestContext, waited_s: float, done: bool, now: float, step: int
    ) -> None:
        """The engine waited ``waited_s`` in a lookup for a load it submitted at once;
        ``done``: it landed. What it means for later waits is
        :mod:`kvpeer.node.pullwaits`' (invariant 2)."""
        source = self._requests.source(request.req_id)
        if source is None:
            return
        self._counters.pull_waits["landed" if done else "missed"] += 1
        self._counters.pull_wait_seconds.observe(waited_s)
        if self._trace.enabled:
            self._trace.promotion(source.kv_request_id, source.peer_id, waited_s=waited_s,
                                  done=done, step=step)  # fmt: skip
        if done:
            self._waits.landed(source.peer_id)
        else:
            self._waits.missed(source.peer_id, now)
