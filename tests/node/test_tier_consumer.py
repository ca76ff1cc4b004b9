"""Tier, consumer side: parsing roles once, sessions per source, lookups and loads.

Pins ``kvpeer.node.tier`` invariants 1 and 2 (docs/design.md §3, §5.1, §5.2, §5.8):
malformed roles run locally with a logged reason; ``remote_prefiller`` answers
HIT without the network, ``remote_kv_source`` probes; a request whose load
failed, whose peer died or whose probes timed out answers MISS until it
finishes, and a new request with the same id starts afresh.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import pytest

from kvpeer.node.peertable import FIRST_RETRY_S
from kvpeer.node.pullwaits import SLOW_PULL_BACKOFF_S, SLOW_PULL_MISSES
from kvpeer.protocol import Connect, Fetch, Lookup
from kvpeer.testing.cluster import (
    Cluster,
    TierNode,
    decoder,
    key,
    keys,
    kv_source,
    prefiller,
)
from kvpeer.types import Key, LookupResult, OffloadPolicy, RequestContext

HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY
KEYS = keys(1, 2, 3)
Role = Callable[[str, TierNode], dict[str, object]]


class CountingParams(Mapping[str, object]):
    """``kv_transfer_params`` that count how often the tier reads them."""

    def __init__(self, data: Mapping[str, object]) -> None:
        self._data = dict(data)
        self.reads = 0

    def __getitem__(self, name: str) -> object:
        self.reads += 1
        return self._data[name]

    def __iter__(self) -> Iterator[str]:
        self.reads += 1
        return iter(self._data)

    def __len__(self) -> int:
        self.reads += 1
        return len(self._data)

    def __contains__(self, name: object) -> bool:
        self.reads += 1
        return name in self._data


def ghost(kv_id: str, host: str = "b", port: int = 2) -> dict[str, object]:
    """A source role naming a peer nobody runs (its frames are dropped)."""
    return {"kv_request_id": kv_id, "remote_host": host, "remote_port": port}


def resolve(
    cluster: Cluster, node: TierNode, req: RequestContext, *wanted: Key
) -> list[LookupResult]:
    """Look ``wanted`` up each step until no answer is RETRY (bounded)."""
    answers = node.lookup(req, *wanted)
    for _ in range(10):
        if RETRY not in answers:
            return answers
        cluster.step()
        answers = node.lookup(req, *wanted)
    raise AssertionError(f"lookups still RETRY: {answers}")


@pytest.fixture
def cluster() -> Cluster:
    return Cluster()


class TestParsing:
    """kv_transfer_params are parsed once; malformed roles run locally with a reason."""

    def test_params_are_read_only_at_on_new_request(self, cluster: Cluster) -> None:
        a, b = cluster.add("a", 1), cluster.add("b", 2)
        b.store(b.request("p", decoder("kv1")), KEYS)
        params = CountingParams(prefiller("kv1", b))
        req = a.request("c", params)
        after_parse = params.reads
        assert after_parse > 0
        a.lookup(req, *KEYS)
        a.load(req, KEYS)
        cluster.run()
        a.finish(req)
        cluster.run(2)
        assert params.reads == after_parse

    @pytest.mark.parametrize(
        ("params", "reason"),
        [
            ({"remote_prefiller": {"kv_request_id": "kv1", "remote_host": "b"}}, "remote_port"),
            ({"remote_kv_source": {**ghost("kv1"), "remote_host": 5}}, "remote_host"),
            ({"remote_kv_source": {**ghost("kv1"), "kv_request_id": ""}}, "kv_request_id"),
            ({"remote_prefiller": "b:2"}, "remote_prefiller"),
            ({"remote_prefiller": ghost("kv1"), "remote_kv_source": ghost("kv1")}, "exclusive"),
            ({"remote_decoder": {"kv_request_id": 7}}, "remote_decoder.kv_request_id"),
        ],
    )
    def test_malformed_role_is_logged_and_runs_locally(
        self,
        cluster: Cluster,
        caplog: pytest.LogCaptureFixture,
        params: dict[str, object],
        reason: str,
    ) -> None:
        a = cluster.add("a", 1)
        caplog.set_level("WARNING", logger="kvpeer.tier")
        req, policy = a.start("bad-1", params)
        assert policy is OffloadPolicy.CHUNK_LEVEL
        warnings = [r.getMessage() for r in caplog.records if r.name == "kvpeer.tier"]
        assert any("bad-1" in w and reason in w for w in warnings), warnings
        assert a.lookup(req, *KEYS) == [MISS] * 3
        store = a.store(req, keys(7))
        load, _ = a.load(req, KEYS)
        a.step()
        assert a.outcome(store) is True
        assert a.outcome(load) is False
        assert a.stats().sessions == 0
        assert a.sent() == []
        assert cluster.net.frames_sent == 0
        a.finish(req)
        assert a.stats().requests == 0

    def test_request_without_params_is_local(self, cluster: Cluster) -> None:
        a = cluster.add("a", 1)
        req, policy = a.start("local")
        assert policy is OffloadPolicy.CHUNK_LEVEL
        assert a.lookup(req, *KEYS) == [MISS] * 3
        load, _ = a.load(req, KEYS)
        a.step()
        assert a.outcome(load) is False
        assert a.sent() == []


class TestSourceSession:
    """A consumer request opens (or reuses) the session to its peer at on_new_request."""

    def test_session_opens_at_on_new_request(self, cluster: Cluster) -> None:
        a, b = cluster.add("a", 1), cluster.add("b", 2)
        a.request("c", kv_source("kv1", b))
        assert a.stats().sessions == 1
        assert [type(m) for m in a.sent(to=b)] == [Connect]

    def test_second_request_reuses_the_session(self, cluster: Cluster) -> None:
        a, b = cluster.add("a", 1), cluster.add("b", 2)
        a.request("c1", kv_source("kv1", b))
        cluster.run()
        first = a.session(b)
        a.request("c2", prefiller("kv2", b))
        assert a.session(b) is first
        assert a.stats().sessions == 1
        assert len(a.sent_of(Connect, to=b)) == 1

    def test_session_the_peer_opened_is_reused(self, cluster: Cluster) -> None:
        a, b = cluster.add("a", 1), cluster.add("b", 2)
        b.request("c1", kv_source("kv1", a))
        cluster.run()
        inbound = a.session(b)
        assert inbound.ready
        a.request("c2", kv_source("kv2", b))
        assert a.session(b) is inbound
        assert len(a.sent_of(Connect, to=b)) == 1


class TestPrefillerLookups:
    """remote_prefiller: every lookup is a HIT without the network; the load is byte-exact."""

    def test_lookups_hit_without_asking_the_peer(self, cluster: Cluster) -> None:
        a, b = cluster.add("a", 1), cluster.add("b", 2)
        req = a.request("c", prefiller("kv1", b))
        assert a.lookup(req, *KEYS) == [HIT] * 3
        cluster.run()
        assert a.lookup(req, *KEYS) == [HIT] * 3
        assert a.sent_of(Lookup) == []
        assert a.session(b).statistics().consumer.lookups_sent == 0

    def test_load_is_fetched_byte_exact(self, cluster: Cluster) -> None:
        a, b = cluster.add("a", 1), cluster.add("b", 2)
        producer = b.request("p", decoder("kv1"))
        b.store(producer, KEYS)
        req = a.request("c", prefiller("kv1", b))
        job, slots = a.load(req, KEYS)
        cluster.advance(0.25)
        cluster.run()
        assert a.outcome(job) is True
        assert [a.block(s) for s in slots] == [b.parent.expected(k) for k in KEYS]
        assert a.sent_of(Fetch, to=b)[0].keys == KEYS
        assert a.stats().blocks_loaded == a.tier.blocks_loaded == len(KEYS)
        assert a.tier.load_seconds >= 0.25  # fetch to completion, on the tier's clock
        assert b.tier.blocks_loaded == 0  # counts what came in, not what went out
        report = a.reports[job]  # what vLLM's per-tier read time and bytes are fed from
        assert report.transfer_seconds is not None
        assert report.transfer_seconds >= 0.25
        assert report.transfer_bytes == len(KEYS) * a.region.block_len

    def test_a_failed_load_reports_no_transfer(self, cluster: Cluster) -> None:
        a, b = cluster.add("a", 1), cluster.add("b", 2)
        b.store(b.request("p", decoder("kv1")), KEYS)
        req = a.request("c", prefiller("kv1", b))
        b.plane.fail_next_writes = 1
        job, _ = a.load(req, KEYS)
        cluster.run()
        assert a.outcome(job) is False
        assert (a.reports[job].transfer_seconds, a.reports[job].transfer_bytes) == (None, None)

    def test_empty_load_succeeds_at_once(self, cluster: Cluster) -> None:
        a, b = cluster.add("a", 1), cluster.add("b", 2)
        req = a.request("c", prefiller("kv1", b))
        job, _ = a.load(req, ())
        a.step()
        assert a.outcome(job) is True
        assert a.sent_of(Fetch) == []


class TestKvSourceLookups:
    """remote_kv_source: lookups answer RETRY, then the peer's HIT/MISS; hits load."""

    def test_probe_then_fetch_hits(self, cluster: Cluster) -> None:
        a, b = cluster.add("a", 1), cluster.add("b", 2)
        for k in keys(1, 2):
            b.parent.put(k)
        req = a.request("c", kv_source("kv1", b))
        assert a.lookup(req, *KEYS) == [RETRY] * 3
        assert resolve(cluster, a, req, *KEYS) == [HIT, HIT, MISS]
        assert len(a.sent_of(Lookup, to=b)) == 1
        job, slots = a.load(req, keys(1, 2))
        cluster.run()
        assert a.outcome(job) is True
        assert [a.block(s) for s in slots] == [b.parent.expected(k) for k in keys(1, 2)]
        a.finish(req)
        cluster.run()
        assert b.parent.pins == {}
        assert b.parent.open_requests == {}

    def test_unknown_peer_refused_by_data_plane_is_miss(self, cluster: Cluster) -> None:
        a, b = cluster.add("a", 1), cluster.add("b", 2)
        a.plane.refuse_peers[b.peer_id] = "no route"
        req = a.request("c", kv_source("kv1", b))
        a.lookup(req, *KEYS)
        cluster.run()
        assert a.lookup(req, *KEYS) == [MISS] * 3


