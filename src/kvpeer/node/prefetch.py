"""A router's prefetch carried out: checked, its source's session opened, its fetch sent.

What is staged, and for whom, is :mod:`kvpeer.node.ahead`'s (:class:`PullAhead`);
this is the tier's side of a prefetch that arrived on the control link
(:meth:`kvpeer.node.peertable.PeerTable.take_prefetches`): it is refused, with a named
reason the sender reads, when its request is here already (that request pulls for
itself: a second fetch would move the same blocks twice), when
:meth:`PullAhead.admit` refuses it, or when its source cannot be reached now (backed
off, ``allowed_peers`` or ``max_peers``, or the session refused the fetch). What the
fetch yields comes back as a load of the session (:mod:`kvpeer.node.outcomes`).
"""

from __future__ import annotations

from kvpeer.errors import ProtocolError
from kvpeer.node.ahead import PullAhead
from kvpeer.node.counters import TierCounters
from kvpeer.node.outcomes import Outcomes
from kvpeer.node.peertable import PeerTable
from kvpeer.node.requests import OpenRequests
from kvpeer.node.trace import Trace
from kvpeer.protocol import Prefetch
from kvpeer.transport.base import InboundFrame

__all__ = ["Prefetcher"]


class Prefetcher:
    """Carries out the prefetches routers send this node."""

    def __init__(
        self,
        peers: PeerTable,
        requests: OpenRequests,
        ahead: PullAhead,
        outcomes: Outcomes,
        counters: TierCounters,
        trace: Trace,
    ) -> None:
        self._peers = peers
        self._requests = requests
        self._ahead = ahead
        self._outcomes = outcomes
        self._counters = counters
        self._trace = trace

    def prefetch(self, inbound: InboundFrame, message: Prefetch, now: float) -> None:
        """Fetch into staging now, or refuse."""
        if self._requests.pulls(message.kv_request_id):
            # the request came first and pulls for itself: a second fetch would only
            # move the same blocks twice
            self._counters.ahead["prefetches"] += 1
            self._counters.ahead["refused"] += 1
            self._peers.refuse_prefetch(inbound, message, "its request is here already")
            return
        fetch = self._ahead.admit(inbound.source, message, now)
        if isinstance(fetch, str):
            self._peers.refuse_prefetch(inbound, message, fetch)
            return
        backed_off = self._peers.backed_off(fetch.peer_id, now)
        peer = None if backed_off else self._outcomes.open(fetch.peer_id, now)
        if peer is None:
            self._ahead.abandon(fetch)
            self._peers.refuse_prefetch(inbound, message, f"cannot reach {fetch.peer_id} now "
                                        "(backed off, allowed_peers or max_peers)")  # fmt: skip
            return
        peer.last_used = now
        if self._trace.enabled:
            self._trace.emit(fetch.kv_request_id, "prefetch", peer=fetch.peer_id,
                             request=message.kv_request_id, blocks=len(fetch.keys))  # fmt: skip
        try:
            peer.session.request_blocks(fetch.job_id, fetch.kv_request_id, fetch.keys,
                                        fetch.rows, now, resolve=True)  # fmt: skip
        except ProtocolError as exc:
            self._ahead.abandon(fetch)
            self._peers.refuse_prefetch(inbound, message, f"fetch refused: {exc}")
