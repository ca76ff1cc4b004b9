"""The shm data plane: its offer, the same-host proof (grants, credentials, the plane
set's fallback), copies, and safe unmapping. Hostile owners and producers:
test_shm_hostile.py."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from kvpeer.errors import DataPlaneError, LocalFault
from kvpeer.host import BlockPool
from kvpeer.protocol import PROTOCOL_VERSION, Connect, ConnectExtension, TransportOffer
from kvpeer.testing.conformance import TIMEOUT_S
from kvpeer.transport.data import shm
from kvpeer.transport.data.base import WriteWindow
from kvpeer.transport.data.planes import DataPlaneSet
from kvpeer.transport.data.shm import INLINE_BYTES, PREFAULT_BYTES, ShmBackend, host_identity
from kvpeer.transport.data.shmgrant import is_socket_name
from kvpeer.transport.data.tcp import TcpBackend
from tests.transport.shmpair import (
    BLOCK,
    Pair,
    backend,
    hello,
    open_fds_to,
    pair,
    region_of,
    shm_path,
    wait_event,
)

__all__ = ["pair"]  # the fixture, imported for pytest

# -- the offer ---------------------------------------------------------------------------


def test_needs_a_shared_file() -> None:
    pool = BlockPool(2, BLOCK)
    try:
        with pytest.raises(DataPlaneError, match="shared-memory file"):
            backend(pool, "A")
    finally:
        pool.close()


def test_offer_names_a_socket_size_and_host_but_no_file(pair: Pair) -> None:
    offer = pair.b.offer()
    assert set(offer) == {"socket", "size", "host_id"}
    assert is_socket_name(offer["socket"])
    assert offer["socket"] != pair.a.offer()["socket"]
    assert offer["size"] == 16 * BLOCK
    assert offer["host_id"] == host_identity()
    assert pair.a.usable_with(offer, pair.hello_b)


def _other_hex() -> str:
    return secrets.token_hex(16)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"host_id": "another-host"}, "another host"),
        ({"socket": None}, "socket name"),
        ({"socket": "ABCDEF0123456789ABCDEF0123456789"}, "socket name"),  # uppercase
        ({"socket": "0123456789abcdef0123456789abcde"}, "socket name"),  # 31 characters
        ({"socket": "0123456789abcdef0123456789abcdeg"}, "socket name"),
        ({"socket": "../../../dev/shm/x"}, "socket name"),
        ({"socket": 12345}, "socket name"),
        ({"size": 8 * BLOCK}, "size"),
        ({"size": str(16 * BLOCK)}, "size"),
        ({"size": None}, "size"),
    ],
    ids=[
        "other-host",
        "no-socket",
        "uppercase-hex",
        "short-hex",
        "not-hex",
        "a-path",
        "an-int",
        "wrong-size",
        "size-as-text",
        "no-size",
    ],
)
def test_malformed_offers_are_not_usable(
    pair: Pair, change: dict[str, object], reason: str
) -> None:
    offer = {k: v for k, v in {**pair.b.offer(), **change}.items() if v is not None}
    assert not pair.a.usable_with(offer, pair.hello_b)  # type: ignore[arg-type]
    with pytest.raises(DataPlaneError, match=reason):
        pair.a.add_peer("B", pair.hello_b, offer)  # type: ignore[arg-type]
    assert pair.b.statistics().regions_served == 0


def test_a_size_that_differs_from_the_connect_is_not_usable(pair: Pair) -> None:
    assert not pair.a.usable_with(pair.b.offer(), hello(8))
    assert not pair.a.usable_with(None, pair.hello_b)


def test_an_old_style_offer_naming_a_file_is_never_opened(pair: Pair, tmp_path: Path) -> None:
    """The bug this plane had: a peer named any file of the right size and we wrote it."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"v" * 16 * BLOCK)
    offer: TransportOffer = {"path": str(victim), "size": 16 * BLOCK, "host_id": host_identity()}
    assert not pair.a.usable_with(offer, pair.hello_b)
    with pytest.raises(DataPlaneError):
        pair.a.add_peer("B", pair.hello_b, offer)
    assert open_fds_to(str(victim)) == []
    assert victim.read_bytes() == b"v" * 16 * BLOCK


def test_our_own_offer_is_refused(pair: Pair) -> None:
    """A peer that copies our offer into its connect must not make us map our region."""
    own = {**pair.a.offer(), "size": 16 * BLOCK}
    assert not pair.a.usable_with(own, pair.hello_b)
    with pytest.raises(DataPlaneError, match="our own socket"):
        pair.a.add_peer("B", pair.hello_b, own)


