"""Hand-driven peers: :class:`RawPeer` (a ZMQ peer that sends whatever a test wants)
and :class:`SilentListener` (a port that accepts and never answers)."""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from typing import TypeVar

import zmq

from kvpeer.protocol import (
    PROTOCOL_VERSION,
    AckExtension,
    Codec,
    Connect,
    ConnectAck,
    Message,
    TransportChoice,
    UnknownMessage,
)
from kvpeer.testing import make_hello
from tests.net.common import BLOCK_LEN, DEADLINE_S, HASH_SEED, free_port

__all__ = [
    "RawPeer",
    "SilentListener",
]

M = TypeVar("M", bound=Message)


class RawPeer:
    """A hand-driven peer: a DEALER that claims to be ``<host>:<port>`` toward a node and,
    with ``listen``, a ROUTER at that address that records what the node sends back.

    The DEALER connects from wherever the kernel picks (127.0.0.1 on loopback),
    whatever ``host`` it claims."""

    def __init__(
        self,
        context: zmq.Context[zmq.Socket[bytes]],
        target: str,
        *,
        listen: bool = True,
        host: str = "127.0.0.1",
        identity: bytes | None = None,
    ) -> None:
        self.codec = Codec()
        self.router: zmq.Socket[bytes] | None = None
        if listen:
            self.router = context.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            port = self.router.bind_to_random_port(f"tcp://{host}")
        else:
            port = free_port(host)
        self.peer_id = f"{host}:{port}"
        self.dealer = context.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.setsockopt(zmq.IDENTITY, identity or self.peer_id.encode())
        host, _, target_port = target.rpartition(":")
        self.dealer.connect(f"tcp://{host}:{target_port}")
        self.boot_id = os.urandom(16)
        self.received: list[Message | UnknownMessage] = []

    def hello(
        self,
        *,
        block_len: int = BLOCK_LEN,
        num_blocks: int = 64,
        hash_seed: str = HASH_SEED,
        data_port: int | None = None,
        session: int | None = None,
    ) -> Connect:
        """A well-formed ``connect`` offering the tcp plane at ``data_port`` (``session``:
        its session number, as kvpeer nodes number theirs)."""
        return make_hello(
            self.peer_id, num_blocks=num_blocks, block_len=block_len, hash_seed=hash_seed,
            boot_id=self.boot_id, session=session,
            transports={"tcp": {"host": "127.0.0.1", "port": data_port or free_port()}},
        )  # fmt: skip

    def ack(self) -> ConnectAck:
        """Our ``connect_ack`` of the node's connect: we "write into it" over tcp."""
        choice = TransportChoice(name="tcp", params={"token": uuid.uuid4().hex})
        return ConnectAck(
            peer_id=self.peer_id, kvpeer=AckExtension(version=PROTOCOL_VERSION, transport=choice)
        )

    def send(self, message: Message) -> None:
        self.send_raw(self.codec.encode(message))

    def send_raw(self, *frames: bytes) -> None:
        self.dealer.send_multipart(list(frames))

    def drain(self) -> None:
        """Record every frame the node has sent us so far."""
        if self.router is None:
            return
        while True:
            try:
                parts = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(parts) == 2:
                self.received.append(self.codec.decode(parts[1]))

    def wait_for(self, kind: type[M], timeout_s: float = DEADLINE_S) -> M | None:
        """The first message of type ``kind`` the node sent us, waiting up to ``timeout_s``."""
        assert self.router is not None, "a peer without a ROUTER hears nothing"
        deadline = time.monotonic() + timeout_s
        while True:
            self.drain()
            for message in self.received:
                if isinstance(message, kind):
                    return message
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            self.router.poll(int(min(remaining, 0.05) * 1000))

    def close(self) -> None:
        self.dealer.close(linger=0)
        if self.router is not None:
            self.router.close(linger=0)


class SilentListener:
    """A plain TCP listener that accepts connections and never sends a byte."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._listener = socket.create_server((host, 0))
        self._listener.settimeout(0.05)
        self.port: int = self._listener.getsockname()[1]
        self.held: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="test-silent", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                self.held.append(self._listener.accept()[0])
            except TimeoutError:
                continue
            except OSError:
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(DEADLINE_S)
        self._listener.close()
        for conn in self.held:
            conn.close()