class TestMissUntilFinished:
    """After a failed load, a dead peer or expired probes: MISS until the request ends."""

    @pytest.mark.parametrize("role", [prefiller, kv_source])
    def test_failed_load(self, cluster: Cluster, role: Role) -> None:
        a, b = cluster.add("a", 1), cluster.add("b", 2)
        for k in KEYS:
            b.parent.put(k)
        b.store(b.request("p", decoder("kv1")), KEYS)
        req = a.request("c", role("kv1", b))
        assert resolve(cluster, a, req, *KEYS) == [HIT] * 3
        b.plane.fail_next_writes = 1
        job, _ = a.load(req, KEYS)
        cluster.run()
        assert a.outcome(job) is False
        assert a.tier.blocks_loaded == 0
        assert a.tier.load_seconds == 0.0
        assert a.lookup(req, *KEYS, key(9)) == [MISS] * 4
        assert a.stats().failed_ids == 1
        a.finish(req)
        assert a.stats().failed_ids == 0
        again = a.request("c-again", role("kv1", b))
        expected = HIT if role is prefiller else RETRY
        assert a.lookup(again, key(9)) == [expected]

    def test_dead_peer_with_waiting_probes(self, cluster: Cluster) -> None:
        a, b = cluster.add("a", 1), cluster.add("b", 2)
        req = a.request("c", kv_source("kv1", b))
        cluster.run()
        assert a.lookup(req, *KEYS) == [RETRY] * 3
        a.step()  # the lookup goes out; b never answers it
        cluster.kill(b)
        a.step()
        assert a.lookup(req, *KEYS, key(9)) == [MISS] * 4
        a.finish(req)
        b2 = cluster.add("b", 2)
        again = a.request("c-again", kv_source("kv1", b2))
        assert a.lookup(again, key(9)) == [RETRY]

    def test_dead_peer_with_a_load_in_flight(self, cluster: Cluster) -> None:
        a, b = cluster.add("a", 1), cluster.add("b", 2)
        b.request("p", decoder("kv1"))  # no stores yet: the fetch waits
        req = a.request("c", prefiller("kv1", b))
        job, _ = a.load(req, KEYS)
        cluster.run()
        assert a.outcome(job) is None
        cluster.kill(b)
        a.step()
        assert a.outcome(job) is False
        assert a.lookup(req, *KEYS) == [MISS] * 3

    def test_dead_prefiller_before_any_load(self, cluster: Cluster) -> None:
        """A PD request whose peer died must not promise HITs it cannot load."""
        a, b = cluster.add("a", 1), cluster.add("b", 2)
        req = a.request("c", prefiller("kv1", b))
        cluster.run()
        cluster.kill(b)
        a.step()
        assert a.lookup(req, *KEYS) == [MISS] * 3

    def test_answered_probes_of_a_dead_peer_turn_miss(self, cluster: Cluster) -> None:
        """Hits confirmed by a peer that died are not asked of the peer that replaced it."""
        a, b = cluster.add("a", 1), cluster.add("b", 2)
        for k in KEYS:
            b.parent.put(k)
        req = a.request("c", kv_source("kv1", b))
        assert resolve(cluster, a, req, *KEYS) == [HIT] * 3
        cluster.kill(b)
        a.step()
        b2 = cluster.add("b", 2)  # same address, new boot: a new session opens
        a.request("other", kv_source("kv2", b2))
        cluster.run()
        assert a.lookup(req, *KEYS, key(9)) == [MISS] * 4

    def test_load_of_hits_from_a_dead_peer_fails_at_once(self, cluster: Cluster) -> None:
        """The engine saw HITs before the peer died: that load must not wait for a timeout."""
        a, b = cluster.add("a", 1), cluster.add("b", 2)
        for k in KEYS:
            b.parent.put(k)
        req = a.request("c", kv_source("kv1", b))
        assert resolve(cluster, a, req, *KEYS) == [HIT] * 3
        cluster.kill(b)
        a.step()
        b2 = cluster.add("b", 2)
        a.request("other", kv_source("kv2", b2))
        cluster.run()
        job, _ = a.load(req, KEYS)
        cluster.run()
        assert a.outcome(job) is False  # the clock never moved

    @pytest.mark.parametrize(
        "timeouts",
        [
            {"lookup_timeout_s": 5, "handshake_timeout_s": 30, "peer_wait_s": 60},
            {"lookup_timeout_s": 30, "handshake_timeout_s": 5, "peer_wait_s": 60},
        ],
        ids=["lookup-timeout", "handshake-timeout"],
    )
    def test_probes_of_a_silent_peer_time_out(
        self, cluster: Cluster, timeouts: dict[str, object]
    ) -> None:
        a = cluster.add("a", 1, timeouts)
        req = a.request("c", {"remote_kv_source": ghost("kv1")})
        assert a.lookup(req, *KEYS) == [RETRY] * 3
        cluster.run(3)
        cluster.advance(4)
        cluster.step()
        assert a.lookup(req, *KEYS) == [RETRY] * 3
        cluster.advance(2)
        cluster.step()
        assert a.lookup(req, *KEYS, key(9)) == [MISS] * 4
        assert a.unreported() == set()
        a.finish(req)
        cluster.advance(FIRST_RETRY_S)  # a peer that timed out is backed off this long
        cluster.step()
        again = a.request("c-again", {"remote_kv_source": ghost("kv1")})
        assert a.lookup(again, *KEYS) == [RETRY] * 3

    def test_a_silent_peer_costs_a_request_peer_wait_s_then_is_backed_off(
        self, cluster: Cluster
    ) -> None:
        """Invariant 12 of the tier and 4 of the session: probes toward a peer that never
        answers turn MISS after ``peer_wait_s`` (not the 30 s session timeouts); the next
        requests naming it compute at once until its retry time, which doubles."""
        a = cluster.add("a", 1, {"peer_wait_s": 2})
        req = a.request("c", {"remote_kv_source": ghost("kv1")})
        assert a.lookup(req, *KEYS) == [RETRY] * 3
        cluster.run(3)
        cluster.advance(1.9)
        cluster.step()
        assert a.lookup(req, *KEYS) == [RETRY] * 3
        cluster.advance(0.1)
        cluster.step()
        assert a.lookup(req, *KEYS) == [MISS] * 3
        a.finish(req)
        at_once = a.request("c2", {"remote_kv_source": ghost("kv2")})
        assert a.lookup(at_once, *KEYS) == [MISS] * 3  # backed off: no new session
        a.finish(at_once)
        cluster.advance(FIRST_RETRY_S)
        cluster.step()
        retry = a.request("c3", {"remote_kv_source": ghost("kv3")})
        assert a.lookup(retry, *KEYS) == [RETRY] * 3  # one new attempt
        cluster.advance(2)
        cluster.step()
        assert a.lookup(retry, *KEYS) == [MISS] * 3
        a.finish(retry)
        cluster.advance(FIRST_RETRY_S)  # the back-off doubled: still backed off
        cluster.step()
        later = a.request("c4", {"remote_kv_source": ghost("kv4")})
        assert a.lookup(later, *KEYS) == [MISS] * 3
        assert a.unreported() == set()

    def test_other_requests_of_the_peer_are_unaffected(self, cluster: Cluster) -> None:
        a, b = cluster.add("a", 1), cluster.add("b", 2)
        for k in KEYS:
            b.parent.put(k)
        b.store(b.request("p1", decoder("kv1")), KEYS)
        failed = a.request("c1", prefiller("kv1", b))
        healthy = a.request("c2", kv_source("kv2", b))
        b.plane.fail_next_writes = 1
        job, _ = a.load(failed, KEYS)
        cluster.run()
        assert a.outcome(job) is False
        assert a.lookup(failed, *KEYS) == [MISS] * 3
        assert resolve(cluster, a, healthy, *KEYS) == [HIT] * 3