def test_a_socket_nobody_serves_fails_fast(pair: Pair) -> None:
    offer = {**pair.b.offer(), "socket": _other_hex()}
    assert pair.a.usable_with(offer, pair.hello_b)  # well-formed: the proof decides
    started = time.monotonic()
    with pytest.raises(DataPlaneError, match="no region"):
        pair.a.add_peer("B", pair.hello_b, offer)
    assert time.monotonic() - started < 0.5
    assert pair.a.statistics().peers == 0


# -- grants --------------------------------------------------------------------------------


def test_an_ungranted_producer_is_refused_with_a_reason(pair: Pair) -> None:
    pair.b.revoke("A")
    with pytest.raises(DataPlaneError, match="owner refused: 'A' holds no session"):
        pair.a.add_peer("B", pair.hello_b, pair.b.offer())
    stats = pair.b.statistics()
    assert (stats.granted, stats.regions_served, stats.requests_refused) == (0, 0, 1)
    assert pair.a.statistics().peers == 0


def test_grant_then_revoke(pair: Pair) -> None:
    assert pair.b.statistics().granted == 1
    pair.a.add_peer("B", pair.hello_b, pair.b.offer())
    assert pair.b.statistics().regions_served == 1
    pair.b.revoke("A")
    pair.b.revoke("A")  # idempotent
    assert pair.b.statistics().granted == 0
    with pytest.raises(DataPlaneError, match="holds no session"):
        pair.a.add_peer("B", pair.hello_b, pair.b.offer())
    pair.b.grant("A")
    pair.a.add_peer("B", pair.hello_b, pair.b.offer())
    assert pair.b.statistics().regions_served == 2


def test_a_request_on_behalf_of_another_peer_is_refused(pair: Pair) -> None:
    """Relay: X put B's offer into its own connect to A. A asks B for a region on
    behalf of its session with X; B granted A, but the request is not addressed to B."""
    with pytest.raises(DataPlaneError, match="belongs to 'B', not 'X'"):
        pair.a.add_peer("X", pair.hello_b, pair.b.offer())
    assert pair.b.statistics().regions_served == 0


def test_a_uid_outside_allowed_uids_is_refused_by_either_side() -> None:
    other = os.getuid() + 1
    pool_a = BlockPool(4, BLOCK, shm_path=shm_path())
    pool_b = BlockPool(4, BLOCK, shm_path=shm_path())
    strict = backend(pool_a, "A", allowed_uids=frozenset({other}))
    lenient = backend(pool_a, "A2")  # its region is the same file: fine for this test
    owner = backend(pool_b, "B", allowed_uids=frozenset({other}))
    plain_owner = backend(pool_b, "B2")
    try:
        owner.grant("A2")
        plain_owner.grant("A")
        with pytest.raises(DataPlaneError, match="refused by us: uid"):
            strict.add_peer("B2", hello(4), plain_owner.offer())
        with pytest.raises(DataPlaneError, match="owner refused: uid"):
            lenient.add_peer("B", hello(4), owner.offer())
        assert owner.statistics().requests_refused == 1
    finally:
        for each in (strict, lenient, owner, plain_owner):
            each.close()
        pool_a.close()
        pool_b.close()


def test_a_region_served_by_this_very_process_is_refused_by_default(pair: Pair) -> None:
    producer = backend(pair.a_pool, "A", same_process=False)
    try:
        with pytest.raises(DataPlaneError, match="this very process"):
            producer.add_peer("B", pair.hello_b, pair.b.offer())
    finally:
        producer.close()


def test_the_plane_set_falls_back_to_tcp_when_the_proof_fails() -> None:
    pools = [BlockPool(8, BLOCK, shm_path=shm_path()) for _ in range(2)]
    planes = [
        DataPlaneSet(
            region_of(pool),
            # The nodes are named "A" and "B", not host:port: tcp dials what they offer.
            [
                backend(pool, name),
                TcpBackend(region_of(pool), lambda: None, trust_offered_hosts=True),
            ],
        )
        for pool, name in zip(pools, "AB", strict=True)
    ]
    a, b = planes
    try:
        region = b.describe()
        hello_b = Connect(
            peer_id="B",
            agent_metadata=b"",
            base_addr=0,
            num_blocks=region.num_blocks,
            block_len=region.block_len,
            hash_seed="seed",
            kvpeer=ConnectExtension(
                version=PROTOCOL_VERSION, boot_id=os.urandom(16), transports=region.offers
            ),
        )
        choice = a.register_peer("B", hello_b)  # B never granted A
        assert choice is not None
        assert choice.name == "tcp"
        a.unregister_peer("B")
        b.grant("A")
        choice = a.register_peer("B", hello_b)
        assert choice is not None
        assert choice.name == "shm"
        b.revoke("A")
    finally:
        for plane in planes:
            plane.close()
        for pool in pools:
            pool.close()


