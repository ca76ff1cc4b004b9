"""Partitions for real: the producer runs in a network namespace of its own, behind a
veth pair this test made (tests/net/netns.py), and every packet between the two is
dropped in the middle of a handshake, a lookup, a PD fetch and a transfer.

The producer is a real process (``kvpeer serve``, or the PD producer program of
tests/net/producer.py) started with ``ip netns exec`` and bound to the namespace's
address; the consumer is a :class:`LocalNode` of this process bound to the root
side of the pair, so the address its connections come from is its peer id and
the producer dials it back there. Each case checks what an engine would see:

- every job is reported exactly once (:meth:`LocalNode.collect` refuses a second
  report; at the end the reported ids are exactly the submitted ones),
- within its budget: ``peer_wait_s`` before a handshake, ``heartbeat_timeout_s``
  after one, never ``handshake_timeout_s``, ``lookup_timeout_s`` or ``load_timeout_s``
  (all left at 30 s here),
- nothing leaks: the consumer's session ends, no data-plane thread (``kvpeer-tcp-*``
  other than the listener) and no socket toward the producer stays open,
- once the link heals (and any back-off passed), new requests pull byte-exact.

The machine needs ``ip``/``tc`` (iproute2) and CAP_NET_ADMIN; without them every
test is skipped with the reason.
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvpeer.node.params import split_peer_id
from kvpeer.types import Key, LookupResult, RequestContext, TransferJob
from tests.net.common import keys_of, wait_until
from tests.net.localnode import LocalNode
from tests.net.netns import CUTS, VethNamespace, unavailable, veth_namespace
from tests.net.processes import NodeProcess, start_producer, start_serve

pytestmark = pytest.mark.slow  # network-namespace partitions

HEARTBEATS = {"heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 1.0}
HEARTBEAT_TIMEOUT_S = 1.0
PEER_WAIT_S = 1.5  # the default of peer_wait_s, which these tests keep
PEER_RETRY_MAX_S = 2.0
#: The consumer: short heartbeats and back-off; every session timeout stays at 30 s.
CONSUMER = {**HEARTBEATS, "peer_retry_max_s": PEER_RETRY_MAX_S}
#: Scheduling slack on a loaded 2-core machine (driver ticks, process wake-ups).
SLACK_S = 2.0
#: A request naming a backed-off peer computes "at once".
AT_ONCE_S = 0.5
#: How long a healed link may take to serve new requests (back-off included).
HEAL_DEADLINE_S = 30.0
BIG_BLOCK = 1 << 20


@functools.cache
def _why_not() -> str | None:
    return unavailable()


class Partition:
    """A namespace + veth pair and the node processes this test started inside it."""

    def __init__(self, pair: VethNamespace, workdir: Path) -> None:
        self.pair = pair
        self._workdir = workdir
        self.processes: list[NodeProcess] = []

    def serve(self, **kwargs: Any) -> NodeProcess:
        """``kvpeer serve`` inside the namespace (see ``processes.start_serve``)."""
        return self._start(start_serve, **kwargs)

    def producer(self, **kwargs: Any) -> NodeProcess:
        """The PD producer program inside the namespace (see ``processes.start_producer``)."""
        return self._start(start_producer, **kwargs)

    def _start(self, start: Callable[..., NodeProcess], **kwargs: Any) -> NodeProcess:
        node = start(
            self._workdir,
            host=self.pair.inside_ip,
            netns=self.pair.namespace,
            config=HEARTBEATS,
            wait=False,
            **kwargs,
        )
        self.processes.append(node)
        node.wait_ready()
        return node

    def consumer(self, **kwargs: Any) -> LocalNode:
        return LocalNode("tcp", host=self.pair.outside_ip, config=CONSUMER, **kwargs)


@pytest.fixture
def partition(tmp_path: Path) -> Iterator[Partition]:
    why = _why_not()
    if why is not None:
        pytest.skip(f"no network namespaces for partition tests: {why}")
    with veth_namespace() as pair:
        made = Partition(pair, tmp_path)
        try:
            yield made
        finally:  # processes first: the namespace is removed after them
            for node in made.processes:
                node.stop()


# -- what an engine does, with every job result kept ------------------------------------------


class Ledger:
    """Every job this test submitted; :meth:`check` says each was reported exactly once."""

    def __init__(self, consumer: LocalNode) -> None:
        self.consumer = consumer
        self.submitted: list[int] = []

    def submit(self, keys: Sequence[Key], slots: Sequence[int], context: RequestContext) -> int:
        job_id = self.consumer.next_job_id()
        self.consumer.node.submit_load(TransferJob(job_id, tuple(keys), tuple(slots), context))
        self.submitted.append(job_id)
        return job_id

    def check(self) -> None:
        time.sleep(0.3)  # a second report would come from the driver: give it time
        self.consumer.collect()  # raises on a second report of any job
        assert sorted(self.consumer.results) == sorted(self.submitted), (
            f"reported {sorted(self.consumer.results)}, submitted {sorted(self.submitted)}"
        )


def _remote(peer_id: str, kv_request_id: str) -> dict[str, object]:
    address = split_peer_id(peer_id)
    assert address is not None, peer_id
    return {"kv_request_id": kv_request_id, "remote_host": address[0], "remote_port": address[1]}


class Request:
    """One consumer request toward ``peer_id``: symmetric (``remote_kv_source``) or PD
    (``remote_prefiller``), probed and loaded like an engine would."""

    def __init__(
        self, ledger: Ledger, peer_id: str, *, pd: str | None = None, name: str = "req"
    ) -> None:
        self._ledger = ledger
        self._node = ledger.consumer.node
        role = "remote_prefiller" if pd is not None else "remote_kv_source"
        kv_request_id = pd if pd is not None else f"sym-{uuid.uuid4().hex}"
        self.context = RequestContext(
            f"{name}-{uuid.uuid4().hex[:8]}", {role: _remote(peer_id, kv_request_id)}
        )
        self._node.on_new_request(self.context)
        self.job_id: int | None = None
        self.submitted_at = 0.0

    def ask(self, keys: Sequence[Key]) -> list[LookupResult]:
        """One engine step of lookups (a symmetric request's probes go out at its end)."""
        answers = [self._node.lookup(key, self.context) for key in keys]
        self._node.on_schedule_end()
        return answers

    def probe(self, keys: Sequence[Key], timeout_s: float = 60.0) -> list[LookupResult]:
        """Ask every step until no key answers RETRY (or ``timeout_s``: a hang)."""
        deadline = time.monotonic() + timeout_s
        while True:
            answers = self.ask(keys)
            if LookupResult.RETRY not in answers or time.monotonic() > deadline:
                return answers
            time.sleep(0.002)

    def load(self, keys: Sequence[Key], slots: Sequence[int]) -> int:
        self.submitted_at = time.monotonic()
        self.job_id = self._ledger.submit(keys, slots, self.context)
        return self.job_id

    def wait(self, timeout_s: float = 60.0) -> bool | None:
        assert self.job_id is not None
        return self._ledger.consumer.wait_job(self.job_id, timeout_s)

    def finish(self) -> None:
        self._node.on_request_finished(self.context)


def pulls(ledger: Ledger, peer_id: str, indexes: Sequence[int], slots: Sequence[int]) -> bool:
    """One symmetric request: True if every key hit and the load landed them byte-exact."""
    request = Request(ledger, peer_id, name="pull")
    try:
        keys = keys_of(indexes)
        if request.probe(keys) != [LookupResult.HIT] * len(keys):
            return False
        request.load(keys, slots)
        if request.wait() is not True:
            return False
    finally:
        request.finish()
    ledger.consumer.assert_blocks(slots, indexes)
    return True


def pulls_again_after_healing(
    ledger: Ledger, peer_id: str, indexes: Sequence[int], slots: Sequence[int]
) -> float:
    """Seconds until a new request pulled again (failing the test after 30 s)."""
    healed_at = time.monotonic()
    assert wait_until(lambda: pulls(ledger, peer_id, indexes, slots), HEAL_DEADLINE_S, 0.1), (
        f"no request pulled from {peer_id} within {HEAL_DEADLINE_S}s of healing the link"
    )
    return time.monotonic() - healed_at


# -- leaks ------------------------------------------------------------------------------------


def data_threads() -> list[str]:
    """The data plane's per-connection threads of this process (its listener stays)."""
    return sorted(
        t.name
        for t in threading.enumerate()
        if t.name.startswith("kvpeer-tcp-") and t.name != "kvpeer-tcp-listen"
    )


def sockets_toward(ip: str) -> list[str]:
    """This process's open TCP sockets whose remote end is ``ip`` (from /proc)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    remote = socket.inet_aton(ip)[::-1].hex().upper()  # /proc prints the be32 as a host int
    found = []
    for line in Path("/proc/self/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[2].startswith(remote + ":") and fields[9] in inodes:
            found.append(f"{fields[1]} -> {fields[2]} state {fields[3]}")
    return found


def assert_nothing_left(consumer: LocalNode, peer_id: str, ip: str) -> None:
    """Once the session toward ``peer_id`` ended: no session, load, thread or socket."""
    assert wait_until(lambda: not consumer.has_session(peer_id)), "the session outlived the peer"
    stats = consumer.statistics()
    assert (stats.sessions, stats.loads_in_flight, stats.requests) == (0, 0, 0), stats
    assert wait_until(lambda: not data_threads()), f"threads left: {data_threads()}"
    assert wait_until(lambda: not sockets_toward(ip)), f"sockets left: {sockets_toward(ip)}"


# -- the cases --------------------------------------------------------------------------------


def established_toward(ip: str) -> bool:
    return any(line.endswith("state 01") for line in sockets_toward(ip))  # TCP_ESTABLISHED


@pytest.mark.parametrize(
    ("cut", "when"),
    [(cut, "before the first contact") for cut in CUTS] + [("loss", "mid-handshake")],
)
def test_partitioned_during_the_handshake(partition: Partition, cut: str, when: str) -> None:
    """The peer never answers: the load fails within peer_wait_s (not handshake_timeout_s),
    the next request computes at once (back-off), and after healing it is used again.
    Mid-handshake: the producer is stopped (SIGSTOP) while the consumer connects, so the
    TCP connection is up and the handshake (ZMTP's, then ours) under way when the link
    goes; the producer resumes and answers into the partition."""
    server = partition.serve()
    with partition.consumer() as consumer:
        ledger = Ledger(consumer)
        if when == "mid-handshake":
            server.signal(signal.SIGSTOP)
        else:
            partition.pair.cut(cut)

        first = Request(ledger, server.peer_id, pd=f"pd-{uuid.uuid4().hex}", name="first")
        keys = keys_of(range(8))
        assert first.probe(keys) == [LookupResult.HIT] * 8  # PD: no question asked
        first.load(keys, range(8))
        if when == "mid-handshake":
            ip = partition.pair.inside_ip
            assert wait_until(lambda: established_toward(ip), 1.0), "setup: never connected"
            partition.pair.cut(cut)
            server.signal(signal.SIGCONT)  # it answers into the partition
        assert first.wait() is False, "a load from an unreachable peer must fail"
        fell_back = time.monotonic() - first.submitted_at
        first.finish()
        assert fell_back <= PEER_WAIT_S + SLACK_S, f"the load failed after {fell_back:.2f}s"

        started = time.monotonic()
        second = Request(ledger, server.peer_id, name="second")
        answers = second.probe(keys)
        second.finish()
        at_once = time.monotonic() - started
        assert answers == [LookupResult.MISS] * 8
        assert at_once <= AT_ONCE_S, f"a backed-off peer cost the request {at_once:.2f}s"
        assert consumer.statistics().sessions_ended.get("unreachable") == 1
        assert_nothing_left(consumer, server.peer_id, partition.pair.inside_ip)

        partition.pair.heal()
        healed_in = pulls_again_after_healing(ledger, server.peer_id, range(8), range(8, 16))
        ledger.check()
        print(
            f"\n[{cut}, {when}] load failed in {fell_back:.2f}s, next request {at_once:.3f}s,"
            f" pulled again {healed_in:.2f}s after healing"
        )


def test_partitioned_during_a_symmetric_lookup(partition: Partition) -> None:
    """After the handshake: the lookup reaches the producer (stopped for a moment, so it
    has not answered yet), then the link goes and the producer answers into it. The
    probes answer MISS once the heartbeat finds the peer gone (heartbeat_timeout_s),
    not after lookup_timeout_s (30 s)."""
    server = partition.serve()
    with partition.consumer() as consumer:
        ledger = Ledger(consumer)
        assert pulls(ledger, server.peer_id, range(8), range(8))  # a ready session
        # The leak checks below see a live session's sockets and threads:
        assert sockets_toward(partition.pair.inside_ip)
        assert data_threads()

        server.signal(signal.SIGSTOP)
        started = time.monotonic()
        request = Request(ledger, server.peer_id, name="cut")
        keys = keys_of(range(8, 16))
        assert request.ask(keys) == [LookupResult.RETRY] * 8  # the lookup goes out
        time.sleep(0.1)  # it crossed the link into the stopped producer's socket
        partition.pair.cut()
        server.signal(signal.SIGCONT)
        answers = request.probe(keys)
        fell_back = time.monotonic() - started
        assert answers == [LookupResult.MISS] * 8
        assert fell_back <= HEARTBEAT_TIMEOUT_S + SLACK_S, f"lookups took {fell_back:.2f}s"
        request.finish()
        assert_nothing_left(consumer, server.peer_id, partition.pair.inside_ip)

        partition.pair.heal()
        healed_in = pulls_again_after_healing(ledger, server.peer_id, range(8, 16), range(8, 16))
        ledger.check()
        print(f"\nlookup: MISS after {fell_back:.2f}s, pulled again {healed_in:.2f}s after healing")


def _session_ready(consumer: LocalNode, peer_id: str) -> bool:
    with consumer.node.locked():
        session = consumer.node.tier.session(peer_id)
        return session is not None and session.ready


def test_partitioned_during_a_pd_fetch(partition: Partition) -> None:
    """A PD fetch waits at the producer (its prefill has not stored yet) when the link
    goes: the load fails within heartbeat_timeout_s, not load_timeout_s (30 s)."""
    stored = f"pd-stored-{uuid.uuid4().hex}"
    prefill = partition.producer(kv_request_ids=[stored], count=8)
    assert prefill.wait_for_output("stored all"), prefill.log()
    with partition.consumer() as consumer:
        ledger = Ledger(consumer)
        waiting = Request(ledger, prefill.peer_id, pd=f"pd-later-{uuid.uuid4().hex}", name="w")
        keys = keys_of(range(8))
        assert waiting.probe(keys) == [LookupResult.HIT] * 8
        waiting.load(keys, range(8))
        assert wait_until(lambda: _session_ready(consumer, prefill.peer_id))
        time.sleep(0.3)  # the fetch crossed; the producer holds it for its prefill
        assert consumer.statistics().loads_in_flight == 1

        partition.pair.cut()
        cut_at = time.monotonic()
        assert waiting.wait() is False, "a fetch across a partition must fail"
        fell_back = time.monotonic() - cut_at
        waiting.finish()
        assert fell_back <= HEARTBEAT_TIMEOUT_S + SLACK_S, f"the load failed after {fell_back:.2f}s"
        assert all(consumer.is_zero(slot) for slot in range(8))
        assert_nothing_left(consumer, prefill.peer_id, partition.pair.inside_ip)

        partition.pair.heal()
        healed_at = time.monotonic()

        def pd_pulls() -> bool:
            request = Request(ledger, prefill.peer_id, pd=stored, name="healed")
            try:
                request.probe(keys)
                request.load(keys, range(8, 16))
                return request.wait() is True
            finally:
                request.finish()

        assert wait_until(pd_pulls, HEAL_DEADLINE_S, 0.1), "the healed PD load never landed"
        healed_in = time.monotonic() - healed_at
        consumer.assert_blocks(range(8, 16), range(8))
        ledger.check()
        print(
            f"\nPD fetch: load failed {fell_back:.2f}s after the cut,"
            f" pulled again {healed_in:.2f}s after healing"
        )


def test_partitioned_in_the_middle_of_a_transfer(partition: Partition) -> None:
    """64 blocks of 1 MiB over a link shaped to 128 Mbit/s (about 4 s): cut once the first
    8 blocks landed. The load fails within heartbeat_timeout_s, and nothing the producer
    still had in flight lands in those slots after the heal."""
    count = 64
    server = partition.serve(blocks=count, block_len=BIG_BLOCK, synthetic=count)
    try:
        partition.pair.limit_rate("128mbit")
    except RuntimeError as exc:
        pytest.skip(f"cannot slow the link to cut a transfer in its middle: {exc}")
    with partition.consumer(num_blocks=2 * count, block_len=BIG_BLOCK) as consumer:
        ledger = Ledger(consumer)
        request = Request(ledger, server.peer_id, name="big")
        keys = keys_of(range(count))
        assert request.probe(keys) == [LookupResult.HIT] * count
        request.load(keys, range(count))
        assert wait_until(lambda: consumer.block_index(7) == 7), "the first blocks never landed"

        partition.pair.cut()
        cut_at = time.monotonic()
        landed = sum(consumer.block_index(slot) == slot for slot in range(count))
        assert 0 < landed < count, f"cut after {landed} of {count} blocks: not mid-transfer"
        assert request.wait() is False, "a transfer across a partition must fail"
        fell_back = time.monotonic() - cut_at
        request.finish()
        assert fell_back <= HEARTBEAT_TIMEOUT_S + SLACK_S, f"the load failed after {fell_back:.2f}s"
        assert_nothing_left(consumer, server.peer_id, partition.pair.inside_ip)

        # The engine reuses the failed load's slots: nothing may land in them any more.
        marker = bytes([0xA5]) * BIG_BLOCK
        for slot in range(count):
            consumer.pool.slot_view(slot)[:] = marker
        partition.pair.heal()
        healed_in = pulls_again_after_healing(
            ledger, server.peer_id, range(count), range(count, 2 * count)
        )
        time.sleep(0.5)
        overwritten = [s for s in range(count) if bytes(consumer.pool.slot_view(s)) != marker]
        assert not overwritten, f"late writes landed in reused slots {overwritten}"
        ledger.check()
        print(
            f"\ntransfer: cut after {landed}/{count} blocks, load failed {fell_back:.2f}s later,"
            f" pulled again {healed_in:.2f}s after healing"
        )
