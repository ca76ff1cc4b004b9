"""The control port, attacked from outside (issue 15, items 1, 4, 5, 7).

Each test plays a hostile peer with raw ZMQ sockets against a real node and then
checks that the node is still whole: alive, its legitimate peers served, nothing
of its own dialled, held or lost on the attacker's say-so.
"""

from __future__ import annotations

import os
import resource
import socket
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from kvpeer.protocol import (
    PROTOCOL_VERSION,
    AbortFetch,
    AckExtension,
    Codec,
    Connect,
    ConnectAck,
    Disconnect,
    Fetch,
    Lookup,
    TransportChoice,
)
from kvpeer.testing import make_hello
from kvpeer.transport.data.nixl import NixlBackend
from kvpeer.transport.zmq_control import ZmqControl
from tests.net.common import BLOCK_LEN, HASH_SEED, free_port, keys_of, wait_until
from tests.net.localnode import LocalNode
from tests.net.processes import StartNode
from tests.net.rawpeer import RawPeer
from tests.net.servingnode import ServingNode

ZmqContext = zmq.Context[zmq.Socket[bytes]]
CODEC = Codec()


def assert_pull_works(consumer: LocalNode, peer_id: str, slots: range = range(16)) -> None:
    indexes = list(range(len(slots)))
    result = consumer.pull(peer_id, keys_of(indexes), slots)
    assert (result.hits, result.loaded) == (len(slots), True)
    consumer.assert_blocks(slots, indexes)


def handshaken(peer: RawPeer) -> RawPeer:
    """``peer`` after it sent its connect, read the node's and acknowledged it."""
    peer.send(peer.hello())
    assert peer.wait_for(Connect) is not None
    peer.send(peer.ack())
    return peer


def answers_on_dealer(dealer: zmq.Socket[bytes], timeout_s: float) -> list[object]:
    """What a node answered on our own connection (a refusal) within ``timeout_s``."""
    found: list[object] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if dealer.poll(50):
            found.append(CODEC.decode(dealer.recv()))
            if any(isinstance(m, Disconnect) for m in found):
                break
    return found


# -- item 1: one exception boundary per session ------------------------------------------------


def test_a_connect_ack_choosing_tcp_without_params_ends_only_that_session(
    serve: StartNode, zmq_context: ZmqContext
) -> None:
    """The reproduction: this one frame used to kill the node's driver thread."""
    node = serve(plane="tcp")
    attacker = RawPeer(zmq_context, node.peer_id)
    try:
        attacker.send(attacker.hello())
        assert attacker.wait_for(Connect) is not None, "the node never dialled back"
        attacker.send(
            ConnectAck(
                peer_id=attacker.peer_id,
                kvpeer=AckExtension(
                    version=PROTOCOL_VERSION, transport=TransportChoice(name="tcp", params={})
                ),
            )
        )
        goodbye = attacker.wait_for(Disconnect)
        assert goodbye is not None, f"no disconnect; got {attacker.received}"
        assert "token" in goodbye.reason
        assert node.alive()
        with LocalNode("tcp") as legit:
            assert_pull_works(legit, node.peer_id)
        assert "crashed" not in node.log()
        assert "peer_fault" in node.log()
    finally:
        attacker.close()


# -- item 4: nothing a peer names is dialled blindly -------------------------------------------


@pytest.mark.parametrize("trusted", [False, True])
def test_a_peer_id_naming_another_host_is_not_dialled(
    zmq_context: ZmqContext, trusted: bool
) -> None:
    """A connection from 127.0.0.1 that claims to be 127.0.0.9:P: by default the node
    refuses it on that connection and opens nothing to 127.0.0.9; an operator who set
    ``trust_peer_addresses`` (peers behind NAT) gets the old behaviour."""
    third_party = zmq_context.socket(zmq.ROUTER)  # where the claimed identity points
    third_party.setsockopt(zmq.LINGER, 0)
    port = third_party.bind_to_random_port("tcp://127.0.0.9")
    claimed = f"127.0.0.9:{port}"
    with ServingNode("tcp", trust_peer_addresses=trusted) as node:
        liar = zmq_context.socket(zmq.DEALER)
        liar.setsockopt(zmq.LINGER, 0)
        liar.setsockopt(zmq.IDENTITY, claimed.encode())
        liar.connect(f"tcp://{node.peer_id}")
        try:
            hello = RawPeer(zmq_context, node.peer_id, listen=False)
            forged = hello.hello()
            hello.close()
            liar.send(CODEC.encode(msgspec.structs.replace(forged, peer_id=claimed)))
            if trusted:
                assert third_party.poll(5000), "trust_peer_addresses: the node did not dial"
                return
            answers = answers_on_dealer(liar, 3.0)
            refusals = [m for m in answers if isinstance(m, Disconnect)]
            assert refusals, f"no refusal; got {answers}"
            assert "does not name the address" in refusals[0].reason
            assert not third_party.poll(500), "the node dialled the claimed third party"
            assert not node.has_session(claimed)
            assert node.statistics().peers_refused >= 1
        finally:
            liar.close()
            third_party.close()


