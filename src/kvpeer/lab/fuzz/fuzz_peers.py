"""The fuzzer's side of the wire: identities, sinks, and what the node sends back.

Each fuzz identity is a DEALER toward the node whose ZMQ identity is the peer id
it claims, ``127.0.0.1:<port>``. For *listening* identities the fuzzer binds a
ROUTER at that port, so the node's dial-back lands there and everything it sends
(its ``connect``, acks, answers, goodbyes) can be read and counted; *deaf*
identities claim ports nobody listens on; *odd* identities are not peer ids at
all. Refusals come back on the DEALER itself. A *pacer* identity holds a real
session and echoes (``abort_fetch`` of an unknown round -> ``abort_ack``) so the
sender can wait until the node caught up, without waiting for any fuzz frame.

The data-plane sinks are plain TCP listeners that read and discard: one on
127.0.0.1 (where fuzz connections come from) and one on 127.0.0.9, an address no
connection comes from, so a dial there is a dial to an address a peer named.
"""

from __future__ import annotations

import contextlib
import os
import re
import selectors
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import zmq

from kvpeer.errors import ProtocolError
from kvpeer.lab.fuzz.generator import Case
from kvpeer.protocol import (
    PROTOCOL_VERSION,
    AbortAck,
    AbortFetch,
    AckExtension,
    Codec,
    Connect,
    ConnectAck,
    ConnectExtension,
    Disconnect,
    LookupResponse,
    Message,
    TransferDone,
    TransportChoice,
    UnknownMessage,
)

__all__ = ["FuzzPeers", "Reactions", "Sinks", "normalize_reason", "odd_identities"]

ZmqContext = zmq.Context[zmq.Socket[bytes]]
ZmqSocket = zmq.Socket[bytes]

M = TypeVar("M", bound=Message)

_NAMED_HOST = "127.0.0.9"  # a loopback address no fuzz connection comes from
_SEND_BLOCKED_S = 5.0


def odd_identities(node_id: str) -> tuple[bytes, ...]:
    """ZMQ identities that are no usable peer id (and one that claims to be the node)."""
    return (
        b"\xff\xfe\xfd-not-utf8",
        b"no-port-here",
        b"127.0.0.1:0",
        b"127.0.0.1:99999",
        b"127.0.0.1:-1",
        b"[::1]:1",
        b":5710",
        b"i" * 255,
        node_id.encode(),
    )


_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"|b'[^']*'")
_NUMBER = re.compile(r"(?<![A-Za-z_])-?\d+(\.\d+)?")
_HEX = re.compile(r"\b[0-9a-f]{16,}\b")


def normalize_reason(reason: str) -> str:
    """A disconnect reason with its variable parts (ids, numbers) blanked, for counting."""
    text = _QUOTED.sub("'…'", reason)
    text = _HEX.sub("…", text)
    text = _NUMBER.sub("N", text)
    return text[:140]


@dataclass(slots=True)
class Reactions:
    """What the node sent the fuzz identities, by message and disconnect reason."""

    counts: Counter[str] = field(default_factory=Counter)
    frames: int = 0

    def record(self, frame: bytes, codec: Codec) -> None:
        self.frames += 1
        try:
            message = codec.decode(frame)
        except ProtocolError:
            self.counts["undecodable frame"] += 1
            return
        self.counts[describe(message)] += 1

    def merge(self, other: Reactions) -> None:
        self.counts.update(other.counts)
        self.frames += other.frames


def describe(message: Message | UnknownMessage) -> str:
    """How one frame of the node is counted."""
    if isinstance(message, Disconnect):
        return f"disconnect: {normalize_reason(message.reason) or '(no reason)'}"
    if isinstance(message, TransferDone):
        if message.success:
            return "transfer_done: ok"
        return f"transfer_done: failed: {normalize_reason(message.reason or '')}"
    if isinstance(message, UnknownMessage):
        return f"unknown type {message.type!r}"
    if isinstance(message, LookupResponse):
        return "lookup_resp"
    return str(message.__struct_config__.tag)


