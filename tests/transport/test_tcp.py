"""The tcp data plane: the stream protocol, window enforcement, failures, IPv6."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpeer.errors import DataPlaneError, LocalFault
from kvpeer.host import BlockPool
from kvpeer.protocol import Connect
from kvpeer.session.ports import TransferEvent
from kvpeer.testing import make_hello
from kvpeer.testing.conformance import (
    TIMEOUT_S,
    BackendCluster,
    Cluster,
    Windows,
    check_bytes_land_exactly,
    check_unopened_slots_are_refused,
)
from kvpeer.transport.data.base import PrimaryRegion, WriteWindow
from kvpeer.transport.data.tcp import INLINE_BYTES, TcpBackend

BLOCK = 4096
MIB = 1024 * 1024
#: Peer ids as a node names its peers (``host:port`` of their control port): a producer
#: dials the host of the id, at the port of the peer's offer.
A = "127.0.0.1:5701"
B = "127.0.0.1:5702"
CONSUMER_ID = "127.0.0.1:5703"


def hello(num_blocks: int, block_len: int = BLOCK) -> Connect:
    return make_hello("peer", num_blocks=num_blocks, block_len=block_len, hash_seed="seed",
                      fingerprint=None, kvpeer=False)  # fmt: skip


class Side:
    """One node's tcp backend over its own pool."""

    def __init__(
        self,
        num_blocks: int = 16,
        block_len: int = BLOCK,
        host: str = "127.0.0.1",
        *,
        hello_timeout_s: float = 10.0,
        advertise_host: str | None = None,
        trust_offered_hosts: bool = False,
    ) -> None:
        self.pool = BlockPool(num_blocks, block_len)
        self.notified = threading.Event()
        region = PrimaryRegion(self.pool.view, num_blocks, block_len)
        self.backend = TcpBackend(
            region,
            self.notified.set,
            host,
            hello_timeout_s=hello_timeout_s,
            advertise_host=advertise_host,
            trust_offered_hosts=trust_offered_hosts,
        )
        self.window = WriteWindow()

    def block(self, slot: int) -> bytes:
        size = self.pool.block_len
        return bytes(self.pool.view[slot * size : (slot + 1) * size])

    def close(self) -> None:
        self.backend.close()
        self.pool.close()


def link(a: Side, b: Side) -> str:
    """A writes into B (A's add_peer, B's accept_writer); returns the token."""
    params = a.backend.add_peer(B, hello(b.pool.num_blocks, b.pool.block_len), b.backend.offer())
    b.backend.accept_writer(A, params, b.window)
    token = params["token"]
    assert isinstance(token, str)
    return token


def wait_event(side: Side, peer: str, transfer_id: int) -> TransferEvent:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        for event in side.backend.poll(peer):
            assert event.transfer_id == transfer_id
            return event
        time.sleep(0.0005)
    pytest.fail(f"transfer {transfer_id} not reported in {TIMEOUT_S} s")


def raw_connect(side: Side, token: bytes, magic: bytes = b"KVPD") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", side.backend.port), timeout=TIMEOUT_S)
    sock.sendall(magic + bytes([1, len(token)]) + token)
    return sock


def closed_by_peer(sock: socket.socket) -> bool:
    """True once the peer closed ``sock`` (EOF or reset), reading whatever came first."""
    try:
        while chunk := sock.recv(65536):
            del chunk
    except ConnectionResetError:
        pass
    return True


@pytest.fixture
def a() -> Iterator[Side]:
    side = Side()
    yield side
    side.close()


@pytest.fixture
def b() -> Iterator[Side]:
    side = Side()
    yield side
    side.close()


