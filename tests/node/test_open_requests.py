"""The engine's open requests (kvpeer.node.requests): failed ids, twins, nothing kept.

Invariants as numbered in :mod:`kvpeer.node.requests`. The tier's tests check the same
rules end to end; these pin them on the part that holds them.
"""

from __future__ import annotations

from kvpeer.node.params import LOCAL, Routing, Source
from kvpeer.node.requests import OpenRequests


def pulling(kv_request_id: str, peer_id: str = "peer-b") -> Routing:
    """A symmetric consumer's routing: pull ``kv_request_id`` from ``peer_id``."""
    return Routing(Source(kv_request_id=kv_request_id, peer_id=peer_id, probe=True))


def test_an_id_fails_only_while_a_live_request_pulls_it() -> None:
    """Invariant 1: failing an id nobody pulls keeps nothing; the failure leaves with
    the id's last request."""
    requests = OpenRequests()
    requests.fail("nobody-pulls-it")
    assert not requests.failed("nobody-pulls-it")
    assert requests.failed_ids == 0
    requests.open("r1", pulling("x"))
    requests.fail("x")
    assert requests.failed("x")
    requests.close("r1")
    assert not requests.failed("x")
    requests.open("r2", pulling("x"))  # the same id again: a fresh start
    assert not requests.failed("x")


def test_twins_finish_their_consumer_state_with_the_last_of_them() -> None:
    """Invariant 3: two requests pulling one id from one peer (parallel sampling) share
    the session's consumer state; only the last to close says to finish it."""
    requests = OpenRequests()
    requests.open("r1", pulling("x"))
    requests.open("r2", pulling("x"))
    requests.fail("x")
    first = requests.close("r1")
    assert first.routing.source is not None
    assert not first.last_puller
    assert requests.failed("x")  # the twin still pulls it, still MISS
    assert requests.close("r2").last_puller
    assert not requests.failed("x")


def test_nothing_is_kept_once_every_request_closed() -> None:
    """Invariant 2: every entry leaves with its request; an unknown id is local."""
    requests = OpenRequests()
    requests.open("r1", pulling("x", "peer-b"))
    requests.open("r2", pulling("y", "peer-c"))
    requests.open("r3", LOCAL)
    assert requests.pulled_from() == {"peer-b", "peer-c"}
    assert (len(requests), requests.consumer_ids) == (3, 2)
    for req_id in ("r1", "r2", "r3"):
        requests.close(req_id)
    assert (len(requests), requests.consumer_ids, requests.failed_ids) == (0, 0, 0)
    assert requests.pulled_from() == set()
    assert requests.close("never-opened") == (LOCAL, False)
    assert requests.routing("never-opened") is LOCAL


def test_a_lost_peer_fails_every_id_pulled_from_it_and_no_other() -> None:
    requests = OpenRequests()
    requests.open("r1", pulling("x", "peer-b"))
    requests.open("r2", pulling("y", "peer-b"))
    requests.open("r3", pulling("z", "peer-c"))
    requests.fail_pulling_from("peer-b")
    assert [requests.failed(i) for i in ("x", "y", "z")] == [True, True, False]
    assert requests.failed_ids == 2
