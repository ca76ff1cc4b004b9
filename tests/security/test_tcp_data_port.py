"""The tcp data port faces the network: what a stranger who reaches it can do.

A real ``kvpeer serve`` node (or a node in this process) is attacked from other
loopback addresses (127.0.0.x): floods of idle connections must leave its threads and
file descriptors bounded and never shut out a legitimate writer from another address,
and a peer's offer must never make the node dial a third party (docs/design.md section 7).
Hellos, tokens and deadlines are attacked at the unit level in
tests/transport/test_tcp.py.
"""

from __future__ import annotations

import os
import resource
import select
import socket
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from kvpeer.protocol import Connect
from kvpeer.transport.data.tcpgate import MAX_PENDING
from tests.net.common import free_port, keys_of, wait_until
from tests.net.localnode import LocalNode
from tests.net.processes import StartNode
from tests.net.rawpeer import RawPeer
from tests.transport.test_tcp import dialed, listeners

ZmqContext = zmq.Context[zmq.Socket[bytes]]
FLOOD = 2000
#: Descriptors and threads a node may gain over its baseline while flooded: the pending
#: connections the gate keeps, plus what a working node opens and closes meanwhile.
FD_SLACK = 16
THREAD_SLACK = 4


@pytest.fixture
def many_descriptors() -> Iterator[None]:
    """Room for the flood's client sockets in this process."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < FLOOD + 512:
        pytest.skip(f"descriptor limit {hard} is below {FLOOD + 512}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError(f"no thread count for process {pid}")


def offered_data_port(context: ZmqContext, peer_id: str) -> int:
    """The data port a node offers in its ``connect``: what any peer learns of it."""
    peer = RawPeer(context, peer_id)
    try:
        peer.send(peer.hello())
        hello = peer.wait_for(Connect)
        assert hello is not None, "the node sent no connect"
        assert hello.kvpeer is not None
        port = hello.kvpeer.transports["tcp"]["port"]
        assert isinstance(port, int)
        return port
    finally:
        peer.close()


def connect_from(source: str, port: int) -> socket.socket:
    sock = socket.socket()
    try:
        sock.bind((source, 0))
        sock.settimeout(10.0)
        sock.connect(("127.0.0.1", port))
    except BaseException:
        sock.close()
        raise
    return sock


def ended(socks: list[socket.socket]) -> int:
    """How many of ``socks`` the other side closed (it never sends them a byte)."""
    poller = select.poll()
    for sock in socks:
        poller.register(sock, select.POLLIN | select.POLLRDHUP)
    return len(poller.poll(0))


def assert_pull_works(consumer: LocalNode, peer_id: str, slots: range) -> None:
    indexes = list(slots)
    result = consumer.pull(peer_id, keys_of(indexes), slots)
    assert (result.hits, result.loaded) == (len(indexes), True)
    consumer.assert_blocks(slots, indexes)


def test_idle_connections_leave_the_node_descriptors_and_threads_bounded(
    serve: StartNode, zmq_context: ZmqContext, many_descriptors: None
) -> None:
    """2,000 hello-less connections from 40 addresses: the node keeps at most
    MAX_PENDING of them (no thread each) and goes on serving while they are held."""
    node = serve(plane="tcp")
    flood: list[socket.socket] = []
    with LocalNode("tcp") as consumer:
        assert_pull_works(consumer, node.peer_id, range(16))  # its writer threads exist
        port = offered_data_port(zmq_context, node.peer_id)
        fds_before, threads_before = descriptors(node.pid), threads(node.pid)
        peak_fds, peak_threads = fds_before, threads_before
        try:
            for i in range(FLOOD):
                flood.append(connect_from(f"127.0.0.{20 + i % 40}", port))
                if i % 50 == 0:
                    peak_fds = max(peak_fds, descriptors(node.pid))
                    peak_threads = max(peak_threads, threads(node.pid))
            # The node has seen every connection once it closed all but the ones it keeps.
            assert wait_until(lambda: ended(flood) >= FLOOD - MAX_PENDING), ended(flood)
            peak_fds = max(peak_fds, descriptors(node.pid))
            peak_threads = max(peak_threads, threads(node.pid))
            assert_pull_works(consumer, node.peer_id, range(16, 48))  # during the flood
            peak_fds = max(peak_fds, descriptors(node.pid))
            peak_threads = max(peak_threads, threads(node.pid))
        finally:
            for sock in flood:
                sock.close()
        assert peak_threads <= threads_before + THREAD_SLACK, (
            f"{peak_threads} threads under the flood, {threads_before} before"
        )
        assert peak_fds <= fds_before + MAX_PENDING + FD_SLACK, (
            f"{peak_fds} descriptors under the flood, {fds_before} before"
        )
        # What the flood left behind goes at the latest at the hello deadline (5 s).
        assert wait_until(lambda: descriptors(node.pid) <= fds_before + FD_SLACK)
        assert node.alive()


def test_a_flood_from_some_addresses_does_not_shut_out_a_writer_from_another(
    serve: StartNode, zmq_context: ZmqContext
) -> None:
    """100 idle connections from 13 addresses fill every pending place of a consumer;
    its peer (dialing from 127.0.0.1) still gets in and its blocks land."""
    node = serve(plane="tcp", wait=False)
    with LocalNode("tcp") as consumer:
        port = offered_data_port(zmq_context, consumer.peer_id)
        node.wait_ready()
        flood = [connect_from(f"127.0.0.{10 + i // 8}", port) for i in range(100)]
        try:
            assert_pull_works(consumer, node.peer_id, range(16))
        finally:
            for sock in flood:
                sock.close()
        assert not consumer.node.crashed


def test_a_peer_is_dialed_at_its_own_address_not_the_one_it_offers(
    serve: StartNode, zmq_context: ZmqContext
) -> None:
    """A peer at 127.0.0.1 offers a data port on 127.0.0.9 (a third party): the node
    dials 127.0.0.1 at that port and never 127.0.0.9."""
    node = serve(plane="tcp")
    with listeners("127.0.0.9", "127.0.0.1") as (port, at):
        peer = RawPeer(zmq_context, node.peer_id)
        try:
            hello = peer.hello(data_port=free_port())
            assert hello.kvpeer is not None
            extension = msgspec.structs.replace(
                hello.kvpeer, transports={"tcp": {"host": "127.0.0.9", "port": port}}
            )
            peer.send(msgspec.structs.replace(hello, kvpeer=extension))
            assert dialed(at["127.0.0.1"], 10.0) is not None, "the peer's own host was not dialed"
            assert dialed(at["127.0.0.9"], 0.001) is None, "the node dialed a host a peer named"
        finally:
            peer.close()