# -- copies ------------------------------------------------------------------------------


def test_copy_lands_notifies_and_counts(pair: Pair) -> None:
    """A small copy finishes inside write_blocks: the next poll sees it, no wake-up needed."""
    assert pair.a.add_peer("B", pair.hello_b, pair.b.offer()) == {}
    data = os.urandom(3 * BLOCK)
    pair.a_pool.view[0 : 3 * BLOCK] = data
    assert 3 * BLOCK <= INLINE_BYTES
    transfer_id = pair.a.write_blocks("B", [0, 1, 2], [5, 6, 9])
    assert [e.transfer_id for e in pair.a.poll("B") if e.success] == [transfer_id]
    assert not pair.notified.is_set()
    view = pair.b_pool.view
    assert bytes(view[5 * BLOCK : 7 * BLOCK]) == data[: 2 * BLOCK]
    assert bytes(view[9 * BLOCK : 10 * BLOCK]) == data[2 * BLOCK :]
    stats = pair.a.statistics()
    assert (stats.peers, stats.completed, stats.bytes_copied) == (1, 1, 3 * BLOCK)


def test_large_copy_runs_on_the_thread_and_notifies() -> None:
    """Past INLINE_BYTES the copy thread does the work and wakes the owner."""
    pair = Pair(num_blocks=8, block_len=INLINE_BYTES)
    try:
        assert pair.a.add_peer("B", pair.hello_b, pair.b.offer()) == {}
        data = os.urandom(2 * INLINE_BYTES)
        pair.a_pool.view[0 : 2 * INLINE_BYTES] = data
        transfer_id = pair.a.write_blocks("B", [0, 1], [3, 4])
        assert wait_event(pair.a, "B", transfer_id).success
        assert pair.notified.is_set()
        assert bytes(pair.b_pool.view[3 * INLINE_BYTES : 5 * INLINE_BYTES]) == data
    finally:
        pair.close()


