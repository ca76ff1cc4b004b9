"""Hostile-but-decodable kvpeer extensions: data-plane offers and acks a node must refuse.

Decoding accepts all of these (they are well-typed); what makes them hostile is their
values: paths, hosts and ports the node must not touch, planes it does not know or
did not offer, its own NIXL metadata renamed or bit-flipped, tcp without a token.
Each maker gets a :class:`Builder` (the generator) and the peer id to claim.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Final, Protocol

from kvpeer.lab.fuzz import wire
from kvpeer.lab.fuzz.cases import Target
from kvpeer.lab.fuzz.mutations import Payload
from kvpeer.protocol import limits as L

__all__ = [
    "HOSTILE_ACKS",
    "HOSTILE_CONNECTS",
    "HOSTILE_HOSTS",
    "HOSTILE_PATHS",
    "HOSTILE_PORTS",
    "Builder",
]


class Builder(Protocol):
    """What the makers below need of the generator."""

    target: Target

    @property
    def rng(self) -> random.Random: ...

    def hello(self, peer_id: str, transports: dict[str, object] | None) -> Payload: ...

    def good_transports(self) -> dict[str, object]: ...

    def shm_offer(self, path: str) -> dict[str, object]: ...


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


def _long_token(rng: random.Random) -> Payload:
    return {
        "version": [1, 0],
        "transport": {"name": "tcp", "params": {"token": "t" * rng.choice((256, 4096))}},
    }


#: Hostile kvpeer maps of a connect_ack (what plane the peer claims to write with).
HOSTILE_ACKS: Final[tuple[tuple[str, object], ...]] = (
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
    offers: Callable[[Builder, random.Random], dict[str, object]],
) -> Callable[[Builder, str], bytes]:
    def make(gen: Builder, peer_id: str) -> bytes:
        return wire.encode(gen.hello(peer_id, offers(gen, gen.rng)))

    return make


def _ext_connect(
    change: Callable[[Builder, random.Random, Payload], None],
) -> Callable[[Builder, str], bytes]:
    def make(gen: Builder, peer_id: str) -> bytes:
        payload = gen.hello(peer_id, gen.good_transports())
        extension = payload["kvpeer"]
        assert isinstance(extension, dict)
        change(gen, gen.rng, extension)
        return wire.encode(payload)

    return make


def _base_connect(
    change: Callable[[Builder, random.Random, Payload], None],
) -> Callable[[Builder, str], bytes]:
    def make(gen: Builder, peer_id: str) -> bytes:
        payload = gen.hello(peer_id, gen.good_transports())
        change(gen, gen.rng, payload)
        return wire.encode(payload)

    return make


def _shm_hostile(gen: Builder, rng: random.Random) -> dict[str, object]:
    offer = gen.shm_offer(rng.choice(HOSTILE_PATHS))
    if rng.random() < 0.3:
        offer["size"] = rng.choice((0, -1, 2**63 - 1, "x", 4096))
    return {"shm": offer}


def _shm_decoy(gen: Builder, rng: random.Random) -> dict[str, object]:
    """A file outside /dev/shm, of exactly the advertised size: would the node write it?"""
    files = gen.target.decoy_files or gen.target.shm_files or ("/tmp/kvpeer-fuzz-decoy",)
    return {"shm": gen.shm_offer(rng.choice(files))}


def _shm_node_own(gen: Builder, rng: random.Random) -> dict[str, object]:
    """The node's own region, as if it were ours."""
    return {"shm": gen.shm_offer(gen.target.node_shm_path or "/dev/shm/none")}


def _shm_wrong_host(gen: Builder, rng: random.Random) -> dict[str, object]:
    files = gen.target.shm_files or ("/dev/shm/none",)
    offer = gen.shm_offer(rng.choice(files))
    offer["host_id"] = rng.choice(("", "0" * 32, 5, "h" * 4096))
    return {"shm": offer}


def _shm_wrong_inode(gen: Builder, rng: random.Random) -> dict[str, object]:
    files = gen.target.shm_files or ("/dev/shm/none",)
    offer = gen.shm_offer(rng.choice(files))
    offer[rng.choice(("inode", "device"))] = rng.choice((0, -1, 2**63 - 1, "x"))
    return {"shm": offer}


def _tcp_hostile_host(gen: Builder, rng: random.Random) -> dict[str, object]:
    sinks = gen.target.tcp_sinks or (("127.0.0.1", gen.target.dead_port),)
    return {"tcp": {"host": rng.choice(HOSTILE_HOSTS), "port": rng.choice(sinks)[1]}}


def _tcp_hostile_port(gen: Builder, rng: random.Random) -> dict[str, object]:
    return {"tcp": {"host": "127.0.0.1", "port": rng.choice(HOSTILE_PORTS)}}


def _tcp_dead(gen: Builder, rng: random.Random) -> dict[str, object]:
    return {"tcp": {"host": "127.0.0.1", "port": gen.target.dead_port}}


