"""The shm plane against hostile local processes: region owners that hand over the wrong
descriptors (or none, or too many), producers that send garbage or hold connections,
and arbitrary offers. Each ends in a refusal with nothing mapped and nothing leaked."""

from __future__ import annotations

import array
import errno
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpeer.errors import DataPlaneError
from kvpeer.protocol import TransportOffer
from kvpeer.testing.conformance import TIMEOUT_S
from kvpeer.transport.data import shm, shmgrant
from kvpeer.transport.data.shm import host_identity
from kvpeer.transport.data.shmgrant import (
    MAX_PENDING,
    MAX_REQUEST_BYTES,
    SOCKET_PREFIX,
    decode_request,
    encode_request,
)
from tests.transport.shmpair import BLOCK, Pair, open_fds_to, pair

__all__ = ["pair"]  # the fixture, imported for pytest

# -- hostile region owners -------------------------------------------------------------------


class FakeOwner:
    """Serves an abstract socket the way a hostile local owner might: answers the
    first request with ``reply`` and the descriptors ``fds()`` returns (or never)."""

    def __init__(self, reply: bytes, fds: Callable[[], list[int]], *, answer: bool = True) -> None:
        self.name = secrets.token_hex(16)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._listener.bind(SOCKET_PREFIX + self.name)
        self._listener.listen(1)
        self._listener.settimeout(TIMEOUT_S)
        self._reply, self._fds, self._answer = reply, fds, answer
        self._done = threading.Event()
        self.request = b""
        self._thread = threading.Thread(target=self._serve, name="test-fake-owner", daemon=True)
        self._thread.start()

    def offer(self, size: int) -> TransportOffer:
        return {"socket": self.name, "size": size, "host_id": host_identity()}

    def _serve(self) -> None:
        conn, _ = self._listener.accept()
        with conn:
            self.request = conn.recv(MAX_REQUEST_BYTES + 1)
            if self._answer:
                fds = self._fds()
                rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                conn.sendmsg([self._reply], rights if fds else [])
                for fd in fds:
                    os.close(fd)
            self._done.wait(TIMEOUT_S)

    def close(self) -> None:
        self._done.set()
        self._thread.join(TIMEOUT_S)
        self._listener.close()


def _opener(path: str, flags: int = os.O_RDWR) -> Callable[[], int]:
    return lambda: os.open(path, flags)


def _pipe_end() -> int:
    read, write = os.pipe()
    os.close(write)
    return read


def _a_socket() -> int:
    return socket.socket(socket.AF_INET, socket.SOCK_STREAM).detach()


def _small_memfd() -> int:
    fd = os.memfd_create("kvpeer-test-small")
    os.ftruncate(fd, 3 * BLOCK)
    return fd


@pytest.fixture
def odd_file(tmp_path: Path) -> str:
    """A file of the consumer's region size that is not anybody's region."""
    path = tmp_path / "odd"
    path.write_bytes(b"o" * 16 * BLOCK)
    return str(path)