# -- item 5: floods do not starve legitimate peers ----------------------------------------------


@pytest.fixture
def many_fds() -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 65536)), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_connect_flood_from_one_address_does_not_starve_a_legitimate_peer(
    zmq_context: ZmqContext, many_fds: None
) -> None:
    """2,000 identities send valid connects from 127.0.0.5 while a legitimate peer
    connects from 127.0.0.1: sessions stay under max_peers, the flood holds at most
    max_handshakes_per_source of them, the node's own links stay bounded, and the
    legitimate peer is admitted and served within its handshake time."""
    cap, per_source, flood = 16, 4, 2000
    zmq_context.set(zmq.MAX_SOCKETS, 8192)
    with ServingNode("tcp", max_peers=cap, max_handshakes_per_source=per_source) as node:
        dealers: list[zmq.Socket[bytes]] = []
        peak_sessions = peak_links = 0
        try:
            for n in range(flood):
                dealer = zmq_context.socket(zmq.DEALER)
                dealer.setsockopt(zmq.LINGER, 0)
                claimed = f"127.0.0.5:{20000 + n}"  # nobody listens there
                dealer.setsockopt(zmq.IDENTITY, claimed.encode())
                dealer.connect(f"tcp://127.0.0.5:0;{node.peer_id}")
                dealer.send(CODEC.encode(_hello(claimed)))
                dealers.append(dealer)
                if n % 100 == 0:
                    stats = node.statistics()
                    peak_sessions = max(peak_sessions, stats.sessions)
                    peak_links = max(peak_links, _links(node))
                if n == flood // 2:  # in the middle of the flood
                    started = time.monotonic()
                    with LocalNode("tcp") as legit:
                        assert_pull_works(legit, node.peer_id)
                    assert time.monotonic() - started < 10.0
            for _ in range(20):
                stats = node.statistics()
                peak_sessions = max(peak_sessions, stats.sessions)
                peak_links = max(peak_links, _links(node))
                time.sleep(0.05)
            assert peak_sessions <= cap
            assert peak_links <= 2 * cap  # sessions plus goodbyes in flight
            assert node.statistics().peers_refused > 0
            with LocalNode("tcp") as late:
                assert_pull_works(late, node.peer_id)
            assert not node.node.crashed
        finally:
            for dealer in dealers:
                dealer.close(linger=0)


def _links(node: ServingNode) -> int:
    """The node's own outbound control links (each a socket it opened)."""
    control = node.node.tier._control
    assert isinstance(control, ZmqControl)
    with node.node.locked():
        return control.statistics().links


def _hello(peer_id: str) -> Connect:
    return make_hello(peer_id, num_blocks=64, block_len=BLOCK_LEN, hash_seed=HASH_SEED,
                      transports={"tcp": {"host": "127.0.0.5", "port": free_port()}})  # fmt: skip


# -- item 7: bounded in bytes, no takeover, no half-open connections ---------------------------


def test_a_peer_that_sends_big_lookups_and_never_reads_is_cut_off_at_its_budget(
    zmq_context: ZmqContext,
) -> None:
    budget = 4 << 20
    with ServingNode("tcp", max_peer_bytes=budget) as node, LocalNode("tcp") as legit:
        assert_pull_works(legit, node.peer_id)
        attacker = handshaken(RawPeer(zmq_context, node.peer_id))
        assert attacker.router is not None
        try:
            attacker.router.setsockopt(zmq.RCVHWM, 1)  # and from now on it never reads
            keys = tuple(os.urandom(32) for _ in range(4000))  # ~128 KiB per lookup
            for seq in range(400):  # 50 MiB of asks: far past the budget
                attacker.send(Lookup(kv_request_id=f"big-{seq}", keys=keys, round_seq=0))
                if not node.has_session(attacker.peer_id) and seq > 0:
                    break
            assert wait_until(lambda: not node.has_session(attacker.peer_id), 20.0)
            ended = node.statistics().sessions_ended
            assert ended == {"over_budget": 1}  # its asks, or its unread answers
            assert node.has_session(legit.peer_id)
            assert_pull_works(legit, node.peer_id, range(16, 48))
        finally:
            attacker.close()


