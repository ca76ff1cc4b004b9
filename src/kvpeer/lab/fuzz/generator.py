"""A seeded generator of hostile control frames for a live node.

:class:`FrameGenerator` yields :class:`Case` values: the multipart message one of
the fuzzer's identities sends, with a ``"kind/mutation"`` label. Cases come in
scenarios, each a short sequence from one identity:

- ``handshake``: a ``connect`` (valid, or with hostile data-plane offers), maybe
  repeated, a ``connect_ack`` (valid or hostile), then rounds of lookups, fetches,
  aborts and unsolicited answers, valid or mutated, maybe a ``disconnect``;
- ``out-of-order``: any message type, valid or mutated, without a handshake first;
- ``connect``: a lone ``connect``, mutated or with hostile offers;
- ``raw``: bytes that are not a message map (random, cut short, bit-flipped,
  non-map payloads, deep nesting);
- ``parts``: multipart messages with the wrong number of parts;
- ``odd-identity``: frames from identities that are not ``host:port`` or not UTF-8.

The generator is pure: ``random.Random(seed)`` and the :class:`Target`'s values are
its only inputs, so one seed always gives the same cases.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Final

from kvpeer.lab.fuzz import wire
from kvpeer.lab.fuzz.cases import Case, Target
from kvpeer.lab.fuzz.hostile import HOSTILE_ACKS, HOSTILE_CONNECTS
from kvpeer.lab.fuzz.mutations import UNKNOWN_TYPES, Bulk, Payload, mutate
from kvpeer.node.synthetic import synthetic_key
from kvpeer.protocol import PROTOCOL_VERSION
from kvpeer.protocol import limits as L

__all__ = ["MESSAGE_TYPES", "SCENARIOS", "Case", "FrameGenerator", "Target"]

#: The protocol's message types, plus what the generator sends as unknown types.
MESSAGE_TYPES: Final = (
    "connect",
    "connect_ack",
    "disconnect",
    "lookup",
    "lookup_resp",
    "fetch",
    "transfer_done",
    "abort_fetch",
    "abort_ack",
    "ping",
    "pong",
    "unknown",
)

SCENARIOS: Final[tuple[tuple[str, float], ...]] = (
    ("handshake", 40.0),
    ("out-of-order", 24.0),
    ("connect", 14.0),
    ("raw", 12.0),
    ("parts", 4.0),
    ("odd-identity", 6.0),
)


@dataclass(slots=True)
class _Sequence:
    """The state of one scenario: whose it is, its rounds, its request ids."""

    identity: int
    peer_id: str
    number: int
    round_seq: int = 0
    cases: list[Case] = field(default_factory=list)


class FrameGenerator:
    """Yields hostile cases for ``target``; the same ``seed`` gives the same cases."""

    def __init__(self, target: Target, seed: int, *, exclude: Sequence[str] = ()) -> None:
        """``exclude``: label prefixes (or scenario names) never to send (e.g. what
        triggers a crash already known)."""
        self.target = target
        self.seed = seed
        self.exclude = tuple(exclude)
        self._rng = random.Random(seed)
        self._bulk = Bulk(random.Random(seed ^ 0x5EED))
        self._sequences = 0
        self._keys = [synthetic_key(i) for i in range(min(target.synthetic_blocks, L.MAX_ITEMS))]
        self._scenario_names = [name for name, _ in SCENARIOS]
        self._scenario_weights = [weight for _, weight in SCENARIOS]
        self._scenarios: dict[str, Callable[[_Sequence], None]] = {
            "handshake": self._handshake,
            "out-of-order": self._out_of_order,
            "connect": self._lone_connect,
            "raw": self._raw,
            "parts": self._parts,
            "odd-identity": self._odd_identity,
        }

    @property
    def rng(self) -> random.Random:
        return self._rng

    def __iter__(self) -> Iterator[Case]:
        while True:
            yield from self.scenario()

    def take(self, count: int) -> list[Case]:
        """The next ``count`` cases."""
        cases: list[Case] = []
        while len(cases) < count:
            cases.extend(self.scenario())
        return cases[:count]

    def scenario(self, name: str | None = None) -> list[Case]:
        """The cases of one scenario (``name``, or one picked by weight)."""
        rng = self._rng
        if name is None:
            (name,) = rng.choices(self._scenario_names, self._scenario_weights)
        target = self.target
        if name == "odd-identity" and target.odd_identities:
            identity = len(target.identities) + rng.randrange(len(target.odd_identities))
            peer_id = "odd"
        else:
            if rng.random() < 0.8 and target.listening:
                identity = rng.randrange(target.listening)
            else:
                identity = rng.randrange(len(target.identities))
            peer_id = target.identities[identity]
        self._sequences += 1
        sequence = _Sequence(identity, peer_id, self._sequences)
        self._scenarios[name](sequence)
        return [
            Case(c.label, name, c.identity, c.parts, c.sequence)
            for c in sequence.cases
            if not c.label.startswith(self.exclude) and name not in self.exclude
        ]

    # -- scenarios -------------------------------------------------------------------------

    def _handshake(self, seq: _Sequence) -> None:
        rng = self._rng
        hello_label, hello = self._connect(seq, hostile=rng.random() < 0.3)
        self._add(seq, hello_label, hello)
        if rng.random() < 0.05:
            self._add(seq, "connect/repeat", hello)
        if rng.random() < 0.9:
            self._add(seq, *self._ack(seq, hostile=rng.random() < 0.3))
        for _ in range(rng.choice((0, 1, 2, 3, 4, 6, 8))):
            self._add(seq, *self._round_frame(seq))
        if rng.random() < 0.3:
            self._add(seq, *self._message(seq, "disconnect", mutated=rng.random() < 0.3))

    def _out_of_order(self, seq: _Sequence) -> None:
        rng = self._rng
        for _ in range(rng.choice((1, 1, 2, 3))):
            kind = rng.choice(MESSAGE_TYPES)
            if kind == "connect_ack" and rng.random() < 0.5:
                self._add(seq, *self._ack(seq, hostile=rng.random() < 0.5))
            else:
                self._add(seq, *self._message(seq, kind, mutated=rng.random() < 0.6))

    def _lone_connect(self, seq: _Sequence) -> None:
        rng = self._rng
        if rng.random() < 0.5:
            label, frame = self._connect(seq, hostile=True)
        else:
            mutation, frame = mutate("connect", self._payload(seq, "connect"), rng, self._bulk)
            label = f"connect/{mutation}"
        self._add(seq, label, frame)

    def _raw(self, seq: _Sequence) -> None:
        rng = self._rng
        choice = rng.randrange(9)
        if choice == 0:
            self._add(seq, "raw/random-bytes", rng.randbytes(rng.choice((1, 7, 64, 1000))))
        elif choice in (1, 2):
            kind = rng.choice(MESSAGE_TYPES[:-1])
            _, frame = self._valid(seq, kind)
            self._add(seq, f"raw/truncated:{kind}", wire.truncate(frame, rng))
        elif choice in (3, 4):
            kind = rng.choice(MESSAGE_TYPES[:-1])
            _, frame = self._valid(seq, kind)
            flips = rng.choice((1, 1, 2, 8))
            self._add(seq, f"raw/bitflip:{kind}", wire.bitflip(frame, rng, flips))
        elif choice == 5:
            name, value = rng.choice(_NON_MAPS)
            self._add(seq, f"raw/non-map:{name}", wire.encode(value))
        elif choice == 6:
            depth = rng.choice((100, 1000, 100_000))
            as_map = rng.random() < 0.5
            label = f"raw/deep-{'map' if as_map else 'array'}:{depth}"
            self._add(seq, label, wire.deep_nesting(depth, as_map=as_map))
        elif choice == 7:
            self._add(seq, "raw/empty", b"")
        elif rng.random() < 0.002:  # past the frame limit the codec checks (not ZMQ's)
            self._add(seq, "raw/over-frame-limit", bytes(L.MAX_FRAME_BYTES + 1))
        else:
            size = 1 << 20 if rng.random() < 0.05 else rng.choice((4096, 65_536))
            self._add(seq, "raw/large-random", rng.randbytes(size))

    def _parts(self, seq: _Sequence) -> None:
        rng = self._rng
        _, frame = self._valid(seq, rng.choice(("connect", "lookup", "disconnect")))
        choice = rng.randrange(4)
        if choice == 0:
            parts: tuple[bytes, ...] = (frame, frame)
            label = "parts/two"
        elif choice == 1:
            parts, label = (b"", frame), "parts/empty-first"
        elif choice == 2:
            parts, label = (frame, b"x", b"y"), "parts/three"
        else:
            parts, label = tuple(b"p" for _ in range(rng.choice((5, 64)))), "parts/many"
        seq.cases.append(Case(label, "", seq.identity, parts, seq.number))

    def _odd_identity(self, seq: _Sequence) -> None:
        rng = self._rng
        seq.peer_id = f"127.0.0.1:{rng.randrange(1, 65536)}"
        if rng.random() < 0.6:
            _, frame = self._connect(seq, hostile=False)
            self._add(seq, "connect/odd-identity", frame)
            if rng.random() < 0.5:
                self._add(seq, *self._ack(seq, hostile=False))
        else:
            kind = rng.choice(MESSAGE_TYPES)
            label, frame = self._message(seq, kind, mutated=rng.random() < 0.5)
            self._add(seq, f"{label}+odd-identity", frame)

    # -- messages ----------------------------------------------------------------------------

    def _add(self, seq: _Sequence, label: str, frame: bytes) -> None:
        seq.cases.append(Case(label, "", seq.identity, (frame,), seq.number))

    def _message(self, seq: _Sequence, kind: str, *, mutated: bool) -> tuple[str, bytes]:
        """A ``kind`` message of this sequence, valid or with one thing broken."""
        if kind == "unknown":
            payload: Payload = {"type": self._rng.choice(UNKNOWN_TYPES), "payload": [1, 2]}
            return "unknown/valid", wire.encode(payload)
        payload = self._payload(seq, kind)
        if mutated:
            label, frame = mutate(kind, payload, self._rng, self._bulk)
            return f"{kind}/{label}", frame
        return f"{kind}/valid", wire.encode(payload)

    def _valid(self, seq: _Sequence, kind: str) -> tuple[str, bytes]:
        return self._message(seq, kind, mutated=False)

    def _payload(self, seq: _Sequence, kind: str) -> Payload:
        rng = self._rng
        match kind:
            case "connect":
                return self.hello(seq.peer_id, self.good_transports())
            case "connect_ack":
                return {"type": kind, "peer_id": seq.peer_id, **self._ack_extension("tcp")}
            case "disconnect":
                return {"type": kind, "reason": rng.choice(("bye", "", "fuzzing"))}
            case "lookup":
                return {
                    "type": kind,
                    "kv_request_id": self._request_id(seq),
                    "keys": self._some_keys(),
                    "round_seq": self._next_round(seq),
                }
            case "lookup_resp":
                keys = self._some_keys()
                return {
                    "type": kind,
                    "kv_request_id": self._request_id(seq),
                    "keys": keys,
                    "hits": [rng.random() < 0.5 for _ in keys],
                    "round_seq": seq.round_seq,
                }
            case "fetch":
                keys = self._some_keys()
                fetch: Payload = {
                    "type": kind,
                    "kv_request_id": self._request_id(seq),
                    "keys": keys,
                    "block_indexes": rng.sample(range(self.target.our_blocks), len(keys)),
                    "round_seq": seq.round_seq,
                }
                extension = rng.random()
                if extension < 0.25:
                    fetch["prefill_done"] = True  # kvpeer 1.1 (PD: the leg answered)
                elif extension < 0.5:
                    fetch["resolve"] = True  # kvpeer 1.2 (the producer looks keys up)
                return fetch
            case "transfer_done":
                return {
                    "type": kind,
                    "kv_request_id": self._request_id(seq),
                    "success": rng.random() < 0.5,
                    "round_seq": seq.round_seq,
                    "blocks": rng.randrange(8),
                    "reason": "",
                }
            case "abort_fetch" | "abort_ack":
                return {
                    "type": kind,
                    "kv_request_id": self._request_id(seq),
                    "round_seq": seq.round_seq,
                }
            case "ping" | "pong":
                return {"type": kind}  # kvpeer 1.1: no fields
        raise ValueError(f"no payload for {kind!r}")

    def _request_id(self, seq: _Sequence) -> str:
        return f"fz-{seq.number % 997}-{self._rng.randrange(3)}"

    def _next_round(self, seq: _Sequence) -> int:
        seq.round_seq += 1
        return seq.round_seq

    def _some_keys(self) -> list[bytes]:
        rng = self._rng
        count = min(rng.choice((1, 2, 4, 8, 16)), len(self._keys), self.target.our_blocks)
        keys = rng.sample(self._keys, count)
        if rng.random() < 0.2:  # a key the node does not hold
            keys[rng.randrange(count)] = rng.randbytes(36)
        return keys

    # -- handshake messages ---------------------------------------------------------------

    def hello(self, peer_id: str, transports: dict[str, object] | None) -> Payload:
        target = self.target
        payload: Payload = {
            "type": "connect",
            "peer_id": peer_id,
            "agent_metadata": b"",
            "base_addr": 0,
            "num_blocks": target.our_blocks,
            "block_len": target.block_len,
            "hash_seed": target.hash_seed,
            "config_fingerprint": "",
        }
        if transports is not None:
            payload["kvpeer"] = {
                "version": list(PROTOCOL_VERSION),
                "boot_id": self._rng.randbytes(L.BOOT_ID_BYTES),
                "transports": transports,
            }
        return payload

    def good_transports(self) -> dict[str, object]:
        target, rng = self.target, self._rng
        offers: dict[str, object] = {}
        if target.shm_files and target.host_id and rng.random() < 0.5:
            offers["shm"] = self.shm_offer(rng.choice(target.shm_files))
        if target.tcp_sinks and (not offers or rng.random() < 0.5):
            host, port = rng.choice(target.tcp_sinks)
            offers["tcp"] = {"host": host, "port": port}
        if not offers:
            offers["tcp"] = {"host": "127.0.0.1", "port": target.dead_port}
        return offers

    def shm_offer(self, path: str) -> dict[str, object]:
        target = self.target
        return {
            "path": path,
            "host_id": target.host_id,
            "size": target.our_blocks * target.block_len,
        }

    def _connect(self, seq: _Sequence, *, hostile: bool) -> tuple[str, bytes]:
        """A connect with a fresh boot id: valid offers, or hostile ones (label says which)."""
        rng = self._rng
        if not hostile:
            offers = self.good_transports()
            payload = self.hello(seq.peer_id, offers)
            return f"connect/valid:{'+'.join(sorted(offers))}", wire.encode(payload)
        name, make = rng.choice(HOSTILE_CONNECTS)
        return f"connect/{name}", make(self, seq.peer_id)

    def _ack_extension(self, plane: str | None, params: object = None) -> Payload:
        if plane is None:
            return {}
        if params is None:
            params = {"token": self._rng.randbytes(16).hex()} if plane == "tcp" else {}
        return {
            "kvpeer": {
                "version": list(PROTOCOL_VERSION),
                "transport": {"name": plane, "params": params},
            }
        }

    def _ack(self, seq: _Sequence, *, hostile: bool) -> tuple[str, bytes]:
        rng = self._rng
        base: Payload = {"type": "connect_ack", "peer_id": seq.peer_id}
        if not hostile:
            plane = rng.choice(("tcp", "tcp", "shm", "nixl", None))
            return f"connect_ack/valid:{plane or 'base'}", wire.encode(
                {**base, **self._ack_extension(plane)}
            )
        if rng.random() < 0.3:
            label, frame = mutate(
                "connect_ack", {**base, **self._ack_extension("tcp")}, rng, self._bulk
            )
            return f"connect_ack/{label}", frame
        name, extension = rng.choice(HOSTILE_ACKS)
        if callable(extension):
            extension = extension(rng)
        return f"connect_ack/{name}", wire.encode({**base, "kvpeer": extension})

    def _round_frame(self, seq: _Sequence) -> tuple[str, bytes]:
        """One frame after the handshake: a protocol step, valid or hostile."""
        rng = self._rng
        (step,) = rng.choices(_ROUND_STEPS, _ROUND_WEIGHTS)
        target = self.target
        if step == "lookup-then-fetch":
            lookup = self._payload(seq, "lookup")
            keys = lookup["keys"]
            assert isinstance(keys, list)
            fetch = {
                "type": "fetch",
                "kv_request_id": lookup["kv_request_id"],
                "keys": keys,
                "block_indexes": rng.sample(range(target.our_blocks), len(keys)),
                "round_seq": lookup["round_seq"],
            }
            seq.cases.append(
                Case("lookup/valid", "", seq.identity, (wire.encode(lookup),), seq.number)
            )
            return "fetch/valid:after-lookup", wire.encode(fetch)
        if step == "fetch-out-of-range":
            fetch = self._payload(seq, "fetch")
            indexes = fetch["block_indexes"]
            assert isinstance(indexes, list)
            indexes[rng.randrange(len(indexes))] = rng.choice(
                (target.our_blocks, target.our_blocks + 1, 2**31, 2**63 - 1)
            )
            return "fetch/index-out-of-range", wire.encode(fetch)
        if step == "fetch-duplicate-keys":
            fetch = self._payload(seq, "fetch")
            keys = fetch["keys"]
            assert isinstance(keys, list)
            fetch["keys"] = [keys[0], *keys]
            fetch["block_indexes"] = rng.sample(range(target.our_blocks), len(keys) + 1)
            return "fetch/duplicate-keys", wire.encode(fetch)
        if step == "fetch-duplicate-indexes":
            fetch = self._payload(seq, "fetch")
            indexes = fetch["block_indexes"]
            assert isinstance(indexes, list)
            fetch["block_indexes"] = [indexes[0]] * len(indexes)
            return "fetch/duplicate-indexes", wire.encode(fetch)
        if step == "fetch-twice":
            frame = wire.encode(self._payload(seq, "fetch"))
            seq.cases.append(Case("fetch/valid", "", seq.identity, (frame,), seq.number))
            return "fetch/second-for-round", frame
        if step == "fetch-terminal":
            fetch = self._payload(seq, "fetch")
            fetch["keys"], fetch["block_indexes"] = [], []
            return "fetch/valid:terminal", wire.encode(fetch)
        if step == "lookup-huge":
            lookup = self._payload(seq, "lookup")
            lookup["keys"] = self._bulk.get("keys-at")
            return "lookup/at-limit:keys", wire.encode(lookup)
        if step == "round-backwards":
            lookup = self._payload(seq, "lookup")
            lookup["round_seq"] = 0
            return "lookup/round-backwards", wire.encode(lookup)
        if step == "connect-again":
            if rng.random() < 0.5:
                _, frame = self._connect(seq, hostile=False)  # new boot id: a restart
                return "connect/restart", frame
            return "connect/duplicate", wire.encode(self.hello(seq.peer_id, None))
        if step == "ack-again":
            return "connect_ack/duplicate", self._ack(seq, hostile=False)[1]
        return self._message(seq, step, mutated=rng.random() < 0.3)


_NON_MAPS: Final[tuple[tuple[str, object], ...]] = (
    ("array", ["connect", "x"]),
    ("int", 42),
    ("str", "connect"),
    ("nil", None),
    ("bin", b"\x81\xa4type\xa7connect"),
    ("float", 1.5),
    ("bool", True),
    ("empty-map", {}),
)

_ROUND_STEPS: Final = (
    "lookup",
    "lookup-then-fetch",
    "fetch",
    "fetch-out-of-range",
    "fetch-duplicate-keys",
    "fetch-duplicate-indexes",
    "fetch-twice",
    "fetch-terminal",
    "abort_fetch",
    "lookup_resp",
    "transfer_done",
    "abort_ack",
    "unknown",
    "lookup-huge",
    "round-backwards",
    "connect-again",
    "ack-again",
    "disconnect",
)
_ROUND_WEIGHTS: Final = (
    10.0,
    10.0,
    6.0,
    3.0,
    2.0,
    1.5,
    1.5,
    3.0,
    4.0,
    3.0,
    3.0,
    3.0,
    3.0,
    0.05,
    1.5,
    1.5,
    1.5,
    0.5,
)