HOSTILE: dict[str, tuple[bytes, Callable[[Pair, str], list[Callable[[], int]]], str]] = {
    "extra descriptors": (
        b"\x00",
        lambda pair, odd: [_opener(str(pair.b_pool.shm_path)), _opener(odd)],
        "malformed answer",
    ),
    "more descriptors than we read": (
        b"\x00",
        lambda pair, odd: [_opener(odd)] * (shmgrant.MAX_FDS + 3),
        "malformed answer",
    ),
    "a pipe": (b"\x00", lambda pair, odd: [_pipe_end], "not a regular file"),
    "a socket": (b"\x00", lambda pair, odd: [_a_socket], "not a regular file"),
    "a read-only file": (
        b"\x00",
        lambda pair, odd: [_opener(odd, os.O_RDONLY)],
        "not open for reading and writing",
    ),
    "our own region": (
        b"\x00",
        lambda pair, odd: [_opener(str(pair.a_pool.shm_path))],
        "our own region",
    ),
    "a file of another size": (b"\x00", lambda pair, odd: [_small_memfd], "bytes, not"),
    "no descriptor": (b"\x00", lambda pair, odd: [], "malformed answer"),
    "garbage": (b"\x07" * 300, lambda pair, odd: [_opener(odd)], "malformed answer"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_owner_gets_nothing_mapped_and_leaks_no_descriptor(
    pair: Pair, odd_file: str, case: str
) -> None:
    reply, openers, reason = HOSTILE[case]
    fds = openers(pair, odd_file)
    owner = FakeOwner(reply, lambda: [open_one() for open_one in fds])
    try:
        with pytest.raises(DataPlaneError, match=reason):
            pair.a.add_peer("B", pair.hello_b, owner.offer(16 * BLOCK))
        assert decode_request(owner.request) == ("A", "B")
    finally:
        owner.close()
    assert pair.a.statistics().peers == 0
    assert open_fds_to(odd_file) == []
    with open(odd_file, "rb") as odd:
        assert odd.read() == b"o" * 16 * BLOCK


def test_an_owner_that_never_answers_costs_one_timeout(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shm, "REQUEST_TIMEOUT_S", 0.2)
    owner = FakeOwner(b"", list, answer=False)
    try:
        started = time.monotonic()
        with pytest.raises(DataPlaneError, match="no region"):
            pair.a.add_peer("B", pair.hello_b, owner.offer(16 * BLOCK))
        assert 0.15 < time.monotonic() - started < 1.0
    finally:
        owner.close()


# -- hostile producers (against the owner's server) ------------------------------------------


def _ask(name: str, payload: bytes) -> tuple[bytes, int]:
    """Send ``payload`` to the owner serving ``name``: (reply, descriptors received)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(TIMEOUT_S)
        sock.connect(SOCKET_PREFIX + name)
        sock.send(payload)
        message, ancillary, _, _ = sock.recvmsg(1024, socket.CMSG_SPACE(64))
    fds: list[int] = []
    for _, _, data in ancillary:
        fds.extend(array.array("i", data[: len(data) - len(data) % 4]))
    for fd in fds:
        os.close(fd)
    return message, len(fds)


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"hello",
        encode_request("A", "B")[:-1],
        encode_request("A", "B") + b"x",
        b"\xff" * (MAX_REQUEST_BYTES + 100),
        encode_request("A", "B").replace(b"A", b"\xff"),
    ],
    ids=["empty", "junk", "short", "long", "oversized", "not-utf8"],
)
def test_the_owner_refuses_malformed_requests(pair: Pair, payload: bytes) -> None:
    name = pair.b.offer()["socket"]
    assert isinstance(name, str)
    reply, fds = _ask(name, payload)
    assert (reply[:1], fds) == (b"\x01", 0)
    assert pair.b.statistics().regions_served == 0


def test_the_owner_bounds_connections_that_say_nothing(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MAX_PENDING silent connections hold the owner for SERVE_TIMEOUT_S at most; a
    request behind them waits in the backlog and is then served."""
    monkeypatch.setattr(shmgrant, "SERVE_TIMEOUT_S", 0.2)
    name = pair.b.offer()["socket"]
    assert isinstance(name, str)
    silent = []
    try:
        for _ in range(MAX_PENDING):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            sock.connect(SOCKET_PREFIX + name)
            silent.append(sock)
        started = time.monotonic()
        pair.a.add_peer("B", pair.hello_b, pair.b.offer())
        assert 0.1 < time.monotonic() - started < 5.0  # waited for them, then was served
        for sock in silent:  # each was dropped after its timeout
            sock.settimeout(TIMEOUT_S)
            assert sock.recv(16) == b""
    finally:
        for sock in silent:
            sock.close()
    stats = pair.b.statistics()
    assert (stats.regions_served, stats.requests_refused) == (1, MAX_PENDING)


@given(st.binary(max_size=MAX_REQUEST_BYTES + 8))
def test_decode_request_never_raises(data: bytes) -> None:
    assert decode_request(data) is None or len(decode_request(data) or ()) == 2


@settings(max_examples=40)
@given(st.text(min_size=1, max_size=512), st.text(min_size=1, max_size=512))
def test_requests_round_trip(producer: str, consumer: str) -> None:
    assert decode_request(encode_request(producer, consumer)) == (producer, consumer)


OFFER_KEYS = st.sampled_from(["socket", "size", "host_id", "path", "device", "inode"]) | st.text(
    max_size=32
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_any_offer_is_usable_or_refused_never_an_exception(pair: Pair, data: st.DataObject) -> None:
    values = (
        st.text(max_size=64)
        | st.integers(min_value=-(2**63), max_value=2**63 - 1)
        | st.just(host_identity())
        | st.just(pair.b.offer()["socket"])
        | st.just(pair.a.offer()["socket"])
        | st.just(16 * BLOCK)
        | st.text(alphabet="0123456789abcdef", min_size=32, max_size=32)
    )
    offer = data.draw(st.dictionaries(OFFER_KEYS, values, max_size=6))
    assert pair.a.usable_with(offer, pair.hello_b) in (True, False)
    try:
        assert pair.a.add_peer("B", pair.hello_b, offer) == {}
    except DataPlaneError:
        return
    assert offer.get("socket") == pair.b.offer()["socket"]  # only B's real offer maps
    pair.a.remove_peer("B")


class _FailingListener:
    """A listener whose first ``failures`` accepts fail as if out of descriptors."""

    def __init__(self, inner: socket.socket, failures: int) -> None:
        self._inner = inner
        self.failures = failures
        self.accepts = 0

    def fileno(self) -> int:
        return self._inner.fileno()

    def accept(self) -> tuple[socket.socket, object]:
        self.accepts += 1
        if self.accepts <= self.failures:
            raise OSError(errno.EMFILE, "Too many open files")
        return self._inner.accept()

    def close(self) -> None:
        self._inner.close()


def test_an_owner_out_of_descriptors_pauses_instead_of_spinning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A failed accept leaves the connection pending: polling on at once would wake
    the server in a loop. It pauses, then serves the request."""
    listen = shmgrant._listen
    made: list[_FailingListener] = []

    def failing_listen() -> tuple[str, _FailingListener]:
        name, inner = listen()
        made.append(_FailingListener(inner, failures=2))
        return name, made[-1]

    monkeypatch.setattr(shmgrant, "_listen", failing_listen)
    pair = Pair()
    try:
        started = time.monotonic()
        pair.a.add_peer("B", pair.hello_b, pair.b.offer())
        assert time.monotonic() - started >= 2 * shmgrant._ACCEPT_PAUSE_S * 0.9
        assert made[-1].accepts <= 4  # the two failures, then the request (and EAGAIN)
    finally:
        pair.close()
