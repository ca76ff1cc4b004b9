"""The shm plane, attacked from the network (issue 15, item 3).

A raw peer speaks the control protocol by hand to a real ``kvpeer serve --data-planes
shm,tcp`` node. Whatever it puts in its shm offer (a file's path, the node's own
offer, a third node's offer, a socket name nobody serves) and whatever host id it
echoes, the node never writes into anything but a region whose owner handed it over
on this host: it picks tcp (or refuses the session), and not one byte of the victim
changes. A legitimate same-host pair still moves its blocks over shm.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
import zmq

from kvpeer.protocol import (
    Connect,
    ConnectAck,
    Disconnect,
    Fetch,
    Lookup,
    LookupResponse,
    TransferDone,
    TransportOffer,
)
from tests.net.common import BLOCK_LEN, DEADLINE_S, free_port, keys_of, wait_until
from tests.net.localnode import LocalNode
from tests.net.processes import NodeProcess, start_serve
from tests.net.rawpeer import RawPeer

ZmqContext = zmq.Context[zmq.Socket[bytes]]
NODE_BLOCKS = 64
SYNTHETIC = 16
VICTIM_BLOCKS = 4
VICTIM_BYTES = VICTIM_BLOCKS * BLOCK_LEN


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    """The attacked node: shm preferred, tcp as well, 16 synthetic blocks."""
    process = start_serve(
        tmp_path_factory.mktemp("attacked"),
        plane="shm,tcp",
        blocks=NODE_BLOCKS,
        synthetic=SYNTHETIC,
    )
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def context() -> Iterator[ZmqContext]:
    context: ZmqContext = zmq.Context()
    try:
        yield context
    finally:
        context.destroy(linger=0)


# -- the attacker ------------------------------------------------------------------------


def _first(peer: RawPeer, *kinds: type) -> object | None:
    """The first message of one of ``kinds`` the node sent ``peer`` (None: none in time)."""
    found: list[object] = []

    def arrived() -> bool:
        peer.drain()
        found.extend(m for m in peer.received if isinstance(m, kinds))
        return bool(found)

    wait_until(arrived, DEADLINE_S)
    return found[0] if found else None


def node_offer(context: ZmqContext, node_id: str) -> TransportOffer:
    """What any peer learns by saying hello: the node's shm offer (with its host id)."""
    scout = RawPeer(context, node_id)
    try:
        scout.send(scout.hello())
        connect = _first(scout, Connect)
        assert isinstance(connect, Connect), "setup: the node did not greet us"
        assert connect.kvpeer is not None
        return connect.kvpeer.transports["shm"]
    finally:
        scout.close()


@dataclass(frozen=True)
class Attack:
    attacker: str  # the attacker's peer id
    chosen: str | None  # the plane the node writes into it with (None: refused)


def attack(
    context: ZmqContext,
    node_id: str,
    shm_offer: TransportOffer,
    *,
    num_blocks: int,
    fetch: dict[int, int],
    with_tcp: bool = True,
) -> Attack:
    """Connect with ``shm_offer`` (and a tcp offer at a port where nothing listens),
    then look up and fetch synthetic blocks ``key index -> our slot``."""
    peer = RawPeer(context, node_id)
    try:
        hello = peer.hello(num_blocks=num_blocks, data_port=free_port())
        assert hello.kvpeer is not None
        transports = {"shm": shm_offer}
        if with_tcp:
            transports["tcp"] = hello.kvpeer.transports["tcp"]
        extension = msgspec.structs.replace(hello.kvpeer, transports=transports)
        peer.send(msgspec.structs.replace(hello, kvpeer=extension))
        answer = _first(peer, ConnectAck, Disconnect)
        if not isinstance(answer, ConnectAck):
            assert isinstance(answer, Disconnect), "the node neither acked nor refused"
            return Attack(peer.peer_id, None)
        assert answer.kvpeer is not None
        assert answer.kvpeer.transport is not None
        peer.send(peer.ack())
        keys = tuple(keys_of(list(fetch)))
        peer.send(Lookup(kv_request_id="grab", keys=keys, round_seq=0))
        response = _first(peer, LookupResponse)
        assert isinstance(response, LookupResponse)
        assert all(response.hits), "setup: the node should hold the blocks"
        peer.send(
            Fetch(kv_request_id="grab", keys=keys, block_indexes=tuple(fetch.values()), round_seq=0)
        )
        # The node tried to write (over tcp, to nobody): it reports the round, or ends
        # the session.
        assert _first(peer, TransferDone, Disconnect) is not None
        return Attack(peer.peer_id, answer.kvpeer.transport.name)
    finally:
        peer.close()


def fingerprint(path: Path) -> tuple[str, int, int]:
    info = path.stat()
    return hashlib.sha256(path.read_bytes()).hexdigest(), info.st_mtime_ns, info.st_mode


def assert_node_serves_intact_blocks(node_id: str) -> None:
    """A legitimate consumer pulls every synthetic block; each is what it should be."""
    with LocalNode("tcp") as legit:
        result = legit.pull(node_id, keys_of(range(SYNTHETIC)), range(SYNTHETIC))
        assert (result.hits, result.loaded) == (SYNTHETIC, True)
        legit.assert_blocks(range(SYNTHETIC), range(SYNTHETIC))