def test_bytes_reach_another_process() -> None:
    """The consumer's region and backend live in a child process (another pid: no
    ``same_process`` needed); it grants us, we map its region and copy into it."""
    path = shm_path()
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import json, sys
                from kvpeer.host import BlockPool
                from kvpeer.transport.data.base import PrimaryRegion
                from kvpeer.transport.data.shm import ShmBackend
                pool = BlockPool(4, {BLOCK}, shm_path={path!r})
                region = PrimaryRegion(pool.view, 4, {BLOCK}, pool.shm_path)
                backend = ShmBackend(region, lambda: None, local_id="child")
                backend.grant("parent")
                print(json.dumps(backend.offer()), flush=True)
                sys.stdin.readline()
                print(bytes(pool.view[{BLOCK} : {2 * BLOCK}]).hex(), flush=True)
                print(backend.statistics().regions_served, flush=True)
                backend.close()
                pool.close()
                """
            ),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    pool = BlockPool(4, BLOCK, shm_path=shm_path())
    producer = ShmBackend(region_of(pool), lambda: None, local_id="parent")
    try:
        assert child.stdout is not None
        assert child.stdin is not None
        offer = json.loads(child.stdout.readline())
        assert "path" not in offer
        producer.add_peer("child", hello(4), offer)
        data = os.urandom(BLOCK)
        pool.view[0:BLOCK] = data
        assert wait_event(producer, "child", producer.write_blocks("child", [0], [1])).success
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == data.hex()
        assert child.stdout.readline().strip() == "1"
        assert child.wait(TIMEOUT_S) == 0
    finally:
        producer.close()
        pool.close()
        if child.poll() is None:
            child.kill()
            child.wait()
        if os.path.exists(path):
            os.unlink(path)


def test_the_copy_thread_prefaults_a_new_mapping_after_add_peer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """add_peer runs inside the handshake: it must not wait for the peer's pages
    (faulting in a 64 MiB region took 11-120 ms per side of a first PD pull). The copy
    thread faults them in by pieces, and a small copy meanwhile still lands at once."""
    held = threading.Event()
    release = threading.Event()
    pieces: list[tuple[str, int, int]] = []

    def piece(mm: object, base: int, start: int, length: int) -> None:
        pieces.append((threading.current_thread().name, start, length))
        held.set()
        assert release.wait(TIMEOUT_S)

    monkeypatch.setattr(shm, "_prefault", piece)
    pair = Pair(num_blocks=2 * PREFAULT_BYTES // INLINE_BYTES, block_len=INLINE_BYTES)
    try:
        pair.a.add_peer("B", pair.hello_b, pair.b.offer())  # returns with a piece held
        assert held.wait(TIMEOUT_S)
        data = os.urandom(INLINE_BYTES)
        pair.a_pool.view[0:INLINE_BYTES] = data
        transfer_id = pair.a.write_blocks("B", [0], [3])
        assert [e.transfer_id for e in pair.a.poll("B") if e.success] == [transfer_id]
        assert bytes(pair.b_pool.view[3 * INLINE_BYTES : 4 * INLINE_BYTES]) == data
        release.set()
        deadline = time.monotonic() + TIMEOUT_S
        while len(pieces) < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert pieces == [
            ("kvpeer-shm-copy", 0, PREFAULT_BYTES),
            ("kvpeer-shm-copy", PREFAULT_BYTES, PREFAULT_BYTES),
        ]
    finally:
        release.set()
        pair.close()


def test_remove_peer_during_a_copy_is_safe_and_silent() -> None:
    """A big copy is stopped (or finished) before the mapping goes; never reported."""
    pair = Pair(num_blocks=64, block_len=1024 * 1024)
    try:
        pair.a.add_peer("B", pair.hello_b, pair.b.offer())
        ids = [pair.a.write_blocks("B", range(64), range(64)) for _ in range(4)]
        pair.a.remove_peer("B")
        assert pair.a.statistics().peers == 0
        assert pair.a.poll("B") == []
        assert pair.a.cancel(ids, wait=True) == []
        with pytest.raises(DataPlaneError, match="not registered"):
            pair.a.write_blocks("B", [0], [0])
        # The copy thread survived and serves a new registration.
        pair.a.add_peer("B", pair.hello_b, pair.b.offer())
        assert wait_event(pair.a, "B", pair.a.write_blocks("B", [1], [2])).success
    finally:
        pair.close()


def test_busy_copy_is_reported_after_a_waiting_cancel() -> None:
    pair = Pair(num_blocks=64, block_len=1024 * 1024)
    try:
        pair.a.add_peer("B", pair.hello_b, pair.b.offer())
        big = pair.a.write_blocks("B", range(64), range(64))
        queued = pair.a.write_blocks("B", [0], [0])
        deadline = time.monotonic() + TIMEOUT_S
        while pair.a.statistics().queued > 1 and time.monotonic() < deadline:
            time.sleep(0.0005)
        busy = pair.a.cancel([big, queued], wait=True)
        assert busy in ([], [big])  # copying, or already copied (then released)
        if busy:
            assert wait_event(pair.a, "B", big).success
        sentinel = pair.a.write_blocks("B", [1], [1])
        assert wait_event(pair.a, "B", sentinel).success
    finally:
        pair.close()


def test_after_close_writes_and_registrations_are_local_faults(pair: Pair) -> None:
    pair.a.add_peer("B", pair.hello_b, pair.b.offer())
    pair.a.close()
    pair.a.close()
    with pytest.raises(LocalFault, match="closed"):
        pair.a.write_blocks("B", [0], [0])
    with pytest.raises(LocalFault, match="closed"):
        pair.a.add_peer("B", pair.hello_b, pair.b.offer())
    assert pair.a.statistics().peers == 0
    pair.a.grant("B")  # never raises
    assert pair.a.statistics().granted == 0


def test_close_stops_serving_our_region(pair: Pair) -> None:
    offer = pair.b.offer()
    pair.b.close()
    with pytest.raises(DataPlaneError, match="no region"):
        pair.a.add_peer("B", pair.hello_b, offer)


def test_accept_writer_is_a_no_op(pair: Pair) -> None:
    pair.b.accept_writer("A", {}, WriteWindow())
    assert pair.b.statistics().peers == 0