class Sinks:
    """TCP listeners that accept anything and read it away; dials are counted."""

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._listeners: dict[socket.socket, str] = {}
        self.dials: Counter[str] = Counter()
        self._conns: list[socket.socket] = []
        self.port = self._listen("127.0.0.1", 0, "own")
        self.named_port = 0
        with contextlib.suppress(OSError):  # 127.0.0.9 answers on Linux loopback
            self.named_port = self._listen(_NAMED_HOST, self.port, "named")
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="fuzz-sinks", daemon=True)
        self._thread.start()

    @property
    def addresses(self) -> tuple[tuple[str, int], ...]:
        return (("127.0.0.1", self.port),)

    def _listen(self, host: str, port: int, kind: str) -> int:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            sock.listen(256)
        except OSError:
            sock.close()
            raise
        sock.setblocking(False)
        self._listeners[sock] = kind
        self._selector.register(sock, selectors.EVENT_READ, "listen")
        bound: int = sock.getsockname()[1]
        return bound

    def _run(self) -> None:
        buffer = bytearray(1 << 16)
        while not self._stop:
            for key, _ in self._selector.select(0.5):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if key.data == "wake":
                    return
                if key.data == "listen":
                    with contextlib.suppress(OSError):
                        conn, _ = sock.accept()
                        conn.setblocking(False)
                        self.dials[self._listeners[sock]] += 1
                        self._conns.append(conn)
                        self._selector.register(conn, selectors.EVENT_READ, "conn")
                        if len(self._conns) > 512:  # hold at most this many
                            self._drop(self._conns[0])
                    continue
                try:
                    if sock.recv_into(buffer) == 0:
                        self._drop(sock)
                except BlockingIOError:
                    pass
                except OSError:
                    self._drop(sock)

    def _drop(self, conn: socket.socket) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn)
        with contextlib.suppress(ValueError):
            self._conns.remove(conn)
        conn.close()

    def close(self) -> None:
        self._stop = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._thread.join(5)
        for conn in [*self._conns, *self._listeners]:
            conn.close()
        self._wake_r.close()
        self._wake_w.close()
        self._selector.close()


@dataclass(slots=True)
class _Identity:
    claimed: bytes
    router: ZmqSocket | None  # where the node's dial-back lands (listening identities)
    dealer: ZmqSocket | None = None


@dataclass(frozen=True, slots=True)
class NodeHello:
    """What the node told the pacer in its ``connect``."""

    connect: Connect
    host_id: str
    shm_path: str