class TestNegotiation:
    def test_offer_is_the_bound_address(self, a: Side) -> None:
        offer = a.backend.offer()
        assert offer == {"host": "127.0.0.1", "port": a.backend.port}
        assert a.backend.port > 0

    def test_advertised_host(self) -> None:
        side = Side(host="0.0.0.0", advertise_host="127.0.0.1")
        try:
            assert side.backend.offer()["host"] == "127.0.0.1"
        finally:
            side.close()

    @pytest.mark.parametrize(
        "offer",
        [None, {}, {"host": "127.0.0.1"}, {"host": "", "port": 1}, {"host": "h", "port": 0}],
    )
    def test_not_usable_without_an_address(self, a: Side, offer: dict[str, str | int]) -> None:
        assert not a.backend.usable_with(offer, hello(16))
        with pytest.raises(DataPlaneError, match="no usable address"):
            a.backend.add_peer(B, hello(16), offer)

    def test_tokens_are_fresh_per_registration(self, a: Side, b: Side) -> None:
        assert link(a, b) != link(a, b)

    def test_bad_token_params_are_refused(self, b: Side) -> None:
        with pytest.raises(DataPlaneError, match="token"):
            b.backend.accept_writer(A, {"token": 7}, b.window)


class TestStream:
    def test_blocks_land_and_notify(self, a: Side, b: Side) -> None:
        link(a, b)
        data = os.urandom(3 * BLOCK)
        a.pool.view[0 : 3 * BLOCK] = data
        b.window.open([4, 5, 9])
        transfer_id = a.backend.write_blocks(B, [0, 1, 2], [4, 5, 9])
        assert wait_event(a, B, transfer_id).success
        assert a.notified.is_set()
        assert b.block(4) + b.block(5) + b.block(9) == data
        assert a.backend.statistics().acked == 1
        assert b.backend.statistics().bytes_received == 3 * BLOCK

    def test_a_small_write_to_an_idle_connection_is_sent_by_the_caller(
        self, a: Side, b: Side
    ) -> None:
        """Up to INLINE_BYTES, write_blocks hands the bytes to the socket itself
        (no writer-thread wake-up)."""
        assert 2 * BLOCK <= INLINE_BYTES
        link(a, b)
        b.window.open(range(16))
        first = a.backend.write_blocks(B, [0], [0])  # connects (the writer thread)
        assert wait_event(a, B, first).success
        sent = a.backend.statistics().bytes_sent

        transfer_id = a.backend.write_blocks(B, [1, 2], [1, 2])

        assert a.backend.statistics().bytes_sent == sent + 2 * BLOCK  # before any wait
        assert wait_event(a, B, transfer_id).success

    def test_connection_may_overtake_the_token(self, a: Side, b: Side) -> None:
        """The data connection arrives before the ack that registers its token."""
        params = a.backend.add_peer(B, hello(16), b.backend.offer())
        b.window.open([0])
        transfer_id = a.backend.write_blocks(B, [0], [0])
        time.sleep(0.05)  # let the hello arrive first: the order under test
        assert a.backend.poll(B) == []
        b.backend.accept_writer(A, params, b.window)
        assert wait_event(a, B, transfer_id).success

    def test_too_many_blocks_in_one_transfer(self, a: Side, b: Side) -> None:
        link(a, b)
        with pytest.raises(DataPlaneError, match="max"):
            a.backend.write_blocks(B, [0] * 70_000, [0] * 70_000)


class TestConsumerRefuses:
    def test_unknown_token_is_closed(self) -> None:
        b = Side(hello_timeout_s=0.2)
        try:
            sock = raw_connect(b, b"0" * 32)
            with sock:
                assert closed_by_peer(sock)
            assert b.backend.statistics().rejected_connections == 1
        finally:
            b.close()

    def test_bad_hello_is_closed(self, b: Side) -> None:
        with raw_connect(b, b"0" * 32, magic=b"HTTP") as sock:
            assert closed_by_peer(sock)
        assert b.backend.statistics().rejected_connections == 1

    def test_window_violation_fails_the_transfer(self, a: Side, b: Side) -> None:
        link(a, b)
        b.pool.view[0:BLOCK] = bytes(BLOCK)
        a.pool.view[0:BLOCK] = b"\xff" * BLOCK
        transfer_id = a.backend.write_blocks(B, [0], [0])  # slot 0 not opened
        event = wait_event(a, B, transfer_id)
        assert not event.success
        assert event.reason.startswith("tcp: ")
        assert b.block(0) == bytes(BLOCK)
        assert b.backend.statistics().refused == 1
        # The writer reconnects for the next transfer.
        b.window.open([0])
        assert wait_event(a, B, a.backend.write_blocks(B, [0], [0])).success
        assert b.block(0) == b"\xff" * BLOCK

    @pytest.mark.parametrize(
        ("count", "slot"), [(70_000, 0), (1, 16), (1, 2**63)], ids=["count", "range", "huge"]
    )
    def test_forged_headers_are_refused_before_bytes(self, b: Side, count: int, slot: int) -> None:
        """A producer that skips its own checks gets status 1 and a closed stream."""
        b.backend.accept_writer(A, {"token": "ab" * 16}, b.window)
        b.window.open(range(16))
        with raw_connect(b, b"ab" * 16) as sock:
            slots = struct.pack("!Q", slot) * min(count, 4)
            sock.sendall(struct.pack("!QI", 7, count) + slots)
            if count == len(slots) // 8:
                sock.sendall(b"\x01" * BLOCK)
            reply = sock.recv(9)
            assert reply == struct.pack("!QB", 7, 1)
            assert closed_by_peer(sock)
        assert b.backend.statistics().bytes_received == 0


