"""Pulling ahead in the simulation: a router's prefetches into staging rows, watched.

Half of the worlds (drawn from a generator of their own, as held blocks are, so a
world without pulling ahead is the very world it was before it was modelled) give
some of their nodes staging rows (:class:`AheadProfile`: one to eight rows withheld
from the node's pool, and a time to live) and let a router endpoint of the network
(:data:`ROUTER`) send them prefetches: when a request that pulls from a peer
(``remote_kv_source``) starts on such a node, now and then a prefetch of its prompt
(or a cut of it) naming that peer goes out first. Other prefetches name a node that
is down or the node itself, carry tokens nobody can hash, or arrive twice. (Which
senders a node obeys is an address check the simulated transport cannot make:
tests/node/test_ahead_rows.py and tests/net/test_ahead.py cover it.)

A token here is an index into the world's :class:`TokenBook` (one block each): the
node's ``keys_of`` maps it back to the block's key, as a vLLM engine's hash maps a
prompt's tokens to its keys.

What is checked (with :mod:`kvpeer.lab.sim.checks`):

1. every staging row is free or in exactly one entry, and the set of rows never
   shrinks or grows (``kvpeer.node.ahead`` invariants 1 and 7);
2. every staged row holds exactly its key's bytes, at every full check (a fetch
   that wrote a row after it was given back, or a stale write, shows here);
3. a load served from staging brings its keys' bytes (the probe's own check of
   every load);
4. after the quiet phase nothing is staged or being fetched, and every row is free.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import asdict, astuple, dataclass

from kvpeer.config import AllowList
from kvpeer.lab.sim.sim_network import SimNetwork
from kvpeer.node.ahead import PullAhead
from kvpeer.protocol import Codec, Prefetch
from kvpeer.types import Key

__all__ = ["ROUTER", "AheadCounts", "AheadProfile", "PrefetchSource", "TokenBook", "draw_ahead"]

AHEAD_WORLDS = 0.5  # share of the worlds whose nodes pull ahead
ROUTER = "router:9000"  # the prefetching router's endpoint on the simulated network
TTLS = (0.5, 2.0, 8.0)  # prefetch_ttl_s: expiring before use, during, or long after
PREFETCH_P = 0.6  # a pulling request that starts on a staging node is prefetched first
LATER_P = 0.7  # ...and reaches its engine a tick after its prefetch, not in the same one
ALLOWED = AllowList.from_entries(["10.0.0.0/8"])  # the sim's transport names no address


@dataclass(frozen=True, slots=True)
class AheadProfile:
    rows: int
    ttl_s: float


def draw_ahead(
    seed: int, peer_ids: Sequence[str], *, always: bool = False
) -> dict[str, AheadProfile]:
    """Which nodes of world ``seed`` pull ahead: peer id -> profile (empty for half of
    the worlds unless ``always``), from a generator of its own."""
    rng = random.Random(f"ahead {seed}")
    if rng.random() >= AHEAD_WORLDS and not always:
        return {}
    chosen = rng.sample(list(peer_ids), rng.randint(1, len(peer_ids)))
    return {p: AheadProfile(rng.randint(1, 8), rng.choice(TTLS)) for p in chosen}


@dataclass(frozen=True, slots=True)
class AheadCounts:
    """What pulling ahead did in one world (every incarnation's tier counters)."""

    nodes: int = 0
    sent: int = 0  # prefetches the router sent
    refused: int = 0  # refusals it read back
    staged: int = 0  # blocks fetched into staging
    used: int = 0  # staged blocks a load of the engine took
    expired: int = 0
    evicted: int = 0
    failed: int = 0  # fetches into staging that failed

    @classmethod
    def of(cls, counters: Mapping[str, int]) -> AheadCounts:
        return cls(staged=counters.get("blocks_staged", 0), used=counters.get("blocks_used", 0),
                   expired=counters.get("blocks_expired", 0),
                   evicted=counters.get("blocks_evicted", 0),
                   failed=counters.get("fetches_failed", 0))  # fmt: skip

    def __add__(self, other: AheadCounts) -> AheadCounts:
        return AheadCounts(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def summary(self) -> str:
        return " ".join(f"{name}={value}" for name, value in asdict(self).items())


class TokenBook:
    """Block keys as tokens: the index of each key the router has named."""

    def __init__(self) -> None:
        self._keys: list[Key] = []
        self._tokens: dict[Key, int] = {}

    def tokens(self, keys: Sequence[Key]) -> tuple[int, ...]:
        out = []
        for key in keys:
            token = self._tokens.get(key)
            if token is None:
                token = self._tokens[key] = len(self._keys)
                self._keys.append(key)
            out.append(token)
        return tuple(out)

    def keys_of(self, tokens: Sequence[int], max_keys: int) -> list[Key]:
        """What a node's hash makes of ``tokens`` (the first ``max_keys``); a token
        never named fails it."""
        tokens = tokens[:max_keys]
        known = len(self._keys)
        bad = next((t for t in tokens if not 0 <= t < known), None)
        if bad is not None:
            raise ValueError(f"token {bad} is no block of this world")
        return [self._keys[t] for t in tokens]


class PrefetchSource:
    """The router endpoint: sends prefetches, reads (and counts) refusals."""

    def __init__(self, net: SimNetwork, seed: int, book: TokenBook) -> None:
        self._net = net
        self._control = net.attach(ROUTER)
        self._rng = random.Random(f"prefetch {seed}")
        self._book = book
        self._codec = Codec()
        self.sent = 0
        self.refused = 0

    def request_due(
        self, node_peer_id: str, profile: AheadProfile | None, params: object,
        keys: Sequence[Key], peers: Sequence[str],
    ) -> bool:  # fmt: skip
        """A request pulling per ``params`` is due on ``node_peer_id``: maybe prefetch it.
        True: the request should reach its engine a tick later (it travels while the
        prefetch is taken in, as it does behind a real router); otherwise it starts now
        and races its prefetch, which it usually wins (the prefetch is then refused)."""
        rng = self._rng
        if profile is None or not isinstance(params, dict) or rng.random() >= PREFETCH_P:
            return False
        role = params.get("remote_kv_source")
        if not isinstance(role, dict):
            return False
        source = f"{role.get('remote_host')}:{role.get('remote_port')}"
        cut = rng.randint(1, len(keys)) if rng.random() < 0.3 else len(keys)
        tokens = self._book.tokens(keys[:cut])
        roll = rng.random()
        if roll < 0.05:
            source = node_peer_id  # itself: refused
        elif roll < 0.1:
            source = rng.choice(list(peers))  # a node that may not hold it, or be down
        elif roll < 0.13:
            tokens = (*tokens, 10**9)  # a token nobody can hash: refused
        self._send(node_peer_id, Prefetch(kv_request_id=str(role.get("kv_request_id")),
                                          source=source, tokens=tokens))  # fmt: skip
        if rng.random() < 0.05:  # the router retried: the second finds it staged
            self._send(node_peer_id, Prefetch(kv_request_id="again", source=source,
                                              tokens=tokens))  # fmt: skip
        return rng.random() < LATER_P

    def _send(self, to: str, message: Prefetch) -> None:
        if self._net.is_up(to):
            self._control.connect(to).transmit(self._codec.encode(message))
            self.sent += 1

    def drain(self) -> None:
        """Read what nodes answered (refusals); never answers anything."""
        self.refused += len(self._control.receive())


def staged_bytes_problems(ahead: PullAhead, content: object, pool_view: memoryview,
                          block_len: int) -> list[str]:  # fmt: skip
    """Check 2: each staged row against its key's bytes (``content(key)``)."""
    assert callable(content)
    problems = []
    for key, row in ahead.staged():
        start = row * block_len
        if pool_view[start : start + block_len] != content(key):
            problems.append(f"staging row {row} (key {key.hex()[:12]}) does not hold its bytes")
    return problems