class FuzzPeers:
    """Every fuzz identity's sockets, and the reactions they heard."""

    def __init__(
        self,
        listening: int,
        deaf: int,
        *,
        block_len: int,
        hash_seed: str,
        host: str = "127.0.0.1",
    ) -> None:
        self._block_len = block_len
        self._hash_seed = hash_seed
        self.context: ZmqContext = zmq.Context()
        self.codec = Codec()
        self.reactions = Reactions()
        self.send_blocked = 0
        self._identities: list[_Identity] = []
        for _ in range(listening):
            router, port = self._router(host)
            self._identities.append(_Identity(f"{host}:{port}".encode(), router))
        # Deaf identities' ports stay bound (not listening) for the whole run: nobody
        # answers there, and no node or consumer started later can get one of them
        # (a consumer on such a port would be impersonated by a fuzz identity).
        self._reserved = _reserve_ports(host, deaf)
        for sock in self._reserved:
            port = sock.getsockname()[1]
            self._identities.append(_Identity(f"{host}:{port}".encode(), None))
        self._claimed = len(self._identities)
        router, port = self._router(host)
        self._pacer = _Identity(f"{host}:{port}".encode(), router)
        self._pacer_round = 0
        self._pacer_token = os.urandom(16).hex()
        self._poller = zmq.Poller()
        self._node_id = ""

    # -- set-up ------------------------------------------------------------------------------

    @property
    def identities(self) -> tuple[str, ...]:
        """Claimed peer ids, listening ones first (what a Target's ``identities`` are)."""
        return tuple(i.claimed.decode() for i in self._identities[: self._claimed])

    @property
    def listening(self) -> int:
        return sum(1 for i in self._identities[: self._claimed] if i.router is not None)

    @property
    def odd(self) -> tuple[bytes, ...]:
        return tuple(i.claimed for i in self._identities[self._claimed :])

    def _router(self, host: str) -> tuple[ZmqSocket, int]:
        router = self.context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.RCVHWM, 0)
        router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        return router, router.bind_to_random_port(f"tcp://{host}")

    def attach(self, node_id: str) -> None:
        """(Re)connect every identity's DEALER to the node at ``node_id``."""
        self.detach()
        self._node_id = node_id
        del self._identities[self._claimed :]
        self._identities.extend(_Identity(odd, None) for odd in odd_identities(node_id))
        self._poller = zmq.Poller()
        for identity in [*self._identities, self._pacer]:
            dealer = self.context.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.SNDHWM, 10_000)
            dealer.setsockopt(zmq.RCVHWM, 0)
            dealer.setsockopt(zmq.IDENTITY, identity.claimed)
            dealer.connect(f"tcp://{node_id}")
            identity.dealer = dealer
            self._poller.register(dealer, zmq.POLLIN)
            if identity.router is not None:
                self._poller.register(identity.router, zmq.POLLIN)

    def detach(self) -> None:
        for identity in [*self._identities, self._pacer]:
            if identity.dealer is not None:
                self._poller.unregister(identity.dealer)
                identity.dealer.close(linger=0)
                identity.dealer = None

    def close(self) -> None:
        self.detach()
        for identity in [*self._identities, self._pacer]:
            if identity.router is not None:
                identity.router.close(linger=0)
        self.context.destroy(linger=0)
        for sock in self._reserved:
            sock.close()

    # -- the pacer ---------------------------------------------------------------------------

    def handshake_pacer(self, sink_port: int, timeout_s: float = 30.0) -> NodeHello:
        """A well-behaved session from the pacer; the node's own ``connect``."""
        pacer = self._pacer
        assert pacer.dealer is not None
        claimed = pacer.claimed.decode()
        hello = Connect(
            peer_id=claimed,
            agent_metadata=b"",
            base_addr=0,
            num_blocks=1,
            block_len=self._block_len,
            hash_seed=self._hash_seed,
            config_fingerprint="",
            kvpeer=ConnectExtension(
                version=PROTOCOL_VERSION,
                boot_id=os.urandom(16),
                transports={"tcp": {"host": "127.0.0.1", "port": sink_port}},
            ),
        )
        pacer.dealer.send(self.codec.encode(hello))
        node_hello = self._pacer_wait(Connect, timeout_s)
        if node_hello is None:
            raise RuntimeError("the node never sent the pacer its connect")
        ack = ConnectAck(
            peer_id=claimed,
            kvpeer=AckExtension(
                version=PROTOCOL_VERSION,
                transport=TransportChoice(name="tcp", params={"token": self._pacer_token}),
            ),
        )
        pacer.dealer.send(self.codec.encode(ack))
        if self._pacer_wait(ConnectAck, timeout_s) is None:
            raise RuntimeError("the node did not acknowledge the pacer")
        offers = node_hello.kvpeer.transports if node_hello.kvpeer is not None else {}
        shm = offers.get("shm", {})
        return NodeHello(node_hello, str(shm.get("host_id", "")), str(shm.get("path", "")))

    def sync(self, timeout_s: float, alive: Callable[[], bool] = lambda: True) -> float | None:
        """Echo through the pacer's session: seconds until the node answered everything
        the pacer sent so far (and, fair-queued, about as much of every other identity),
        or None if it did not within ``timeout_s`` (or stopped being ``alive``)."""
        pacer = self._pacer
        assert pacer.dealer is not None
        self._pacer_round += 1
        echo = AbortFetch(kv_request_id="fuzz-pacer", round_seq=self._pacer_round)
        started = time.monotonic()
        try:
            pacer.dealer.send(self.codec.encode(echo), zmq.NOBLOCK)
        except zmq.Again:
            return None
        answer = self._pacer_wait(AbortAck, timeout_s, round_seq=self._pacer_round, alive=alive)
        return None if answer is None else time.monotonic() - started

    def _pacer_wait(
        self,
        kind: type[M],
        timeout_s: float,
        round_seq: int | None = None,
        alive: Callable[[], bool] = lambda: True,
    ) -> M | None:
        pacer = self._pacer
        assert pacer.router is not None
        deadline = time.monotonic() + timeout_s
        while True:
            while True:
                try:
                    parts = pacer.router.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(parts) != 2:
                    continue
                with contextlib.suppress(ProtocolError):
                    message = self.codec.decode(parts[1])
                    if isinstance(message, kind) and (
                        round_seq is None or getattr(message, "round_seq", None) == round_seq
                    ):
                        return message
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not alive():
                return None
            self.drain(min(remaining, 0.05))

    # -- fuzzing -----------------------------------------------------------------------------

    def send(self, case: Case) -> bool:
        """Send ``case`` from its identity; False if the node would not take it in time."""
        dealer = self._identities[case.identity].dealer
        assert dealer is not None, "attach() first"
        deadline = 0.0
        while True:
            try:
                dealer.send_multipart(case.parts, zmq.NOBLOCK, copy=False)
                return True
            except zmq.Again:
                pass
            now = time.monotonic()
            if not deadline:
                deadline = now + _SEND_BLOCKED_S
            elif now >= deadline:
                self.send_blocked += 1
                return False
            self.drain(0.01)

    def drain(self, timeout_s: float = 0.0) -> int:
        """Read and count everything the node sent the fuzz identities; frames read."""
        read = 0
        for sock, _ in self._poller.poll(int(timeout_s * 1000)):
            if sock is self._pacer.router:
                continue  # the pacer reads its own
            while True:
                try:
                    parts = sock.recv_multipart(zmq.NOBLOCK, copy=True)
                except zmq.Again:
                    break
                read += 1
                self.reactions.record(parts[-1], self.codec)
        return read

    def goodbye(self) -> None:
        """A ``disconnect`` from every identity: the node's fuzz sessions end now."""
        frame = self.codec.encode(Disconnect(reason="fuzzing done"))
        for identity in self._identities:
            if identity.dealer is not None:
                with contextlib.suppress(zmq.ZMQError):
                    identity.dealer.send(frame, zmq.NOBLOCK)


def _reserve_ports(host: str, count: int) -> list[socket.socket]:
    """``count`` sockets bound to ports of their own, never listening."""
    socks = []
    for _ in range(count):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind((host, 0))
        socks.append(sock)
    return socks
