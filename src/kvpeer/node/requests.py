"""The engine's open requests: each one's routing, which ids they pull and which answer MISS.

Invariants (the tier's 2 and 3, :mod:`kvpeer.node.tier`):

1. An id is failed (:meth:`OpenRequests.failed`) only while a live consumer
   request pulls it: :meth:`OpenRequests.fail` ignores any other id, and the
   id leaves the failed set with its last request.
2. Every entry leaves with the request that made it (:meth:`OpenRequests.close`):
   nothing here grows with the number of requests ever served.
3. Twins (parallel sampling: same id, same peer) share one consumer state in
   the session: :meth:`OpenRequests.close` says to finish it only when the last
   of them closes.
"""

from __future__ import annotations

from typing import NamedTuple

from kvpeer.node.params import LOCAL, Routing, Source

__all__ = ["Closed", "OpenRequests"]


class Closed(NamedTuple):
    """:meth:`OpenRequests.close`: the request's routing, and whether it was the last
    open request pulling its id from its source (its session's consumer state for
    that id is finished now)."""

    routing: Routing
    last_puller: bool


class OpenRequests:
    """Routing by engine request id, and the consumer ids they pull."""

    def __init__(self) -> None:
        self._routing: dict[str, Routing] = {}
        self._consumer_refs: dict[str, int] = {}  # kv id -> open requests pulling it
        self._pulling: dict[tuple[str, str], int] = {}  # (peer, id) -> open requests
        self._failed: set[str] = set()

    def open(self, req_id: str, routing: Routing) -> None:
        self._routing[req_id] = routing
        source = routing.source
        if source is not None:
            kv_request_id = source.kv_request_id
            self._consumer_refs[kv_request_id] = self._consumer_refs.get(kv_request_id, 0) + 1
            pulled = (source.peer_id, kv_request_id)
            self._pulling[pulled] = self._pulling.get(pulled, 0) + 1

    def close(self, req_id: str) -> Closed:
        """Forget ``req_id`` (invariants 2 and 3); an unknown id is a local request."""
        routing = self._routing.pop(req_id, LOCAL)
        source = routing.source
        if source is None:
            return Closed(routing, False)
        kv_request_id = source.kv_request_id
        pulled = (source.peer_id, kv_request_id)
        users = self._pulling.get(pulled, 1) - 1
        if users > 0:
            self._pulling[pulled] = users  # a twin still pulls it
        else:
            self._pulling.pop(pulled, None)
        refs = self._consumer_refs.get(kv_request_id, 1) - 1
        if refs > 0:
            self._consumer_refs[kv_request_id] = refs
        else:
            self._consumer_refs.pop(kv_request_id, None)
            self._failed.discard(kv_request_id)
        return Closed(routing, users <= 0)

    def routing(self, req_id: str) -> Routing:
        return self._routing.get(req_id, LOCAL)

    def source(self, req_id: str) -> Source | None:
        return self._routing.get(req_id, LOCAL).source

    def pulls(self, kv_request_id: str) -> bool:
        """Whether an open request pulls ``kv_request_id``."""
        return kv_request_id in self._consumer_refs

    def fail(self, kv_request_id: str) -> None:
        """``kv_request_id`` answers MISS until its last request closes (invariant 1)."""
        if kv_request_id in self._consumer_refs:
            self._failed.add(kv_request_id)

    def failed(self, kv_request_id: str) -> bool:
        return kv_request_id in self._failed

    def fail_pulling_from(self, peer_id: str) -> None:
        """Every open request pulling from ``peer_id`` computes locally from now on."""
        for routing in self._routing.values():
            if routing.source is not None and routing.source.peer_id == peer_id:
                self.fail(routing.source.kv_request_id)

    def pulled_from(self) -> set[str]:
        """Peers an open request pulls from."""
        return {r.source.peer_id for r in self._routing.values() if r.source is not None}

    def __len__(self) -> int:
        return len(self._routing)

    @property
    def consumer_ids(self) -> int:
        return len(self._consumer_refs)

    @property
    def failed_ids(self) -> int:
        return len(self._failed)
