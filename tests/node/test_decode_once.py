"""An inbound frame is decoded once, wherever the peer table sends it.

The table decodes each frame it routes and hands the message on: to the
session, to the refusal memory, to the trace. Counted here by watching
:meth:`Codec.decode` for the inbound frame's bytes (the fake links decode
what goes out; those are other bytes). Before the table decoded once, an
inbound ``connect`` was decoded 3 times on the happy path and up to 6 when
refused.
"""

from __future__ import annotations

import pytest

from kvpeer.protocol import Codec, Lookup
from kvpeer.session import CloseKind
from tests.node.test_peertable import BLOCK_LEN, HANDSHAKE_S, Table, pid


class Decodes:
    """How often :meth:`Codec.decode` saw ``frame``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.frame = b""
        self.count = 0
        decode = Codec.decode

        def counting(codec: Codec, frame: bytes | bytearray | memoryview) -> object:
            if bytes(frame) == self.frame:
                self.count += 1
            return decode(codec, frame)

        monkeypatch.setattr(Codec, "decode", counting)

    def of(self, t: Table, peer_id: str, frame: bytes, source: str | None = "") -> int:
        self.frame, self.count = frame, 0
        t.frame(peer_id, frame, source)
        return self.count


@pytest.fixture
def decodes(monkeypatch: pytest.MonkeyPatch) -> Decodes:
    return Decodes(monkeypatch)


def test_a_first_connect(decodes: Decodes) -> None:
    t = Table()
    assert decodes.of(t, pid(1), t.hello(pid(1))) == 1
    assert t.has(pid(1))


def test_a_frame_of_a_ready_session(decodes: Decodes) -> None:
    t = Table()
    t.ready(pid(1))
    lookup = Codec().encode(Lookup(kv_request_id="r", keys=(b"k",), round_seq=0))
    assert decodes.of(t, pid(1), lookup) == 1


def test_a_connect_the_session_rejects(decodes: Decodes) -> None:
    t = Table()
    assert decodes.of(t, pid(1), t.hello(pid(1), block_len=BLOCK_LEN * 2)) == 1
    assert (pid(1), CloseKind.REJECTED) in t.closed


def test_a_connect_refused_before(decodes: Decodes) -> None:
    t = Table()
    rejected = t.hello(pid(1), block_len=BLOCK_LEN * 2)
    t.frame(pid(1), rejected)
    t.now = HANDSHAKE_S - 1
    assert decodes.of(t, pid(1), rejected) == 1
    assert "refused before" in t.refusals_of(pid(1))[-1]


def test_a_connect_from_a_source_not_allowed(decodes: Decodes) -> None:
    t = Table({"allowed_peers": ["10.0.0.0/8"]})
    peer_id = "192.168.0.7:5710"
    assert decodes.of(t, peer_id, t.hello(peer_id)) == 1
    assert t.refusals_of(peer_id)


def test_a_restarted_peers_connect(decodes: Decodes) -> None:
    t = Table()
    t.ready(pid(1))
    assert decodes.of(t, pid(1), t.hello(pid(1), boot=2)) == 1
    assert (pid(1), CloseKind.RESTARTED) in t.closed
    assert t.has(pid(1))


def test_garbage_in_a_live_session(decodes: Decodes) -> None:
    t = Table()
    t.ready(pid(1))
    assert decodes.of(t, pid(1), b"\xc1garbage") == 1
    assert (pid(1), CloseKind.PROTOCOL_ERROR) in t.closed


def test_a_connect_held_while_the_peer_registers(decodes: Decodes) -> None:
    """Held, then routed again once the registration is ready: still one decode."""
    t = Table(slow=True)
    assert decodes.of(t, pid(1), t.hello(pid(1))) == 1
    t.plane.finish(pid(1))  # type: ignore[attr-defined]
    t.poll()
    assert decodes.count == 1
    peer = t.table.get(pid(1))
    assert peer is not None
    assert peer.session.peer_hello is not None