# -- (1) the reproduction: a path in the offer ---------------------------------------------


@pytest.fixture
def victims(tmp_path: Path) -> dict[str, Path]:
    """Files of exactly the region size the attacker advertises: one writable, one
    read-only (the node runs as whoever runs the tests; as root, 0444 stops nothing)."""
    files = {}
    for name, mode in (("writable", 0o644), ("read-only", 0o444)):
        path = tmp_path / f"victim-{name}"
        path.write_bytes(os.urandom(VICTIM_BYTES))
        path.chmod(mode)
        files[name] = path
    return files


OFFERS = {
    "old style": lambda victim, host_id: {
        "path": str(victim),
        "size": VICTIM_BYTES,
        "host_id": host_id,
    },
    "old style with the file's identity": lambda victim, host_id: {
        "path": str(victim),
        "size": VICTIM_BYTES,
        "host_id": host_id,
        "device": victim.stat().st_dev,
        "inode": victim.stat().st_ino,
    },
    "new style, a socket nobody serves": lambda victim, host_id: {
        "socket": secrets.token_hex(16),
        "size": VICTIM_BYTES,
        "host_id": host_id,
    },
    "new style, and a path": lambda victim, host_id: {
        "socket": secrets.token_hex(16),
        "path": str(victim),
        "size": VICTIM_BYTES,
        "host_id": host_id,
    },
}


@pytest.mark.parametrize("with_tcp", [True, False], ids=["shm and tcp", "shm only"])
@pytest.mark.parametrize("style", list(OFFERS))
def test_a_path_in_an_offer_is_never_written(
    node: NodeProcess,
    context: ZmqContext,
    victims: dict[str, Path],
    style: str,
    with_tcp: bool,
) -> None:
    host_id = node_offer(context, node.peer_id)["host_id"]  # echoed, as in the report
    before = {name: fingerprint(path) for name, path in victims.items()}

    chosen = [
        attack(
            context,
            node.peer_id,
            OFFERS[style](victim, host_id),
            num_blocks=VICTIM_BLOCKS,
            fetch={i: i for i in range(VICTIM_BLOCKS)},
            with_tcp=with_tcp,
        ).chosen
        for victim in victims.values()
    ]

    assert {name: fingerprint(path) for name, path in victims.items()} == before
    assert chosen == ["tcp" if with_tcp else None] * len(victims)
    assert node.alive()


# -- (2) the node's own offer -------------------------------------------------------------


def test_the_nodes_own_offer_does_not_make_it_copy_over_its_own_blocks(
    node: NodeProcess, context: ZmqContext
) -> None:
    assert_node_serves_intact_blocks(node.peer_id)
    own = node_offer(context, node.peer_id)

    # Block i into "our" slot 15 - i: over the node's own region, a permutation.
    outcome = attack(
        context,
        node.peer_id,
        own,
        num_blocks=NODE_BLOCKS,
        fetch={i: SYNTHETIC - 1 - i for i in range(SYNTHETIC)},
    )

    assert_node_serves_intact_blocks(node.peer_id)
    assert outcome.chosen == "tcp"
    assert f"shm: mapped the region of {node.peer_id}" not in node.log()


# -- (3) a third node's offer, relayed ----------------------------------------------------


@pytest.mark.parametrize("acquainted", [False, True], ids=["stranger", "peer of the node"])
def test_a_relayed_offer_is_refused_by_its_owner(
    node: NodeProcess, context: ZmqContext, acquainted: bool
) -> None:
    """The third node (in this process) owns the relayed region. As a stranger to the
    attacked node it granted nobody but the scout; as its peer (it pulled from it over
    shm first) it granted the node, but the request names the attacker's session."""
    with LocalNode(["shm", "tcp"], num_blocks=NODE_BLOCKS) as third:
        if acquainted:
            result = third.pull(node.peer_id, keys_of(range(SYNTHETIC)), range(SYNTHETIC))
            assert (result.hits, result.loaded) == (SYNTHETIC, True)
            assert wait_until(lambda: f"mapped the region of {third.peer_id}" in node.log())
        relayed = node_offer(context, third.peer_id)
        before = bytes(third.pool.view)

        outcome = attack(
            context,
            node.peer_id,
            relayed,
            num_blocks=NODE_BLOCKS,
            fetch={i: 32 + i for i in range(SYNTHETIC)},
        )

        assert bytes(third.pool.view) == before
        assert outcome.chosen == "tcp"
        refusals = [
            line
            for line in node.log().splitlines()
            if f"data plane shm unusable with {outcome.attacker}" in line
        ]
        reason = "belongs to" if acquainted else "holds no session"
        assert len(refusals) == 1
        assert "the region owner refused" in refusals[0]
        assert reason in refusals[0]


# -- and the legitimate case -------------------------------------------------------------


def test_a_same_host_pair_still_pulls_over_shm(node: NodeProcess) -> None:
    with LocalNode(["shm", "tcp"]) as consumer:
        result = consumer.pull(node.peer_id, keys_of(range(SYNTHETIC)), range(SYNTHETIC))
        assert (result.hits, result.loaded) == (SYNTHETIC, True)
        consumer.assert_blocks(range(SYNTHETIC), range(SYNTHETIC))
        assert wait_until(lambda: f"shm: mapped the region of {consumer.peer_id}" in node.log())