class TestFailures:
    def test_unreachable_peer_fails_the_transfer(self, a: Side) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]  # nobody listens on it
        a.backend.add_peer(B, hello(16), {"host": "127.0.0.1", "port": port})
        event = wait_event(a, B, a.backend.write_blocks(B, [0], [0]))
        assert not event.success
        assert "cannot connect" in event.reason

    def test_consumer_removing_us_fails_our_transfers(self, a: Side) -> None:
        b = Side(hello_timeout_s=0.2)
        try:
            link(a, b)
            b.window.open([0])
            assert wait_event(a, B, a.backend.write_blocks(B, [0], [0])).success
            b.backend.remove_peer(A)
            # The stream is closed; a reconnect is refused: the token is gone.
            event = wait_event(a, B, a.backend.write_blocks(B, [0], [0]))
            assert not event.success
        finally:
            b.close()

    def test_producer_removing_the_peer_reports_nothing(self, a: Side, b: Side) -> None:
        link(a, b)
        b.window.open([0])
        transfer_id = a.backend.write_blocks(B, [0], [0])
        a.backend.remove_peer(B)
        assert a.backend.poll(B) == []
        assert a.backend.cancel([transfer_id], wait=True) == []
        with pytest.raises(DataPlaneError, match="not registered"):
            a.backend.write_blocks(B, [0], [0])

    def test_close_frees_the_port(self) -> None:
        side = Side()
        port = side.backend.port
        side.close()
        side.backend.close()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S).close()


CONSUMER = textwrap.dedent(
    """
    import sys
    from kvpeer.host import BlockPool
    from kvpeer.transport.data.base import PrimaryRegion, WriteWindow
    from kvpeer.transport.data.tcp import INLINE_BYTES, TcpBackend

    pool = BlockPool(64, 1024 * 1024)
    backend = TcpBackend(PrimaryRegion(pool.view, 64, 1024 * 1024), lambda: None)
    print(backend.port, flush=True)
    window = WriteWindow()
    window.open(range(64))
    backend.accept_writer("producer", {"token": sys.stdin.readline().strip()}, window)
    print("ready", flush=True)
    sys.stdin.readline()
    """
)


