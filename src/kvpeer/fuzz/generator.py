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

from kvpeer.fuzz import wire
from kvpeer.fuzz.mutations import UNKNOWN_TYPES, Bulk, Payload, mutate
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

#: Hosts a tcp offer may name: none of them is where the offering connection comes from.
HOSTILE_HOSTS: Final = (
    "10.1.2.3",
    "192.0.2.1",
    "127.0.0.9",
    "0.0.0.0",
    "255.255.255.255",
    "::1",
    "localhost",
    "",
    "h" * 4096,
    "127.0.0.1\x00evil",
)
HOSTILE_PORTS: Final[tuple[object, ...]] = (0, 65536, -1, "x", True, 2**63 - 1, 1, 2**16 - 1)
HOSTILE_PATHS: Final = (
    "/etc/passwd",
    "/dev/shm/../../etc/passwd",
    "/proc/self/mem",
    "/dev/zero",
    "/dev/shm",
    "",
    "relative/region",
    "/" + "p" * 4000,
    "/dev/shm/kvpeer-serve-1-0",
)


@dataclass(frozen=True, slots=True)
class Target:
    """The node under test and the fuzzer's own resources, as the generator sees them.

    ``identities`` are the claimed peer ids (``host:port``) of the fuzzer's DEALERs:
    the first ``listening`` of them have a ROUTER behind them that reads the node's
    dial-back, the rest have nobody listening. ``odd_identities`` are raw ZMQ
    identities that are not a usable peer id. Case identities index
    ``identities`` first, then ``odd_identities``.
    """

    identities: tuple[str, ...]
    listening: int
    block_len: int
    synthetic_blocks: int
    odd_identities: tuple[bytes, ...] = ()
    hash_seed: str = "vllm-none-hash"
    our_blocks: int = 64  # the region every connect of ours advertises
    host_id: str = ""  # the node's shm host identity, from its connect
    node_shm_path: str = ""
    node_agent_metadata: bytes = b""
    shm_files: tuple[str, ...] = ()  # our_blocks * block_len bytes, made by the fuzzer
    decoy_files: tuple[str, ...] = ()  # same size, outside /dev/shm
    tcp_sinks: tuple[tuple[str, int], ...] = ()  # listeners that read and discard
    dead_port: int = 1  # nothing listens there

    def __post_init__(self) -> None:
        if not self.identities or not 0 <= self.listening <= len(self.identities):
            raise ValueError("a target needs identities, the first `listening` of them heard")
        if self.synthetic_blocks < 1:
            raise ValueError("the node must hold synthetic blocks to fetch")