def positions(*wanted: Key, tokens_per_key: int = 32) -> Callable[[Key], int | None]:
    """What vLLM's ReqContext says of the request's keys: each key's end token."""
    table = {k: (i + 1) * tokens_per_key for i, k in enumerate(wanted)}
    return table.get


class TestHeldTokens:
    """remote_kv_source with the router's ``held_tokens``: keys the peer holds answer HIT
    at once and are fetched with ``resolve``; the peer is never asked a lookup."""

    def hinted(self, a: TierNode, b: TierNode, req_id: str, held: int) -> RequestContext:
        params = {"remote_kv_source": {**kv_source("kv1", b)["remote_kv_source"],  # type: ignore[dict-item]
                                       "held_tokens": held}}  # fmt: skip
        ctx = RequestContext(req_id, params, key_position=positions(*KEYS))
        a.tier.on_new_request(ctx)
        return ctx

    def test_held_keys_hit_at_once_and_load_without_a_lookup(self, cluster: Cluster) -> None:
        a, b = cluster.add("a", 1), cluster.add("b", 2)
        for k in keys(1, 2):
            b.parent.put(k)
        warm = a.request("warm", kv_source("kv0", b))  # a session both ways already
        a.lookup(warm, *KEYS)
        cluster.run()
        a.finish(warm)
        cluster.run()
        looked_up = len(a.sent_of(Lookup, to=b))
        req = self.hinted(a, b, "c", held=64)
        assert a.lookup(req, *KEYS) == [HIT, HIT, MISS]  # no RETRY: no engine step lost
        job, slots = a.load(req, keys(1, 2))
        cluster.run()
        assert a.outcome(job) is True
        assert [a.block(s) for s in slots] == [b.parent.expected(k) for k in keys(1, 2)]
        assert len(a.sent_of(Lookup, to=b)) == looked_up
        [fetch] = [f for f in a.sent_of(Fetch, to=b) if f.kv_request_id == "kv1" and f.keys]
        assert fetch.resolve
        a.finish(req)
        cluster.run()
        assert b.parent.pins == {}
        assert b.parent.open_requests == {}

    def test_a_held_key_the_peer_lost_fails_the_load_then_stays_miss(
        self, cluster: Cluster
    ) -> None:
        a, b = cluster.add("a", 1), cluster.add("b", 2)
        b.parent.put(key(1))  # key 2 was evicted after the router saw it
        warm = a.request("warm", kv_source("kv0", b))
        a.lookup(warm, *KEYS)
        cluster.run()
        req = self.hinted(a, b, "c", held=64)
        assert a.lookup(req, *KEYS) == [HIT, HIT, MISS]
        job, _ = a.load(req, keys(1, 2))
        cluster.run()
        assert a.outcome(job) is False
        assert a.lookup(req, *KEYS) == [MISS] * 3  # the engine computes them
        a.finish(req)
        a.finish(warm)
        cluster.run()
        assert b.parent.pins == {}
        assert b.parent.open_requests == {}

    def test_before_the_session_is_ready_the_peer_is_probed(self, cluster: Cluster) -> None:
        a, b = cluster.add("a", 1), cluster.add("b", 2)
        for k in keys(1, 2):
            b.parent.put(k)
        req = self.hinted(a, b, "c", held=64)
        assert a.lookup(req, *KEYS) == [RETRY] * 3  # nothing known of the peer yet
        assert resolve(cluster, a, req, *KEYS) == [HIT, HIT, MISS]
        job, _ = a.load(req, keys(1, 2))
        cluster.run()
        assert a.outcome(job) is True

    def test_a_key_without_a_known_position_is_probed(self, cluster: Cluster) -> None:
        a, b = cluster.add("a", 1), cluster.add("b", 2)
        warm = a.request("warm", kv_source("kv0", b))
        a.lookup(warm, *KEYS)
        cluster.run()
        req = self.hinted(a, b, "c", held=64)
        assert a.lookup(req, key(9)) == [RETRY]