def _tcp_extra_fields(gen: Builder, rng: random.Random) -> dict[str, object]:
    sinks = gen.target.tcp_sinks or (("127.0.0.1", gen.target.dead_port),)
    host, port = rng.choice(sinks)
    return {"tcp": {"host": host, "port": port, "token": "x", "path": "/etc/passwd"}}


def _unknown_planes(gen: Builder, rng: random.Random) -> dict[str, object]:
    choices: tuple[dict[str, object], ...] = (
        {"rdma": {"device": "mlx5_0", "gid": 7}},
        {"ucx": {}},
        {"TCP": {"host": "127.0.0.1", "port": 80}},
        {"tcp2": {"host": "127.0.0.1", "port": 80}},
        {"nixl": {"agent": "evil", "path": "/etc/passwd"}},
        {},
    )
    return rng.choice(choices)


def _too_many_planes(gen: Builder, rng: random.Random) -> dict[str, object]:
    return {f"plane{i}": {} for i in range(L.MAX_TRANSPORTS + rng.choice((0, 1)))}


def _too_many_fields(gen: Builder, rng: random.Random) -> dict[str, object]:
    fields = {f"f{i}": i for i in range(L.MAX_TRANSPORT_FIELDS + rng.choice((0, 1)))}
    return {"tcp": {"host": "127.0.0.1", "port": gen.target.dead_port, **fields}}


def _long_name(gen: Builder, rng: random.Random) -> dict[str, object]:
    return {"p" * (L.MAX_TRANSPORT_NAME_CHARS + rng.choice((0, 1))): {}}


def _long_value(gen: Builder, rng: random.Random) -> dict[str, object]:
    return {"tcp": {"host": "h" * (L.MAX_TRANSPORT_VALUE_BYTES + rng.choice((0, 1))), "port": 9}}


def _odd_value(gen: Builder, rng: random.Random) -> dict[str, object]:
    return {
        "tcp": {"host": rng.choice((1.5, None, b"127.0.0.1", ["127.0.0.1"], {"a": 1})), "port": 9}
    }


def _version(value: object) -> Callable[[Builder, random.Random, Payload], None]:
    def change(gen: Builder, rng: random.Random, extension: Payload) -> None:
        extension["version"] = value

    return change


def _boot_id(gen: Builder, rng: random.Random, extension: Payload) -> None:
    extension["boot_id"] = rng.choice((b"", rng.randbytes(15), rng.randbytes(17), "b" * 16, 16))


def _no_boot_id(gen: Builder, rng: random.Random, extension: Payload) -> None:
    del extension["boot_id"]


def _transports_not_map(gen: Builder, rng: random.Random, extension: Payload) -> None:
    extension["transports"] = rng.choice((["tcp"], "tcp", 1, None))


def _offer_not_map(gen: Builder, rng: random.Random, extension: Payload) -> None:
    extension["transports"] = {"tcp": rng.choice((["127.0.0.1", 80], "127.0.0.1:80", None))}


def _vllm_peer(
    metadata: Callable[[Builder, random.Random], bytes],
) -> Callable[[Builder, str], bytes]:
    """No kvpeer extension: the node must use NIXL with our agent metadata."""

    def make(gen: Builder, peer_id: str) -> bytes:
        payload = gen.hello(peer_id, None)
        payload["agent_metadata"] = metadata(gen, gen.rng)
        return wire.encode(payload)

    return make


def _nixl_offer(
    metadata: Callable[[Builder, random.Random], bytes],
) -> Callable[[Builder, str], bytes]:
    def make(gen: Builder, peer_id: str) -> bytes:
        payload = gen.hello(peer_id, {"nixl": {}})
        payload["agent_metadata"] = metadata(gen, gen.rng)
        return wire.encode(payload)

    return make


def _garbage_metadata(gen: Builder, rng: random.Random) -> bytes:
    return rng.randbytes(rng.choice((1, 16, 300, 4096)))


def _flipped_node_metadata(gen: Builder, rng: random.Random) -> bytes:
    own = gen.target.node_agent_metadata
    return wire.bitflip(own, rng, rng.choice((1, 3))) if own else rng.randbytes(64)


def _truncated_node_metadata(gen: Builder, rng: random.Random) -> bytes:
    own = gen.target.node_agent_metadata
    return wire.truncate(own, rng) if own else b"nixlSerDes|"


def _node_metadata(gen: Builder, rng: random.Random) -> bytes:
    return gen.target.node_agent_metadata or b"nixlSerDes|"


def _region(
    field_name: str, values: tuple[object, ...]
) -> Callable[[Builder, random.Random, Payload], None]:
    def change(gen: Builder, rng: random.Random, payload: Payload) -> None:
        payload[field_name] = rng.choice(values)

    return change


#: Hostile connects: (label, frame maker).
HOSTILE_CONNECTS: Final[tuple[tuple[str, Callable[[Builder, str], bytes]], ...]] = (
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