def test_a_peer_that_bursts_and_reads_none_of_our_answers_is_cut_as_over_budget(
    zmq_context: ZmqContext, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 30, item 4: 500 fetch rounds aborted at once, then aborts for rounds that
    do not exist, and never a read of the answers. The node cuts the peer once what
    waits for it outgrows its bounds, and says why: ``over_budget`` (the peer does
    not read), in the log and in the counts, not ``unreachable``."""
    with ServingNode("tcp") as node, LocalNode("tcp") as legit:
        assert_pull_works(legit, node.peer_id)
        attacker = handshaken(RawPeer(zmq_context, node.peer_id))  # then it reads nothing
        try:
            for seq in range(500):
                kv_id = f"burst-{seq}"
                fetch = Fetch(kv_request_id=kv_id, keys=(b"k",), block_indexes=(0,), round_seq=0)
                attacker.send(fetch)
                attacker.send(AbortFetch(kv_request_id=kv_id, round_seq=0))
            sent = 0
            while node.has_session(attacker.peer_id) and sent < 400_000:
                for _ in range(10_000):  # aborts for rounds that never existed
                    attacker.send(AbortFetch(kv_request_id="nothing", round_seq=sent))
                    sent += 1
            assert wait_until(lambda: not node.has_session(attacker.peer_id), 20.0), sent
            assert node.statistics().sessions_ended == {"over_budget": 1}
            ended = [r.getMessage() for r in caplog.records if " ended (" in r.getMessage()]
            assert ended == [
                f"session {attacker.peer_id} ended (over_budget): the peer does not read: "
                "more than 4096 frames wait for it (max_queued_messages)"
            ]
            assert_pull_works(legit, node.peer_id, range(16, 48))
        finally:
            attacker.close()


def test_a_second_process_claiming_a_live_peer_identity_cannot_end_its_session(
    zmq_context: ZmqContext,
) -> None:
    with ServingNode("tcp") as node, LocalNode("tcp") as legit:
        assert_pull_works(legit, node.peer_id)
        impostor = zmq_context.socket(zmq.DEALER)
        impostor.setsockopt(zmq.LINGER, 0)
        impostor.setsockopt(zmq.IDENTITY, legit.peer_id.encode())
        impostor.connect(f"tcp://{node.peer_id}")
        try:
            impostor.send(CODEC.encode(Disconnect(reason="I am the legit peer, honest")))
            impostor.send(CODEC.encode(_hello(legit.peer_id)))
            for slots in (range(16, 32), range(32, 48), range(48, 64)):
                assert_pull_works(legit, node.peer_id, slots)
                assert node.has_session(legit.peer_id)
            assert node.statistics().sessions_ended == {}
        finally:
            impostor.close()


def test_a_control_connection_that_never_speaks_zmq_is_closed_in_seconds() -> None:
    with ServingNode("tcp") as node:
        host, _, port = node.peer_id.rpartition(":")
        idle = [socket.create_connection((host, int(port))) for _ in range(20)]
        try:
            for conn in idle:
                conn.settimeout(10.0)
            started = time.monotonic()
            for conn in idle:
                try:
                    while conn.recv(4096):
                        pass  # libzmq's greeting, then nothing until it gives up on us
                except (TimeoutError, ConnectionResetError):
                    pass
            assert time.monotonic() - started < 9.0, "half-open connections were kept"
            with LocalNode("tcp") as legit:
                assert_pull_works(legit, node.peer_id)
        finally:
            for conn in idle:
                conn.close()


def test_frames_under_the_nodes_own_identity_are_dropped(
    serve: StartNode, zmq_context: ZmqContext
) -> None:
    """Found by the fuzzer: three connects under the node's own peer id, with fresh
    boot ids, made the node dial itself and abort inside libzmq seconds later."""
    node = serve(plane="tcp")
    mirror = zmq_context.socket(zmq.DEALER)
    mirror.setsockopt(zmq.LINGER, 0)
    mirror.setsockopt(zmq.IDENTITY, node.peer_id.encode())
    mirror.connect(f"tcp://{node.peer_id}")
    try:
        for _ in range(3):
            mirror.send(CODEC.encode(_hello(node.peer_id)))
            time.sleep(0.01)  # the reproduction's pacing, not a wait for anything
    finally:
        mirror.close()
    deadline = time.monotonic() + 4.0  # the abort came about 3 s later
    with LocalNode("tcp") as legit:
        while time.monotonic() < deadline:
            assert_pull_works(legit, node.peer_id)
        assert node.alive()
    assert "Assertion failed" not in node.log()


# -- NIXL metadata is native code's input: only trusted peers' is loaded ------------------------


def _forged_metadata(ours: bytes) -> bytes:
    """The fuzzer's one-frame SIGSEGV: the node's own agent metadata with its agent name
    changed (byte 45) and a descriptor's memory type corrupted (byte 420, bit 5)."""
    forged = bytearray(ours)
    forged[45] ^= 0x40
    if len(forged) > 420:
        forged[420] ^= 0x20
    return bytes(forged)


@pytest.mark.slow  # a nixl node process
@pytest.mark.skipif(not NixlBackend.available(), reason="nixl is not installed")
@pytest.mark.parametrize("extension", [False, True], ids=["vllm-style", "kvpeer-nixl-only"])
def test_an_untrusted_peer_s_nixl_metadata_is_never_loaded(
    serve: StartNode, zmq_context: ZmqContext, extension: bool
) -> None:
    # Trusts only another network with nixl: the plane is loaded (a node that trusts
    # nobody with nixl does not load it at all: test_a_node_trusting_nobody_offers_no_nixl)
    # and the local attacker is not trusted.
    node = serve(plane="tcp,nixl", trust_local_nixl=False, args=["--nixl-peer", "10.99.0.0/16"])
    attacker = RawPeer(zmq_context, node.peer_id)
    try:
        attacker.send(attacker.hello())
        theirs = attacker.wait_for(Connect)
        assert theirs is not None
        assert theirs.agent_metadata, "the node offered no nixl"
        attacker.close()
        attacker = RawPeer(zmq_context, node.peer_id)
        hello = attacker.hello()
        kvpeer = (
            msgspec.structs.replace(hello.kvpeer, transports={"nixl": {}})
            if extension and hello.kvpeer is not None
            else None
        )
        attacker.send(
            msgspec.structs.replace(
                hello,
                agent_metadata=_forged_metadata(theirs.agent_metadata),
                base_addr=theirs.base_addr,  # and aimed at the node's own region
                kvpeer=kvpeer,
            )
        )
        goodbye = attacker.wait_for(Disconnect)
        assert goodbye is not None, f"no refusal; got {attacker.received}"
        assert "not a trusted nixl peer" in goodbye.reason
        assert node.alive()
        with LocalNode("tcp") as legit:
            assert_pull_works(legit, node.peer_id)
        assert node.alive()
    finally:
        attacker.close()


@pytest.mark.slow  # a node process
def test_a_node_trusting_nobody_offers_no_nixl(serve: StartNode, zmq_context: ZmqContext) -> None:
    """Nobody trusted with nixl: the plane is not loaded, so its connect offers no NIXL
    metadata and a peer that offers only nixl finds no plane in common."""
    node = serve(plane="tcp,nixl", trust_local_nixl=False)
    attacker = RawPeer(zmq_context, node.peer_id)
    try:
        attacker.send(attacker.hello())
        theirs = attacker.wait_for(Connect)
        assert theirs is not None
        assert theirs.agent_metadata == b""
        assert theirs.kvpeer is not None
        assert "nixl" not in theirs.kvpeer.transports
        assert node.alive()
    finally:
        attacker.close()


@pytest.mark.skipif(not NixlBackend.available(), reason="nixl is not installed")
def test_nixl_peers_are_trusted_from_the_allow_list_or_nixl_peers() -> None:
    from kvpeer.config import TierConfig

    assert not TierConfig().nixl_trusted().allows("127.0.0.1", 5710)
    listed = TierConfig.from_dict({"allowed_peers": ["10.0.0.0/8"]})
    assert listed.nixl_trusted().allows("10.1.2.3", 5710)
    assert not listed.nixl_trusted().allows("127.0.0.1", 5710)
    only = TierConfig.from_dict({"nixl_peers": ["127.0.0.2/32"]})
    assert only.nixl_trusted().allows("127.0.0.2", 1)
    assert not only.nixl_trusted().allows("127.0.0.1", 1)