class TestPullConfirmed:
    """Which pulls the engine's scheduler may wait for inside its lookup (issue 27,
    kvpeer.integrations.vllm.manager): those whose source holds the blocks now, over a
    session that is ready."""

    def test_a_symmetric_pull_and_a_pd_pull_after_its_prefill_answered(
        self, cluster: Cluster
    ) -> None:
        a, b = cluster.add("a", 1), cluster.add("b", 2)
        symmetric = a.request("s", kv_source("kv1", b))
        after_prefill = a.request("d", {"remote_prefiller": {**b.source("kv2"),
                                                             "prefill_done": True}})  # fmt: skip
        assert not a.tier.pull_confirmed(symmetric)  # the session is still shaking hands
        cluster.run()
        assert a.tier.pull_confirmed(symmetric)
        assert a.tier.pull_confirmed(after_prefill)

    def test_not_a_pd_pull_whose_prefill_may_still_run_nor_a_local_request(
        self, cluster: Cluster
    ) -> None:
        a, b = cluster.add("a", 1), cluster.add("b", 2)
        pd = a.request("p", prefiller("kv1", b))
        cluster.run()
        assert not a.tier.pull_confirmed(pd)
        assert not a.tier.pull_confirmed(a.request("l"))
        assert not a.tier.pull_confirmed(RequestContext("never-started", None))

    def test_not_from_a_peer_that_never_answers_nor_once_the_pull_failed(
        self, cluster: Cluster
    ) -> None:
        a, b = cluster.add("a", 1), cluster.add("b", 2)
        ghostly = a.request("g", {"remote_kv_source": ghost("kv9", port=9)})
        req = a.request("s", kv_source("kv1", b))
        cluster.run()
        assert not a.tier.pull_confirmed(ghostly)  # never ready
        assert a.tier.pull_confirmed(req)
        cluster.restart(b)  # a new process: the session to the old one is dead
        cluster.run()
        assert a.lookup(req, KEYS[0]) == [MISS]
        assert not a.tier.pull_confirmed(req)


