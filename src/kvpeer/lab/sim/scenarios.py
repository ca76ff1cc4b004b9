"""The router of the simulation: which requests arrive, where, with which roles.

Each arrival is one scenario (weights in :data:`KINDS`):

- ``local``: a request without roles;
- ``pd``: a prefill leg (``remote_decoder``) on a producer and a decode leg
  (``remote_prefiller``) on a consumer, usually producer first, often decoder
  first, sometimes a decoder so late that the producer's stores were reaped,
  sometimes only one of the two legs;
- ``sym``: a consumer probing a peer (``remote_kv_source``) that holds the
  prompt's prefix (warm) or may not (cold); toward a warm peer, every other id
  carries the router's ``held_tokens`` (how much of the prompt the peer held
  when the request was planned), so the consumer fetches without probing and
  the peer resolves the fetch itself (protocol 1.2). A key holds one token;
- ``pull``: a PD pair whose prefill leg also pulls from a third node.

Now and then a consumer leg gets a twin (same node, same id: parallel
sampling), an id is reused once every request that used it has finished, or
a source names a node that does not exist. Every request is split into
stages (a prompt growing, chunked prefill) and may finish early.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpeer.lab.sim.node import SimNode, SimRequest
from kvpeer.lab.sim.prompts import PromptBook
from kvpeer.lab.sim.timeouts import PORT
from kvpeer.types import Key, RequestContext

__all__ = ["GHOST_PEER", "KINDS", "Planned", "Router"]

KINDS = {"local": 1, "pd": 4, "sym": 4, "pull": 1}
GHOST_HOST = "n99"  # nobody runs there: handshakes toward it time out
GHOST_PEER = f"{GHOST_HOST}:{PORT}"

Params = dict[str, object]


@dataclass(frozen=True, slots=True)
class Planned:
    tick: int
    node: SimNode
    request: SimRequest


@dataclass(slots=True)
class _KvId:
    name: str
    requests: list[SimRequest] = field(default_factory=list)

    def retired(self) -> bool:
        return all(request.done for request in self.requests)


class Router:
    """Turns arrivals into planned requests; ``random`` is the world's."""

    def __init__(self, rng: random.Random, nodes: list[SimNode], prompts: PromptBook) -> None:
        self._rng = rng
        self._nodes = nodes
        self._prompts = prompts
        self._count = 0
        self._ids: list[_KvId] = []
        self._used: list[_KvId] = []  # ids the scenario being built uses

    def spawn(self, tick: int) -> list[Planned]:
        rng = self._rng
        live = [node for node in self._nodes if node.live is not None]
        if not live:
            return []
        prompt = self._prompts.next_prompt()
        consumer = rng.choice(live)
        kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        producers = [node for node in live if node is not consumer]
        plans: list[Planned] = []
        self._used = []

        def plan(when: int, node: SimNode, tag: str, params: Params | None) -> None:
            plans.append(Planned(when, node, self._request(when, tag, prompt, params)))

        if kind == "local" or (kind in ("pd", "pull") and not producers):
            plan(tick, consumer, "loc", None)
        elif kind == "sym":
            params: Params = {"remote_kv_source": self._source(self._kv_id(), prompt, consumer)}
            plan(tick, consumer, "sym", params)
            if rng.random() < 0.05:
                plan(tick + rng.randint(0, 2), consumer, "twin", params)
        else:
            producer = rng.choice(producers)
            kv_id = self._kv_id()
            produce: Params = {"remote_decoder": {"kv_request_id": kv_id}}
            if kind == "pull":
                produce["remote_kv_source"] = self._source(self._kv_id(), prompt, producer)
            consume: Params = {"remote_prefiller": _role(kv_id, producer)}
            roll = rng.random()
            if roll < 0.05:  # nobody fetches: parked stores expire, the id is tombstoned
                plan(tick, producer, "pro", produce)
            elif roll < 0.1:  # the prefill never happens: the consumer's load times out
                plan(tick, consumer, "con", consume)
            elif roll < 0.2:  # the decoder comes late: its fetch may hit a tombstone
                plan(tick, producer, "pro", produce)
                plan(tick + rng.randint(10, 40), consumer, "con", consume)
            elif roll < 0.45:  # decoder first: its fetch waits for the producer's stores
                plan(tick, consumer, "con", consume)
                plan(tick + rng.randint(1, 4), producer, "pro", produce)
            else:
                plan(tick, producer, "pro", produce)
                plan(tick + rng.randint(0, 3), consumer, "con", consume)
            if rng.random() < 0.03:
                plan(tick + rng.randint(0, 3), consumer, "twin", consume)
        for kv in self._used:
            kv.requests.extend(planned.request for planned in plans)
        return plans

    # -- pieces ------------------------------------------------------------------------

    def _source(self, kv_id: str, prompt: tuple[Key, ...], consumer: SimNode) -> Params:
        """A role toward a warm node (holds the prompt's first block) most of the
        time, else toward any other node, rarely toward one that does not exist."""
        rng = self._rng
        if rng.random() < 0.02:
            return _role_at(kv_id, GHOST_HOST)
        others = [node for node in self._nodes if node is not consumer]
        warm = [
            node
            for node in others
            if node.live is not None and node.live.pool.slot_of(prompt[0]) is not None
        ]
        if warm and rng.random() < 0.7:
            peer = rng.choice(warm)
            role = _role(kv_id, peer)
            if int(kv_id.removeprefix("kv")) % 2 == 0 and peer.live is not None:
                pool = peer.live.pool
                role["held_tokens"] = next(
                    (i for i, k in enumerate(prompt) if pool.slot_of(k) is None), len(prompt)
                )
            return role
        return _role(kv_id, rng.choice(others))

    def _kv_id(self) -> str:
        """A fresh id, or now and then one whose requests have all finished."""
        rng = self._rng
        if self._ids and rng.random() < 0.03:
            retired = [kv for kv in self._ids[-30:] if kv.retired()]
            if retired:
                reused = rng.choice(retired)
                reused.requests.clear()
                self._used.append(reused)
                return reused.name
        self._count += 1
        kv = _KvId(f"kv{self._count}")
        self._ids.append(kv)
        if len(self._ids) > 60:
            del self._ids[:30]
        self._used.append(kv)
        return kv.name

    def _request(
        self, tick: int, tag: str, prompt: tuple[Key, ...], params: Params | None
    ) -> SimRequest:
        rng = self._rng
        self._count += 1
        req_id = f"{tag}{self._count}"
        stages = min(len(prompt), rng.choice((1, 1, 2, 3)))
        cuts = (*sorted(rng.sample(range(1, len(prompt)), stages - 1)), len(prompt))
        return SimRequest(
            req_id=req_id,
            ctx=RequestContext(req_id, params, key_position=_positions(prompt)),
            keys=prompt,
            cuts=cuts,
            linger=rng.randint(0, 4),
            finish_tick=tick + rng.randint(0, 6) if rng.random() < 0.1 else None,
        )


def _positions(prompt: tuple[Key, ...]) -> Callable[[Key], int | None]:
    """Each key's end token, as vLLM reports it: a key is one token here."""
    return {key: i + 1 for i, key in enumerate(prompt)}.get


def _role(kv_id: str, peer: SimNode) -> Params:
    return _role_at(kv_id, peer.name)


def _role_at(kv_id: str, host: str) -> Params:
    return {"kv_request_id": kv_id, "remote_host": host, "remote_port": PORT}