def test_consumer_process_dying_mid_transfer_fails_it() -> None:
    """The consumer stops reading (SIGSTOP) with a transfer half sent, then dies."""
    child = subprocess.Popen(
        [sys.executable, "-c", CONSUMER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    producer = Side(num_blocks=64, block_len=MIB)
    try:
        assert child.stdin is not None
        assert child.stdout is not None
        port = int(child.stdout.readline())
        params = producer.backend.add_peer(
            CONSUMER_ID, hello(64, MIB), {"host": "127.0.0.1", "port": port}
        )
        child.stdin.write(f"{params['token']}\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "ready"
        child.send_signal(signal.SIGSTOP)
        big = producer.backend.write_blocks(CONSUMER_ID, range(64), range(64))
        queued = producer.backend.write_blocks(CONSUMER_ID, [0], [0])
        deadline = time.monotonic() + TIMEOUT_S
        while producer.backend.statistics().in_flight == 0 and time.monotonic() < deadline:
            time.sleep(0.001)  # until the writer is sending (it blocks: nobody reads)
        assert producer.backend.statistics().in_flight == 1
        assert producer.backend.poll(CONSUMER_ID) == []
        # Partly sent: busy until acked or dead; the one behind it is released.
        assert producer.backend.cancel([big, queued], wait=True) == [big]
        child.kill()
        event = wait_event(producer, CONSUMER_ID, big)
        assert not event.success
        assert producer.backend.poll(CONSUMER_ID) == []
        stats = producer.backend.statistics()
        assert (stats.queued, stats.in_flight, stats.failed, stats.acked) == (0, 0, 1, 0)
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
        producer.close()


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


def tcp6_cluster() -> Cluster:
    """Conformance names nodes "A", "B", not addresses: their offers name the host."""
    return BackendCluster(
        lambda region, notify: TcpBackend(region, notify, host="::1", trust_offered_hosts=True),
        shm=False,
        windows=Windows.REFUSED,
    )


@pytest.mark.skipif(not ipv6_loopback(), reason="this machine cannot bind ::1")
class TestIPv6:
    def test_offer_and_transfer(self) -> None:
        side = Side(host="::1")
        try:
            assert side.backend.offer()["host"] == "::1"
        finally:
            side.close()
        check_bytes_land_exactly(tcp6_cluster)

    def test_windows(self) -> None:
        check_unopened_slots_are_refused(tcp6_cluster)


# -- a hostile peer on the data port ------------------------------------------------------------

#: Scheduling slack on top of a deadline the backend promises (a busy 2-core machine).
SLACK_S = 1.5
TOKEN = b"ab" * 16


def eventually(predicate: Callable[[], bool], timeout_s: float = TIMEOUT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)
    return True


def hello_bytes(token: bytes, *, magic: bytes = b"KVPD", version: int = 1) -> bytes:
    return magic + bytes([version, len(token)]) + token


def transfer_bytes(transfer_id: int, slot: int, fill: int) -> bytes:
    return struct.pack("!QIQ", transfer_id, 1, slot) + bytes([fill]) * BLOCK


def dial(side: Side, source: str = "127.0.0.1") -> socket.socket:
    """A connection to ``side``'s data port from ``source`` (any 127.0.0.x is loopback)."""
    sock = socket.socket()
    try:
        sock.bind((source, 0))
        sock.settimeout(TIMEOUT_S)
        sock.connect(("127.0.0.1", side.backend.port))
    except BaseException:
        sock.close()
        raise
    return sock


def closed_within(sock: socket.socket, timeout_s: float) -> bool:
    """Whether the peer closes ``sock`` (EOF or reset) within ``timeout_s``, reading
    whatever came first."""
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            if not sock.recv(65536):
                return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


class TestHelloDeadline:
    def test_a_dripped_hello_is_closed_at_its_deadline(self) -> None:
        """One byte every 0.1 s: each byte used to restart the timeout, so the hello
        (38 bytes, 3.8 s) outlived a 0.5 s timeout and bound."""
        b = Side(hello_timeout_s=0.5)
        try:
            b.backend.accept_writer(A, {"token": TOKEN.decode()}, b.window)
            with dial(b) as sock:
                started, closed = time.monotonic(), False
                for byte in hello_bytes(TOKEN):
                    try:
                        sock.send(bytes([byte]))
                    except OSError:
                        closed = True
                    if closed or closed_within(sock, 0.1):
                        closed = True
                        break
                elapsed = time.monotonic() - started
            assert closed, "a hello dripped byte by byte was never dropped"
            assert elapsed < 0.5 + SLACK_S
            stats = b.backend.statistics()
            assert (stats.inbound, stats.pending, stats.rejected_connections) == (0, 0, 1)
        finally:
            b.close()


class TestPendingCaps:
    def test_one_source_holds_at_most_8_pending_connections(self, a: Side, b: Side) -> None:
        flood = [dial(b, "127.0.0.7") for _ in range(20)]
        try:
            assert eventually(lambda: b.backend.statistics().evicted == 12)
            assert b.backend.statistics().pending == 8
            assert all(closed_within(sock, TIMEOUT_S) for sock in flood[:12]), "oldest first"
            assert not any(closed_within(sock, 0.001) for sock in flood[12:])
            link(a, b)
            b.window.open([0])
            assert wait_event(a, B, a.backend.write_blocks(B, [0], [0])).success
        finally:
            for sock in flood:
                sock.close()

    def test_a_full_gate_takes_a_writer_from_another_source(self, a: Side, b: Side) -> None:
        """64 idle connections from 8 addresses; a writer from a 9th still binds, and the
        oldest connection of a source holding the most makes room for it."""
        flood = [dial(b, f"127.0.0.{10 + i // 8}") for i in range(64)]
        try:
            assert eventually(lambda: b.backend.statistics().pending == 64)
            link(a, b)
            b.window.open([0])
            a.pool.view[0:BLOCK] = b"\x07" * BLOCK
            assert wait_event(a, B, a.backend.write_blocks(B, [0], [0])).success
            assert b.block(0) == b"\x07" * BLOCK
            stats = b.backend.statistics()
            assert (stats.evicted, stats.pending, stats.inbound) == (1, 63, 1)
            assert closed_within(flood[0], TIMEOUT_S)
            assert not any(closed_within(sock, 0.001) for sock in flood[1:])
        finally:
            for sock in flood:
                sock.close()


class TestTokens:
    @pytest.mark.parametrize(
        "hello",
        [
            b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
            hello_bytes(TOKEN, version=2),
            b"KVPD\x01\x00",
            hello_bytes(b"a" * 15),
            b"KVPD\x01\x10" + b"\xff" * 16,
            hello_bytes(b"ab cd" * 4),
        ],
        ids=["http", "version", "empty-token", "short-token", "not-ascii", "space"],
    )
    def test_a_garbage_hello_is_closed_at_once(self, hello: bytes) -> None:
        b = Side(hello_timeout_s=60.0)  # closing in time is not the deadline's doing
        try:
            with dial(b) as sock:
                sock.sendall(hello)
                assert closed_within(sock, TIMEOUT_S)
            stats = b.backend.statistics()
            assert (stats.rejected_connections, stats.pending, stats.inbound) == (1, 0, 0)
        finally:
            b.close()

    def test_a_forged_token_never_binds(self, a: Side) -> None:
        b = Side(hello_timeout_s=0.5)
        try:
            link(a, b)  # a token is registered, just not this one
            b.window.open([1])
            with dial(b) as sock:
                sock.sendall(hello_bytes(b"cd" * 16) + transfer_bytes(1, 1, 0xFF))
                assert closed_within(sock, 0.5 + SLACK_S)
            assert b.block(1) == bytes(BLOCK)
            assert b.backend.statistics().rejected_connections == 1
            assert wait_event(a, B, a.backend.write_blocks(B, [0], [1])).success
        finally:
            b.close()

    def test_a_replayed_token_does_not_bind_while_its_connection_lives(self, a: Side) -> None:
        b = Side(hello_timeout_s=0.5)
        try:
            token = link(a, b)
            b.window.open([0, 1])
            assert wait_event(a, B, a.backend.write_blocks(B, [0], [0])).success
            with dial(b, "127.0.0.8") as replay:
                replay.sendall(hello_bytes(token.encode()) + transfer_bytes(1, 1, 0xFF))
                assert closed_within(replay, 0.5 + SLACK_S)
            assert b.block(1) == bytes(BLOCK), "a replayed token wrote into our region"
            assert b.backend.statistics().inbound == 1
            assert wait_event(a, B, a.backend.write_blocks(B, [0], [0])).success
        finally:
            b.close()

    def test_a_token_binds_again_once_its_connection_ended(self, b: Side) -> None:
        """The producer reconnects with its token after a broken connection; a hello
        that comes while the old connection still lives waits for it to end."""
        b.backend.accept_writer(A, {"token": TOKEN.decode()}, b.window)
        b.window.open([0, 1])
        first = dial(b)
        second = dial(b)
        try:
            first.sendall(hello_bytes(TOKEN) + transfer_bytes(1, 0, 0x01))
            assert first.recv(9) == struct.pack("!QB", 1, 0)
            second.sendall(hello_bytes(TOKEN) + transfer_bytes(2, 1, 0x02))
            second.settimeout(0.2)
            with pytest.raises(TimeoutError):
                second.recv(9)  # not bound: the first connection holds the token
            first.close()
            second.settimeout(TIMEOUT_S)
            assert second.recv(9) == struct.pack("!QB", 2, 0)
            assert b.block(1) == b"\x02" * BLOCK
        finally:
            first.close()
            second.close()

    def test_a_token_another_peer_registered_is_refused(self, b: Side) -> None:
        b.backend.accept_writer(A, {"token": TOKEN.decode()}, b.window)
        with pytest.raises(DataPlaneError, match="another peer"):
            b.backend.accept_writer(B, {"token": TOKEN.decode()}, WriteWindow())

    def test_a_new_token_ends_the_connection_of_the_old(self, b: Side) -> None:
        b.backend.accept_writer(A, {"token": TOKEN.decode()}, b.window)
        b.window.open([0])
        with dial(b) as sock:
            sock.sendall(hello_bytes(TOKEN) + transfer_bytes(1, 0, 0x01))
            assert sock.recv(9) == struct.pack("!QB", 1, 0)
            b.backend.accept_writer(A, {"token": "cd" * 16}, b.window)
            assert closed_within(sock, TIMEOUT_S)
        assert eventually(lambda: b.backend.statistics().inbound == 0)


@contextlib.contextmanager
def listeners(*hosts: str) -> Iterator[tuple[int, dict[str, socket.socket]]]:
    """Plain listeners on one port at each of ``hosts``."""
    for _ in range(20):
        opened: dict[str, socket.socket] = {}
        try:
            port = 0
            for host in hosts:
                family = socket.AF_INET6 if ":" in host else socket.AF_INET
                opened[host] = socket.create_server((host, port), family=family)
                port = opened[host].getsockname()[1]
        except OSError:  # that port is taken at another of the hosts: try another
            for sock in opened.values():
                sock.close()
            continue
        try:
            yield port, opened
        finally:
            for sock in opened.values():
                sock.close()
        return
    pytest.fail(f"no port free at all of {hosts}")


def dialed(listener: socket.socket, timeout_s: float) -> bytes | None:
    """The hello of a connection ``listener`` got within ``timeout_s``, or None."""
    listener.settimeout(timeout_s)
    try:
        conn, _ = listener.accept()
    except TimeoutError:
        return None
    hello = b""
    with conn:
        conn.settimeout(TIMEOUT_S)
        while len(hello) < 6 + 32 and (chunk := conn.recv(6 + 32 - len(hello))):
            hello += chunk
    return hello


class TestDialing:
    """Nothing a peer names is dialed blindly (docs/design.md section 7)."""

    def test_the_peer_is_dialed_at_its_own_host_not_the_one_it_offers(self, a: Side) -> None:
        with listeners("127.0.0.9", "127.0.0.1") as (port, at):
            params = a.backend.add_peer(B, hello(16), {"host": "127.0.0.9", "port": port})
            assert dialed(at["127.0.0.1"], TIMEOUT_S) == hello_bytes(str(params["token"]).encode())
            assert dialed(at["127.0.0.9"], 0.001) is None, "the offered host was dialed"

    def test_offered_hosts_are_dialed_when_trusted(self) -> None:
        side = Side(trust_offered_hosts=True)
        try:
            with listeners("127.0.0.9", "127.0.0.1") as (port, at):
                side.backend.add_peer(B, hello(16), {"host": "127.0.0.9", "port": port})
                assert dialed(at["127.0.0.9"], TIMEOUT_S) is not None
                assert dialed(at["127.0.0.1"], 0.001) is None
        finally:
            side.close()

    @pytest.mark.skipif(not socket.has_ipv6, reason="no IPv6")
    def test_a_bracketed_ipv6_peer_id_is_dialed_at_its_host(self, a: Side) -> None:
        if not ipv6_loopback():
            pytest.skip("this machine cannot bind ::1")
        with listeners("::1") as (port, at):
            a.backend.add_peer("[::1]:5702", hello(16), {"host": "127.0.0.9", "port": port})
            assert dialed(at["::1"], TIMEOUT_S) is not None

    @pytest.mark.parametrize(
        "peer_id", ["B", "", ":5702", "::1:5702", "[::1]", "host:0", "host:65536", "host:x"]
    )
    def test_a_peer_id_without_a_host_is_not_dialed(self, a: Side, peer_id: str) -> None:
        with pytest.raises(DataPlaneError, match="names no host"):
            a.backend.add_peer(peer_id, hello(16), {"host": "127.0.0.1", "port": 5702})
        assert a.backend.statistics().writers == 0

    @pytest.mark.parametrize("host", ["h" * 64, "a." + "b" * 70 + ".c"])
    def test_a_host_the_resolver_refuses_fails_the_writer_not_the_thread(
        self, a: Side, host: str
    ) -> None:
        """A name with a label over 63 characters makes ``getaddrinfo`` raise
        UnicodeError, not OSError: the writer fails, no thread dies."""
        a.backend.add_peer(f"{host}:5702", hello(16), {"host": "127.0.0.1", "port": 5702})
        transfer = a.backend.write_blocks(f"{host}:5702", [0], [0])
        assert eventually(lambda: bool(a.backend.poll(f"{host}:5702")))
        assert transfer > 0

    @pytest.mark.parametrize("port", [0, -1, 65536, True, "5702", 2**40])
    def test_the_offered_port_is_checked(self, a: Side, port: int | str) -> None:
        offer: dict[str, str | int] = {"host": "127.0.0.1", "port": port}
        assert not a.backend.usable_with(offer, hello(16))
        with pytest.raises(DataPlaneError, match="no usable address"):
            a.backend.add_peer(B, hello(16), offer)


def test_dialing_works_with_descriptors_past_1023() -> None:
    """``select()`` cannot wait on descriptor 1024 or above; a busy node has such."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"descriptor limit {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    filler: list[int] = []
    try:
        while not filler or filler[-1] < 1100:
            filler.append(os.open(os.devnull, os.O_RDONLY))
        a, b = Side(), Side()
        try:
            link(a, b)
            b.window.open([0])
            assert wait_event(a, B, a.backend.write_blocks(B, [0], [0])).success
        finally:
            a.close()
            b.close()
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


class TestErrors:
    """A peer's bad value is a DataPlaneError; our own trouble is a LocalFault."""

    def test_a_closed_backend_is_a_local_fault(self) -> None:
        side = Side()
        side.close()
        with pytest.raises(LocalFault):
            side.backend.add_peer(B, hello(16), {"host": "127.0.0.1", "port": 5702})
        with pytest.raises(LocalFault):
            side.backend.accept_writer(A, {"token": TOKEN.decode()}, side.window)
        with pytest.raises(LocalFault):
            side.backend.write_blocks(B, [0], [0])

    def test_a_port_we_cannot_listen_on_is_a_local_fault(self, a: Side) -> None:
        pool = BlockPool(4, BLOCK)
        try:
            with pytest.raises(LocalFault, match="cannot listen"):
                TcpBackend(PrimaryRegion(pool.view, 4, BLOCK), lambda: None, port=a.backend.port)
        finally:
            pool.close()

    def test_peer_values_raise_nothing_but_data_plane_errors(self, a: Side) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            closed_port = probe.getsockname()[1]  # a valid offer dials nobody there
        values = st.one_of(st.text(max_size=300), st.integers(), st.booleans())
        keys = st.one_of(st.sampled_from(["token", "host", "port"]), st.text(max_size=8))
        peer_ids = st.sampled_from([B, "[::1]:5702", "B", "", ":1", "h:0", "[::1]", "::1:9"])

        @settings(max_examples=300, deadline=None)
        @given(params=st.dictionaries(keys, values, max_size=4), peer_id=peer_ids)
        def fuzz(params: dict[str, str | int], peer_id: str) -> None:
            port = params.get("port")
            if isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536:
                params["port"] = closed_port
            assert isinstance(a.backend.usable_with(params, hello(16)), bool)
            with contextlib.suppress(DataPlaneError):
                a.backend.add_peer(peer_id, hello(16), params)
            a.backend.remove_peer(peer_id)
            with contextlib.suppress(DataPlaneError):
                a.backend.accept_writer(peer_id, params, WriteWindow())

        fuzz()
        assert a.backend.statistics().writers == 0