@dataclass(frozen=True, slots=True)
class Case:
    """One multipart message from one identity; ``label`` is ``"kind/mutation"``."""

    label: str
    scenario: str
    identity: int
    parts: tuple[bytes, ...]
    sequence: int

    @property
    def kind(self) -> str:
        return self.label.partition("/")[0]


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
                return self._hello(seq, self._good_transports())
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
                return {
                    "type": kind,
                    "kv_request_id": self._request_id(seq),
                    "keys": keys,
                    "block_indexes": rng.sample(range(self.target.our_blocks), len(keys)),
                    "round_seq": seq.round_seq,
                }
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

    def _hello(self, seq: _Sequence, transports: dict[str, object] | None) -> Payload:
        target = self.target
        payload: Payload = {
            "type": "connect",
            "peer_id": seq.peer_id,
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

    def _good_transports(self) -> dict[str, object]:
        target, rng = self.target, self._rng
        offers: dict[str, object] = {}
        if target.shm_files and target.host_id and rng.random() < 0.5:
            offers["shm"] = self._shm_offer(rng.choice(target.shm_files))
        if target.tcp_sinks and (not offers or rng.random() < 0.5):
            host, port = rng.choice(target.tcp_sinks)
            offers["tcp"] = {"host": host, "port": port}
        if not offers:
            offers["tcp"] = {"host": "127.0.0.1", "port": target.dead_port}
        return offers

    def _shm_offer(self, path: str) -> dict[str, object]:
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
            offers = self._good_transports()
            payload = self._hello(seq, offers)
            return f"connect/valid:{'+'.join(sorted(offers))}", wire.encode(payload)
        name, make = rng.choice(_HOSTILE_CONNECTS)
        return f"connect/{name}", make(self, seq)

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
        name, extension = rng.choice(_HOSTILE_ACKS)
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
            return "connect/duplicate", wire.encode(self._hello(seq, None))
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


def _long_token(rng: random.Random) -> Payload:
    return {
        "version": [1, 0],
        "transport": {"name": "tcp", "params": {"token": "t" * rng.choice((256, 4096))}},
    }


#: Hostile kvpeer maps of a connect_ack (what plane the peer claims to write with).
_HOSTILE_ACKS: Final[tuple[tuple[str, object], ...]] = (
    ("transport:tcp-empty-params", {"version": [1, 0], "transport": {"name": "tcp", "params": {}}}),
    ("transport:tcp-no-params", {"version": [1, 0], "transport": {"name": "tcp"}}),
    (
        "transport:tcp-short-token",
        {"version": [1, 0], "transport": {"name": "tcp", "params": {"token": "abc"}}},
    ),
    (
        "transport:tcp-int-token",
        {"version": [1, 0], "transport": {"name": "tcp", "params": {"token": 12345}}},
    ),
    (
        "transport:tcp-non-ascii-token",
        {"version": [1, 0], "transport": {"name": "tcp", "params": {"token": "é" * 20}}},
    ),
    ("transport:tcp-long-token", _long_token),
    ("transport:unoffered-rdma", {"version": [1, 0], "transport": {"name": "rdma", "params": {}}}),
    (
        "transport:unoffered-TCP",
        {"version": [1, 0], "transport": {"name": "TCP", "params": {"token": "a" * 32}}},
    ),
    ("transport:empty-name", {"version": [1, 0], "transport": {"name": "", "params": {}}}),
    ("transport:long-name", {"version": [1, 0], "transport": {"name": "n" * 33, "params": {}}}),
    (
        "transport:shm-with-params",
        {"version": [1, 0], "transport": {"name": "shm", "params": {"path": "/etc/passwd"}}},
    ),
    (
        "transport:nixl-with-params",
        {"version": [1, 0], "transport": {"name": "nixl", "params": {"agent": "x"}}},
    ),
    ("transport:none", {"version": [1, 0], "transport": None}),
    ("transport:not-map", {"version": [1, 0], "transport": "tcp"}),
    (
        "transport:params-not-map",
        {"version": [1, 0], "transport": {"name": "tcp", "params": ["token"]}},
    ),
    (
        "transport:params-nested",
        {"version": [1, 0], "transport": {"name": "tcp", "params": {"token": {"a": 1}}}},
    ),
    (
        "version:major-2",
        {"version": [2, 0], "transport": {"name": "tcp", "params": {"token": "b" * 32}}},
    ),
    (
        "version:short",
        {"version": [1], "transport": {"name": "tcp", "params": {"token": "b" * 32}}},
    ),
    ("version:missing", {"transport": {"name": "tcp", "params": {"token": "b" * 32}}}),
    ("ext:not-map", "kvpeer"),
    ("ext:empty", {}),
)


# -- hostile connects -------------------------------------------------------------------------


def _offer_connect(
    offers: Callable[[FrameGenerator, random.Random], dict[str, object]],
) -> Callable[[FrameGenerator, _Sequence], bytes]:
    def make(gen: FrameGenerator, seq: _Sequence) -> bytes:
        return wire.encode(gen._hello(seq, offers(gen, gen._rng)))

    return make


def _ext_connect(
    change: Callable[[FrameGenerator, random.Random, Payload], None],
) -> Callable[[FrameGenerator, _Sequence], bytes]:
    def make(gen: FrameGenerator, seq: _Sequence) -> bytes:
        payload = gen._hello(seq, gen._good_transports())
        extension = payload["kvpeer"]
        assert isinstance(extension, dict)
        change(gen, gen._rng, extension)
        return wire.encode(payload)

    return make


def _base_connect(
    change: Callable[[FrameGenerator, random.Random, Payload], None],
) -> Callable[[FrameGenerator, _Sequence], bytes]:
    def make(gen: FrameGenerator, seq: _Sequence) -> bytes:
        payload = gen._hello(seq, gen._good_transports())
        change(gen, gen._rng, payload)
        return wire.encode(payload)

    return make


def _shm_hostile(gen: FrameGenerator, rng: random.Random) -> dict[str, object]:
    offer = gen._shm_offer(rng.choice(HOSTILE_PATHS))
    if rng.random() < 0.3:
        offer["size"] = rng.choice((0, -1, 2**63 - 1, "x", 4096))
    return {"shm": offer}


def _shm_decoy(gen: FrameGenerator, rng: random.Random) -> dict[str, object]:
    """A file outside /dev/shm, of exactly the advertised size: would the node write it?"""
    files = gen.target.decoy_files or gen.target.shm_files or ("/tmp/kvpeer-fuzz-decoy",)
    return {"shm": gen._shm_offer(rng.choice(files))}


def _shm_node_own(gen: FrameGenerator, rng: random.Random) -> dict[str, object]:
    """The node's own region, as if it were ours."""
    return {"shm": gen._shm_offer(gen.target.node_shm_path or "/dev/shm/none")}


def _shm_wrong_host(gen: FrameGenerator, rng: random.Random) -> dict[str, object]:
    files = gen.target.shm_files or ("/dev/shm/none",)
    offer = gen._shm_offer(rng.choice(files))
    offer["host_id"] = rng.choice(("", "0" * 32, 5, "h" * 4096))
    return {"shm": offer}


def _shm_wrong_inode(gen: FrameGenerator, rng: random.Random) -> dict[str, object]:
    files = gen.target.shm_files or ("/dev/shm/none",)
    offer = gen._shm_offer(rng.choice(files))
    offer[rng.choice(("inode", "device"))] = rng.choice((0, -1, 2**63 - 1, "x"))
    return {"shm": offer}


def _tcp_hostile_host(gen: FrameGenerator, rng: random.Random) -> dict[str, object]:
    sinks = gen.target.tcp_sinks or (("127.0.0.1", gen.target.dead_port),)
    return {"tcp": {"host": rng.choice(HOSTILE_HOSTS), "port": rng.choice(sinks)[1]}}


def _tcp_hostile_port(gen: FrameGenerator, rng: random.Random) -> dict[str, object]:
    return {"tcp": {"host": "127.0.0.1", "port": rng.choice(HOSTILE_PORTS)}}


def _tcp_dead(gen: FrameGenerator, rng: random.Random) -> dict[str, object]:
    return {"tcp": {"host": "127.0.0.1", "port": gen.target.dead_port}}


def _tcp_extra_fields(gen: FrameGenerator, rng: random.Random) -> dict[str, object]:
    sinks = gen.target.tcp_sinks or (("127.0.0.1", gen.target.dead_port),)
    host, port = rng.choice(sinks)
    return {"tcp": {"host": host, "port": port, "token": "x", "path": "/etc/passwd"}}


def _unknown_planes(gen: FrameGenerator, rng: random.Random) -> dict[str, object]:
    choices: tuple[dict[str, object], ...] = (
        {"rdma": {"device": "mlx5_0", "gid": 7}},
        {"ucx": {}},
        {"TCP": {"host": "127.0.0.1", "port": 80}},
        {"tcp2": {"host": "127.0.0.1", "port": 80}},
        {"nixl": {"agent": "evil", "path": "/etc/passwd"}},
        {},
    )
    return rng.choice(choices)


def _too_many_planes(gen: FrameGenerator, rng: random.Random) -> dict[str, object]:
    return {f"plane{i}": {} for i in range(L.MAX_TRANSPORTS + rng.choice((0, 1)))}


def _too_many_fields(gen: FrameGenerator, rng: random.Random) -> dict[str, object]:
    fields = {f"f{i}": i for i in range(L.MAX_TRANSPORT_FIELDS + rng.choice((0, 1)))}
    return {"tcp": {"host": "127.0.0.1", "port": gen.target.dead_port, **fields}}


def _long_name(gen: FrameGenerator, rng: random.Random) -> dict[str, object]:
    return {"p" * (L.MAX_TRANSPORT_NAME_CHARS + rng.choice((0, 1))): {}}


def _long_value(gen: FrameGenerator, rng: random.Random) -> dict[str, object]:
    return {"tcp": {"host": "h" * (L.MAX_TRANSPORT_VALUE_BYTES + rng.choice((0, 1))), "port": 9}}


def _odd_value(gen: FrameGenerator, rng: random.Random) -> dict[str, object]:
    return {
        "tcp": {"host": rng.choice((1.5, None, b"127.0.0.1", ["127.0.0.1"], {"a": 1})), "port": 9}
    }


def _version(value: object) -> Callable[[FrameGenerator, random.Random, Payload], None]:
    def change(gen: FrameGenerator, rng: random.Random, extension: Payload) -> None:
        extension["version"] = value

    return change


def _boot_id(gen: FrameGenerator, rng: random.Random, extension: Payload) -> None:
    extension["boot_id"] = rng.choice((b"", rng.randbytes(15), rng.randbytes(17), "b" * 16, 16))


def _no_boot_id(gen: FrameGenerator, rng: random.Random, extension: Payload) -> None:
    del extension["boot_id"]


def _transports_not_map(gen: FrameGenerator, rng: random.Random, extension: Payload) -> None:
    extension["transports"] = rng.choice((["tcp"], "tcp", 1, None))


def _offer_not_map(gen: FrameGenerator, rng: random.Random, extension: Payload) -> None:
    extension["transports"] = {"tcp": rng.choice((["127.0.0.1", 80], "127.0.0.1:80", None))}


def _vllm_peer(
    metadata: Callable[[FrameGenerator, random.Random], bytes],
) -> Callable[[FrameGenerator, _Sequence], bytes]:
    """No kvpeer extension: the node must use NIXL with our agent metadata."""

    def make(gen: FrameGenerator, seq: _Sequence) -> bytes:
        payload = gen._hello(seq, None)
        payload["agent_metadata"] = metadata(gen, gen._rng)
        return wire.encode(payload)

    return make


def _nixl_offer(
    metadata: Callable[[FrameGenerator, random.Random], bytes],
) -> Callable[[FrameGenerator, _Sequence], bytes]:
    def make(gen: FrameGenerator, seq: _Sequence) -> bytes:
        payload = gen._hello(seq, {"nixl": {}})
        payload["agent_metadata"] = metadata(gen, gen._rng)
        return wire.encode(payload)

    return make


def _garbage_metadata(gen: FrameGenerator, rng: random.Random) -> bytes:
    return rng.randbytes(rng.choice((1, 16, 300, 4096)))


def _flipped_node_metadata(gen: FrameGenerator, rng: random.Random) -> bytes:
    own = gen.target.node_agent_metadata
    return wire.bitflip(own, rng, rng.choice((1, 3))) if own else rng.randbytes(64)


def _truncated_node_metadata(gen: FrameGenerator, rng: random.Random) -> bytes:
    own = gen.target.node_agent_metadata
    return wire.truncate(own, rng) if own else b"nixlSerDes|"


def _node_metadata(gen: FrameGenerator, rng: random.Random) -> bytes:
    return gen.target.node_agent_metadata or b"nixlSerDes|"


def _region(
    field_name: str, values: tuple[object, ...]
) -> Callable[[FrameGenerator, random.Random, Payload], None]:
    def change(gen: FrameGenerator, rng: random.Random, payload: Payload) -> None:
        payload[field_name] = rng.choice(values)

    return change


#: Hostile connects: (label, frame maker).
_HOSTILE_CONNECTS: Final[tuple[tuple[str, Callable[[FrameGenerator, _Sequence], bytes]], ...]] = (
    ("offer:shm-hostile-path", _offer_connect(_shm_hostile)),
    ("offer:shm-decoy-file", _offer_connect(_shm_decoy)),
    ("offer:shm-node-own-region", _offer_connect(_shm_node_own)),
    ("offer:shm-wrong-host", _offer_connect(_shm_wrong_host)),
    ("offer:shm-wrong-inode", _offer_connect(_shm_wrong_inode)),
    ("offer:tcp-hostile-host", _offer_connect(_tcp_hostile_host)),
    ("offer:tcp-hostile-port", _offer_connect(_tcp_hostile_port)),
    ("offer:tcp-dead-port", _offer_connect(_tcp_dead)),
    ("offer:tcp-extra-fields", _offer_connect(_tcp_extra_fields)),
    ("offer:unknown-planes", _offer_connect(_unknown_planes)),
    ("offer:too-many-planes", _offer_connect(_too_many_planes)),
    ("offer:too-many-fields", _offer_connect(_too_many_fields)),
    ("offer:long-plane-name", _offer_connect(_long_name)),
    ("offer:long-value", _offer_connect(_long_value)),
    ("offer:odd-value", _offer_connect(_odd_value)),
    ("offer:nixl-garbage-metadata", _nixl_offer(_garbage_metadata)),
    ("offer:nixl-flipped-metadata", _nixl_offer(_flipped_node_metadata)),
    ("offer:nixl-truncated-metadata", _nixl_offer(_truncated_node_metadata)),
    ("offer:nixl-node-own-metadata", _nixl_offer(_node_metadata)),
    ("vllm-peer:garbage-metadata", _vllm_peer(_garbage_metadata)),
    ("vllm-peer:empty-metadata", _vllm_peer(lambda gen, rng: b"")),
    ("vllm-peer:flipped-metadata", _vllm_peer(_flipped_node_metadata)),
    ("ext:version-major-2", _ext_connect(_version([2, 0]))),
    ("ext:version-short", _ext_connect(_version([1]))),
    ("ext:version-long", _ext_connect(_version([1, 0, 0]))),
    ("ext:version-str", _ext_connect(_version("1.0"))),
    ("ext:version-negative", _ext_connect(_version([-1, 0]))),
    ("ext:version-65536", _ext_connect(_version([65536, 0]))),
    ("ext:version-bool", _ext_connect(_version([True, False]))),
    ("ext:boot-id-size", _ext_connect(_boot_id)),
    ("ext:boot-id-missing", _ext_connect(_no_boot_id)),
    ("ext:transports-not-map", _ext_connect(_transports_not_map)),
    ("ext:offer-not-map", _ext_connect(_offer_not_map)),
    ("region:num-blocks-huge", _base_connect(_region("num_blocks", (2**63 - 1, 2**40, 2**31)))),
    ("region:base-addr-huge", _base_connect(_region("base_addr", (2**63 - 1, 2**48)))),
    ("region:block-len-other", _base_connect(_region("block_len", (1, 8, 2**20, 2**63 - 1)))),
    ("region:hash-seed-other", _base_connect(_region("hash_seed", ("other-seed", "s" * 512)))),
    ("region:fingerprint-other", _base_connect(_region("config_fingerprint", ("fp", "f" * 128)))),
    ("region:peer-id-other", _base_connect(_region("peer_id", ("127.0.0.1:1", "x", "n" * 512)))),
)
