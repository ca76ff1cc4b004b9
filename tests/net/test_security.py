"""The control port faces the network: allow-lists, CURVE, the peer cap, malformed input.

A refused or misbehaving peer gets nothing and costs only its own session; requests
that depended on it compute locally; every legitimate peer keeps working and the
node's driver never crashes.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

import msgspec
import pytest
import zmq
import zmq.auth

from kvpeer.protocol import (
    ConnectAck,
    Disconnect,
    Fetch,
    Lookup,
    LookupResponse,
    limits,
)
from kvpeer.types import LookupResult
from tests.net.common import free_port, keys_of, wait_until
from tests.net.localnode import LocalNode
from tests.net.processes import NodeProcess, StartNode, start_serve
from tests.net.rawpeer import RawPeer, SilentListener
from tests.net.servingnode import ServingNode

SLACK_S = 2.0
ZmqContext = zmq.Context[zmq.Socket[bytes]]


def assert_pull_works(consumer: LocalNode, peer_id: str, slots: range = range(16)) -> None:
    indexes = list(range(len(slots)))
    result = consumer.pull(peer_id, keys_of(indexes), slots)
    assert (result.hits, result.loaded) == (len(slots), True)
    consumer.assert_blocks(slots, indexes)


def assert_runs_locally(consumer: LocalNode, peer_id: str, within_s: float) -> None:
    """A symmetric pull and a PD load toward ``peer_id`` both end, empty-handed, in time."""
    started = time.monotonic()
    result = consumer.pull(peer_id, keys_of(range(16)), range(16))
    pulled_in = time.monotonic() - started
    assert (result.hits, result.loaded) == (0, False)
    assert pulled_in <= within_s, f"lookups took {pulled_in:.2f}s"
    load = consumer.start_pd_load(peer_id, f"pd-{uuid.uuid4().hex}", keys_of(range(16)), range(16))
    try:
        if load.submitted:  # the session was opened: the load fails when it ends
            assert load.wait() is False
            assert time.monotonic() - load.submitted_at <= within_s
        else:  # no session (any more): the lookups already said "compute locally"
            assert_refused_midway(load.answers)
    finally:
        load.finish()
    assert all(consumer.is_zero(slot) for slot in range(16)), "a refused peer wrote blocks"


def assert_refused_midway(answers: list[LookupResult]) -> None:
    """A PD request's lookups when the peer's refusal came before or during them: a PD
    lookup answers HIT while the session may still come up, MISS once it cannot, so
    the answers are HITs (maybe none) then MISSes (at least one): no load is submitted."""
    assert LookupResult.MISS in answers, answers
    first_miss = answers.index(LookupResult.MISS)
    assert set(answers[:first_miss]) <= {LookupResult.HIT}, answers
    assert set(answers[first_miss:]) == {LookupResult.MISS}, answers


# -- allow-lists ------------------------------------------------------------------------------


def test_allow_list_serves_listed_peers_and_refuses_others(serve: StartNode) -> None:
    friend_port = free_port()
    server = serve(plane="tcp", args=["--allow", f"127.0.0.1:{friend_port}"], wait=False)
    with (
        LocalNode("tcp", port=friend_port) as friend,
        LocalNode("tcp", handshake_timeout_s=1.0, lookup_timeout_s=1.0) as stranger,
    ):
        server.wait_ready()

        assert_runs_locally(stranger, server.peer_id, within_s=1.0 + SLACK_S)
        assert_pull_works(friend, server.peer_id)
        assert not stranger.node.crashed


def test_refused_peer_is_told_at_once(serve: StartNode) -> None:
    """docs/protocol.md §3.2: a connect from a peer that is not allowed is answered with a
    ``disconnect``, so the refused node stops waiting instead of running into its
    handshake timeout (30 s by default) with every request that wanted that peer."""
    server = serve(plane="tcp", args=["--allow", f"127.0.0.1:{free_port()}"], wait=False)
    with LocalNode("tcp", handshake_timeout_s=30.0) as stranger:
        server.wait_ready()
        load = stranger.start_pd_load(
            server.peer_id, f"pd-{uuid.uuid4().hex}", keys_of(range(4)), range(4)
        )
        try:
            # The refusal may be in before the lookups (the connect leaves at once):
            # then they miss and the request computes locally without a load.
            outcome = load.wait(timeout_s=2.0) if load.submitted else False
        finally:
            load.finish()
        assert outcome is False, "the refused peer was never told (load still waiting)"
        if not load.submitted:
            assert_refused_midway(load.answers)


def test_consumer_allow_list_never_dials_an_unlisted_peer(serve: StartNode) -> None:
    server = serve(plane="tcp", wait=False)
    with LocalNode("tcp", allowed_peers=["10.0.0.0/8"]) as consumer:
        server.wait_ready()

        assert_runs_locally(consumer, server.peer_id, within_s=SLACK_S)
        assert consumer.statistics().sessions == 0
        assert consumer.statistics().peers_refused >= 1


def test_allow_list_checks_where_a_connection_comes_from_not_who_it_claims_to_be(
    zmq_context: ZmqContext,
) -> None:
    """Only 127.0.0.2 is allowed. A peer connecting from 127.0.0.1 that *claims* to be
    127.0.0.2 (its ZMQ identity is just a string it picks) must not be served: the
    allow-list ("CIDRs a session is accepted from") is worthless if it trusts claims."""
    with ServingNode("tcp", allowed_peers=["127.0.0.2/32"]) as node:
        # It even listens at the claimed address, so the node's answers reach it.
        impostor = RawPeer(zmq_context, node.peer_id, host="127.0.0.2")
        try:
            impostor.send(impostor.hello())
            impostor.send(impostor.ack())  # blind: frames are handled in order
            impostor.send(Lookup(kv_request_id="spy", keys=tuple(keys_of(range(8))), round_seq=0))

            answer = impostor.wait_for(LookupResponse, timeout_s=2.0)

            assert answer is None, f"an impostor learned what the node caches: {answer}"
            assert not node.has_session(impostor.peer_id)
        finally:
            impostor.close()


# -- CURVE ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CurveFiles:
    secret: str  # the fleet's key pair (every node's client key and server key)
    public: str
    allowed: str  # directory with the fleet's public key
    rogue_secret: str  # a key pair nobody allowed
    rogue_public: str
    rogue_allowed: str  # directory with both public keys

    def config(self, secret: str, server_public: str, allowed: str) -> dict[str, str]:
        return {
            "server_secret_key_file": secret,
            "server_public_key_file": server_public,
            "client_public_keys_dir": allowed,
        }


@pytest.fixture(scope="module")
def curve_files(tmp_path_factory: pytest.TempPathFactory) -> CurveFiles:
    root = tmp_path_factory.mktemp("curve")
    keys, allowed, rogue_allowed = root / "keys", root / "allowed", root / "rogue-allowed"
    for directory in (keys, allowed, rogue_allowed):
        directory.mkdir()
    public, secret = zmq.auth.create_certificates(keys, "fleet")
    rogue_public, rogue_secret = zmq.auth.create_certificates(keys, "rogue")
    shutil.copy(public, allowed)
    shutil.copy(public, rogue_allowed)
    shutil.copy(rogue_public, rogue_allowed)
    return CurveFiles(secret, public, str(allowed), rogue_secret, rogue_public, str(rogue_allowed))


@pytest.fixture(scope="module")
def curve_server(
    curve_files: CurveFiles, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[NodeProcess]:
    files = curve_files
    server = start_serve(
        tmp_path_factory.mktemp("curve-server"),
        plane="tcp",
        args=[
            "--curve-secret",
            files.secret,
            "--curve-server-public",
            files.public,
            "--curve-clients",
            files.allowed,
        ],
    )
    try:
        yield server
    finally:
        server.stop()


def test_curve_with_the_right_keys_pulls_byte_exact(
    curve_files: CurveFiles, curve_server: NodeProcess
) -> None:
    files = curve_files
    curve = files.config(files.secret, files.public, files.allowed)
    with LocalNode("tcp", curve=curve) as consumer:
        assert_pull_works(consumer, curve_server.peer_id, range(64))


@pytest.mark.parametrize("wrong", ["unknown client key", "wrong server key", "no curve"])
def test_curve_with_a_wrong_key_cannot_handshake_and_runs_locally(
    curve_files: CurveFiles, curve_server: NodeProcess, wrong: str
) -> None:
    files = curve_files
    settings: dict[str, object] = {"handshake_timeout_s": 1.5, "lookup_timeout_s": 1.5}
    if wrong == "unknown client key":
        settings["curve"] = files.config(files.rogue_secret, files.public, files.rogue_allowed)
    elif wrong == "wrong server key":
        settings["curve"] = files.config(files.secret, files.rogue_public, files.allowed)
    with LocalNode("tcp", config=settings) as consumer:
        assert_runs_locally(consumer, curve_server.peer_id, within_s=1.5 + SLACK_S)
        assert not consumer.node.crashed
    right = files.config(files.secret, files.public, files.allowed)
    with LocalNode("tcp", curve=right) as consumer:  # the server is unharmed
        assert_pull_works(consumer, curve_server.peer_id)


# -- the peer cap -----------------------------------------------------------------------------


def test_connect_flood_from_many_fake_peers_stays_under_the_peer_cap(
    zmq_context: ZmqContext,
) -> None:
    cap, fakes_per_wave = 8, 40
    sink = SilentListener()  # the data port every fake offers: writers there stay connected
    node = ServingNode("tcp", max_peers=cap)
    fakes: list[RawPeer] = []
    try:
        with LocalNode("tcp") as legit:
            assert_pull_works(legit, node.peer_id)  # an established, idle session
            peak = node.statistics().sessions

            # Wave 1, one at a time: every connect is seen (it holds a session) before the next.
            for _ in range(fakes_per_wave):
                fake = RawPeer(zmq_context, node.peer_id)
                fakes.append(fake)
                fake.send(fake.hello(data_port=sink.port))
                assert wait_until(partial(node.has_session, fake.peer_id))
                peak = max(peak, node.statistics().sessions)
            # Wave 2, all at once, sampled while the node works through it.
            burst = [
                RawPeer(zmq_context, node.peer_id) for _ in range(fakes_per_wave)
            ]
            fakes.extend(burst)
            for fake in burst:
                fake.send(fake.hello(data_port=sink.port))
                peak = max(peak, node.statistics().sessions)
            assert wait_until(lambda: any(node.has_session(f.peer_id) for f in burst))
            for _ in range(50):
                peak = max(peak, node.statistics().sessions)

            assert peak <= cap, f"{peak} sessions with max_peers={cap}"
            assert node.has_session(legit.peer_id), "a ready session lost to handshaking ones"
            assert_pull_works(legit, node.peer_id, range(16, 48))
            with LocalNode("tcp") as newcomer:
                assert_pull_works(newcomer, node.peer_id)
            assert node.statistics().sessions <= cap
            assert not node.node.crashed
            assert wait_until(lambda: _data_writers() <= cap), f"{_data_writers()} writers linger"
    finally:
        for fake in fakes:
            fake.close()
        node.close()
        sink.close()


def _data_writers() -> int:
    return sum(t.name.startswith("kvpeer-tcp-w-") for t in threading.enumerate())


# -- malformed input --------------------------------------------------------------------------


def _raw(**fields: object) -> bytes:
    return msgspec.msgpack.encode(fields)


KEY = keys_of([0])[0]
#: name -> (send a valid connect first?, the offending frame)
MALFORMED: dict[str, tuple[bool, bytes]] = {
    "not msgpack": (False, b"\xc1\x00 garbage"),
    "map without a type": (False, _raw(kv_request_id="x")),
    "fetch missing fields": (False, _raw(type="fetch")),
    "lookup before connect": (
        False,
        _raw(type="lookup", kv_request_id="x", keys=[KEY], round_seq=0),
    ),
    "fetch with mismatched lengths": (
        True,
        _raw(type="fetch", kv_request_id="x", keys=[KEY, KEY], block_indexes=[1], round_seq=0),
    ),
    "fetch outside our region": (
        True,
        _raw(type="fetch", kv_request_id="x", keys=[KEY], block_indexes=[10_000], round_seq=0),
    ),
    "too many keys": (
        True,
        _raw(type="lookup", kv_request_id="x", keys=[KEY] * (limits.MAX_ITEMS + 1), round_seq=0),
    ),
    "bool as an integer": (
        True,
        _raw(type="fetch", kv_request_id="x", keys=[KEY], block_indexes=[True], round_seq=0),
    ),
    "duplicate connect (no boot id)": (True, b"<connect>"),
}


@pytest.fixture
def victim() -> Iterator[tuple[ServingNode, LocalNode]]:
    """A serving node and a legitimate consumer with a ready session to it."""
    with ServingNode("tcp") as node, LocalNode("tcp") as legit:
        assert_pull_works(legit, node.peer_id)
        yield node, legit


def _handshake(peer: RawPeer) -> None:
    peer.send(peer.hello())
    assert peer.wait_for(ConnectAck) is not None, "setup: the node did not accept us"


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_frame_ends_only_that_session(
    victim: tuple[ServingNode, LocalNode],
    zmq_context: ZmqContext,
    caplog: pytest.LogCaptureFixture,
    case: str,
) -> None:
    node, legit = victim
    connect_first, frame = MALFORMED[case]
    caplog.set_level(logging.WARNING, logger="kvpeer.tier")
    attacker = RawPeer(zmq_context, node.peer_id)
    try:
        if connect_first:
            _handshake(attacker)
            assert node.has_session(attacker.peer_id)
        if frame == b"<connect>":  # after the handshake completed (before it, re-acked)
            attacker.send(attacker.ack())
            # vLLM's kind (no boot id); a kvpeer connect here is the peer's next session
            attacker.send(msgspec.structs.replace(attacker.hello(), kvpeer=None))
        else:
            attacker.send_raw(frame)

        def ended() -> bool:
            return any(
                attacker.peer_id in r.getMessage() and "ended (protocol_error)" in r.getMessage()
                for r in caplog.records
            )

        if connect_first:
            assert wait_until(ended), f"no protocol error logged for {case}"
        else:
            # Only a connect opens a session: garbage from a stranger is dropped and
            # counted, and it never makes the node dial the stranger back.
            assert wait_until(lambda: node.statistics().stray_frames >= 1)
        assert not node.has_session(attacker.peer_id)
        assert node.has_session(legit.peer_id)
        assert_pull_works(legit, node.peer_id, range(16, 48))
        assert not node.node.crashed
    finally:
        attacker.close()


def test_a_later_session_of_the_same_peer_renews_its_session(
    victim: tuple[ServingNode, LocalNode],
    zmq_context: ZmqContext,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """kvpeer.session.peer invariant 3: a kvpeer peer's connect with a higher session
    number after it acknowledged ours is its next session. The node ends the old one
    (``renewed``, no goodbye) and answers in a fresh one; a peer doing it again and
    again costs only its own sessions."""
    node, legit = victim
    caplog.set_level(logging.WARNING, logger="kvpeer.tier")
    peer = RawPeer(zmq_context, node.peer_id)
    # Our ROUTER keeps ROUTER_HANDOVER off, as kvpeer's and vLLM's do: each fresh
    # session of the node must reach us on the connection it already has open
    # (zmq_control rule 6), not on a second one under the same identity, which a
    # ROUTER like ours never reads while it holds the first.
    try:
        peer.send(peer.hello(session=1))
        assert peer.wait_for(ConnectAck) is not None, "setup: the node did not accept us"
        peer.send(peer.ack())
        for number in (2, 3, 4):
            peer.drain()
            peer.received.clear()
            peer.send(peer.hello(session=number))
            assert peer.wait_for(ConnectAck) is not None, "no fresh session answered"
            peer.send(peer.ack())
        peer.send(Lookup(kv_request_id="renewed", keys=tuple(keys_of(range(4))), round_seq=0))
        answer = peer.wait_for(LookupResponse)
        assert answer is not None
        assert answer.hits == (True,) * 4
        renewals = [r for r in caplog.records if "ended (renewed)" in r.getMessage()]
        assert len(renewals) == 3
        assert not any("ended (protocol_error)" in r.getMessage() for r in caplog.records)
        assert node.has_session(peer.peer_id)
        assert_pull_works(legit, node.peer_id, range(16, 48))
        assert not node.node.crashed
    finally:
        peer.close()


@pytest.mark.parametrize("parts", ["three frames", "identity not UTF-8"])
def test_frames_of_the_wrong_shape_are_dropped(
    victim: tuple[ServingNode, LocalNode], zmq_context: ZmqContext, parts: str
) -> None:
    node, legit = victim
    identity = b"\xff\xfe\xfd" if parts == "identity not UTF-8" else None
    odd = RawPeer(zmq_context, node.peer_id, identity=identity)
    try:
        if parts == "three frames":
            odd.send_raw(b"one", b"two")
        else:
            odd.send_raw(odd.codec.encode(odd.hello()))
        # A well-formed peer on the same kind of connection is still heard afterwards.
        fine = RawPeer(zmq_context, node.peer_id)
        try:
            _handshake(fine)
        finally:
            fine.close()
        if parts == "three frames":  # same connection, in order: the odd frame came first
            _handshake(odd)
        assert node.statistics().sessions <= 3
        assert_pull_works(legit, node.peer_id, range(16, 48))
        assert not node.node.crashed
    finally:
        odd.close()


def test_unknown_message_type_is_ignored(
    victim: tuple[ServingNode, LocalNode], zmq_context: ZmqContext
) -> None:
    node, _ = victim
    peer = RawPeer(zmq_context, node.peer_id)
    try:
        _handshake(peer)
        peer.send(peer.ack())
        peer.send_raw(_raw(type="from_the_future", payload=[1, 2, 3]))
        peer.send(Lookup(kv_request_id="after", keys=tuple(keys_of(range(4))), round_seq=0))

        answer = peer.wait_for(LookupResponse)

        assert answer is not None
        assert answer.hits == (True,) * 4
        assert node.has_session(peer.peer_id)
    finally:
        peer.close()


@pytest.mark.parametrize("case", ["hash seed mismatch", "fetch outside our region"])
def test_a_rejected_peer_is_told_why(
    victim: tuple[ServingNode, LocalNode], zmq_context: ZmqContext, case: str
) -> None:
    """docs/protocol.md §3.2 and 6: a rejected connect or a protocol error is answered with a
    best-effort ``disconnect`` naming the reason. Without it the other side learns
    nothing and waits out its handshake or load timeout (30 s by default)."""
    node, _ = victim
    peer = RawPeer(zmq_context, node.peer_id)
    try:
        if case == "hash seed mismatch":
            peer.send(peer.hello(hash_seed="another-model"))
        else:
            _handshake(peer)
            peer.send(peer.ack())
            peer.send(Fetch(kv_request_id="x", keys=(KEY,), block_indexes=(10_000,), round_seq=0))

        goodbye = peer.wait_for(Disconnect, timeout_s=2.0)

        assert goodbye is not None, f"no disconnect after {case}; got {peer.received}"
        assert goodbye.reason
    finally:
        peer.close()
