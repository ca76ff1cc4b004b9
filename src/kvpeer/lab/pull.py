"""Pull blocks from a peer without an engine: the consumer half of tests and benchmarks.

:class:`Puller` plays the engine's part against a running node: it opens a
symmetric request toward a peer, probes keys until they are answered, submits
one load of the leading hits into slots the caller chose, and waits for the
job's result. It measures the lookup phase and the load (fetch -> data ->
``transfer_done``) separately.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from kvpeer.node.driver import DrivenTier
from kvpeer.node.params import split_peer_id
from kvpeer.types import Key, LookupResult, RequestContext, TransferJob

__all__ = ["PullResult", "Puller"]


@dataclass(frozen=True, slots=True)
class PullResult:
    hits: int  # leading keys the peer confirmed
    loaded: bool  # the load of those hits succeeded
    lookup_s: float
    load_s: float  # submit_load -> job result


class Puller:
    """Drives a :class:`DrivenTier` the way an engine would, for one request at a time."""

    def __init__(self, node: DrivenTier, peer_id: str, *, job_ids_from: int = 1 << 40) -> None:
        address = split_peer_id(peer_id)
        if address is None:
            raise ValueError(f"peer id {peer_id!r} is not host:port")
        self._node = node
        self._host, self._port = address
        self._job_ids = itertools.count(job_ids_from)
        self._seq = itertools.count()

    def pull(
        self, keys: Sequence[Key], slots: Sequence[int], *, timeout_s: float = 30.0
    ) -> PullResult:
        if len(keys) != len(slots):
            raise ValueError(f"{len(keys)} keys but {len(slots)} slots")
        context = RequestContext(
            f"pull-{next(self._seq)}",
            {
                "remote_kv_source": {
                    "kv_request_id": f"pull-{uuid.uuid4().hex}",
                    "remote_host": self._host,
                    "remote_port": self._port,
                }
            },
        )
        node = self._node
        node.on_new_request(context)
        try:
            deadline = time.monotonic() + timeout_s
            started = time.perf_counter()
            while True:
                answers = [node.lookup(key, context) for key in keys]
                node.on_schedule_end()
                if LookupResult.RETRY not in answers or time.monotonic() > deadline:
                    break
                time.sleep(0.0002)
            lookup_s = time.perf_counter() - started
            hits = 0
            for answer in answers:
                if answer is not LookupResult.HIT:
                    break
                hits += 1
            if hits == 0:
                return PullResult(0, False, lookup_s, 0.0)
            job_id = next(self._job_ids)
            started = time.perf_counter()
            node.submit_load(TransferJob(job_id, tuple(keys[:hits]), tuple(slots[:hits]), context))
            while True:
                for result in node.get_finished_jobs():
                    if result.job_id == job_id:
                        return PullResult(
                            hits, result.success, lookup_s, time.perf_counter() - started
                        )
                if time.monotonic() > deadline:
                    return PullResult(hits, False, lookup_s, time.perf_counter() - started)
                node.wait_for_work(0.05)
        finally:
            node.on_request_finished(context)