class TestSlowSources:
    """The attacker's test of the engine's wait (issue 27): a peer that takes the fetch
    and never answers costs the consumer's scheduler a few bounded waits, not one per
    request: after two waits in vain in a row the engine does not wait for that peer
    for a while (one is forgiven: a session's first pull may still map memory)."""

    def test_a_peer_that_made_the_engine_wait_in_vain_is_not_waited_for_again(
        self, cluster: Cluster
    ) -> None:
        a, b, c = cluster.add("a", 1), cluster.add("b", 2), cluster.add("c", 3)
        first = a.request("s1", kv_source("kv1", b))
        other = a.request("s3", kv_source("kv3", c))
        cluster.run()
        assert a.tier.pull_confirmed(first)
        for _ in range(SLOW_PULL_MISSES - 1):
            a.tier.promotion_waited(first, 0.05, done=False)
            assert a.tier.pull_confirmed(first)  # forgiven so far
        a.tier.promotion_waited(first, 0.05, done=False)  # b never answers in time
        assert not a.tier.pull_confirmed(a.request("s2", kv_source("kv2", b)))
        assert a.tier.pull_confirmed(other)  # others: unchanged
        cluster.advance(SLOW_PULL_BACKOFF_S + 0.1)
        assert a.tier.pull_confirmed(first)
        a.tier.promotion_waited(first, 0.004, done=True)
        a.tier.promotion_waited(first, 0.05, done=False)  # a landing reset the count
        assert a.tier.pull_confirmed(first)

    def test_a_pull_that_lands_clears_the_backoff_at_once(self, cluster: Cluster) -> None:
        a, b = cluster.add("a", 1), cluster.add("b", 2)
        slow = a.request("s1", kv_source("kv1", b))
        cluster.run()
        for _ in range(SLOW_PULL_MISSES):
            a.tier.promotion_waited(slow, 0.05, done=False)
        assert not a.tier.pull_confirmed(slow)
        a.tier.promotion_waited(slow, 0.01, done=True)  # a promotion landed after all
        assert a.tier.pull_confirmed(slow)

    def test_what_it_remembers_of_peers_stays_bounded_by_max_peers(self) -> None:
        cluster = Cluster()
        a = cluster.add("a", 1, {"max_peers": 2})
        for i in range(4):  # sessions end between requests, so a meets four peers in turn
            peer = cluster.add(f"p{i}", 10 + i)
            request = a.request(f"s{i}", kv_source(f"kv{i}", peer))
            cluster.run()
            for _ in range(SLOW_PULL_MISSES):
                a.tier.promotion_waited(request, 0.05, done=False)
            a.finish(request)
            cluster.run()
            assert len(a.tier._waits) <= 2
        assert "p3:13" in a.tier._waits  # the newest is kept; the oldest gave way


def test_the_engines_waits_for_pulls_are_counted_by_outcome() -> None:
    cluster = Cluster()
    a, b = cluster.add("a", 1), cluster.add("b", 2)
    first = a.request("s1", kv_source("kv1", b))
    a.tier.promotion_waited(first, 0.004, done=True)
    a.tier.promotion_waited(first, 0.05, done=False)
    a.tier.promotion_waited(a.request("l"), 0.05, done=False)  # not a pull: not counted
    counters = a.tier.counters()
    assert counters.pull_waits == {"landed": 1, "missed": 1}
    assert counters.pull_wait_seconds.count == 2
    assert counters.pull_wait_seconds.total == pytest.approx(0.054)
