"""Pulling ahead: blocks a router asked for, fetched into staging rows before the engine looks.

A router that sends a request to this engine and names a peer that holds its prefix
also sends this node a ``prefetch`` (:class:`kvpeer.protocol.Prefetch`): the peer and
the prompt's tokens up to what the peer holds. The node turns the tokens into the
engine's own keys (the host's ``keys_of``: the engine's hash, so a prefetched key is
exactly the key the scheduler will look up), reserves *staging rows* - rows of the
primary region the host withheld from its own cache once, at start - and fetches the
blocks into them at once, over the session and data plane an ordinary pull uses, with
``resolve`` (the peer writes what it holds; nothing is probed first). When the
engine's scheduler then looks the prompt up, a staged key answers HIT, and the load it
submits is a copy from the staging rows into the rows the engine reserved, done on
the engine's thread and reported in the same call: no network, no wait for a step.

Invariants:

1. Every staging row is in exactly one place: free, or one entry of ``_entries``
   (fetching, staged, or claimed by an engine job). A fetching row is written only by
   its fetch, and is freed only when that fetch is reported, success or not: the
   session reports a load only once nothing of it can still touch our memory.
2. A row is copied out only after its fetch succeeded; a failed or abandoned fetch
   stages nothing and frees its rows.
3. Nothing staged outlives ``prefetch_ttl_s`` unclaimed: expired rows are freed by
   :meth:`PullAhead.expire`; a prefetch that finds no free row evicts staged rows,
   oldest first (never fetching or claimed ones). A claimed row is freed when its job
   is served or failed. At shutdown waiting jobs fail; fetching rows end with their
   sessions.
4. A prefetch from a sender outside ``prefetch_from`` (by default the peers the node
   trusts already: :meth:`kvpeer.config.TierConfig.prefetch_trusted`) changes nothing:
   it is answered with a named refusal (:meth:`PullAhead.admit`), as is every prefetch this node
   cannot carry out (no staging rows, no way to hash, a bad source, staging full).
5. An engine job is served from staging only if every key of it is staged or being
   fetched, and never a PD consumer's (its producer parks its stores for one fetch).
   It is reported exactly once: copied at once, or when the fetches it waits for end
   (failed if any of them failed). Any other job goes the ordinary way.
6. Ahead fetches carry job ids below zero (the engine's are not), so their results
   never reach the engine.
7. A host that can (kvpeer's vLLM manager) takes staged rows into its cache as they
   are (:meth:`PullAhead.adopt`) and gives back as many rows it had just allocated for
   those keys: the set of staging rows changes, its size never does, and a row is
   never in both the engine's cache and staging.
8. An engine job waits only for fetches from its own request's source: one from
   another peer (a router's mistake, or a source that changed) would give the request
   that peer's delays instead of its own; such keys count as absent for it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvpeer.config import TierConfig
from kvpeer.node.counters import TierCounters
from kvpeer.node.params import split_peer_id
from kvpeer.protocol import Prefetch, limits
from kvpeer.transport.data.base import PrimaryRegion
from kvpeer.types import JobResult, Key, TransferJob

__all__ = ["AheadFetch", "KeysOf", "PullAhead", "RowCopy", "row_copier"]

log = logging.getLogger("kvpeer.ahead")

#: The engine's keys of a prompt prefix (its own hash), at most about ``max_keys`` of
#: them (the host may stop hashing there); None if it cannot tell yet.
KeysOf = Callable[[Sequence[int], int], list[Key] | None]
#: Copy rows of the primary region: ``(from_row, to_row)`` pairs.
RowCopy = Callable[[Sequence[tuple[int, int]]], None]


@dataclass(slots=True)
class _Entry:
    row: int
    fetch: int | None  # the ahead job writing it; None once staged
    deadline: float  # staged: freed unused after this
    claimed: bool = False  # an engine job waits to copy it


@dataclass(frozen=True, slots=True)
class AheadFetch:
    """One prefetch to send: ``keys`` into ``rows`` from ``peer_id``, as ``job_id``."""

    job_id: int
    kv_request_id: str  # the id on the wire, ours ("ahead:N")
    peer_id: str
    keys: tuple[Key, ...]
    rows: tuple[int, ...]


class PullAhead:
    """The staging rows, what they hold, and the engine jobs served from them."""

    def __init__(self, config: TierConfig, counters: TierCounters, local_id: str) -> None:
        self._allowed = config.prefetch_trusted()
        self._ttl_s = config.prefetch_ttl_s
        self._counters = counters.ahead
        self._local_id = local_id
        self._rows: frozenset[int] = frozenset()
        self._free: list[int] = []
        self._entries: dict[Key, _Entry] = {}  # insertion order: oldest first
        self._fetches: dict[int, AheadFetch] = {}
        self._waiting: list[TransferJob] = []  # engine jobs waiting for fetches
        self._give_up: dict[int, float] = {}  # waiting job id -> when it fails (give_up_s)
        self._requests: set[str] = set()  # engine requests that found staged keys
        self._keys_of: KeysOf | None = None
        self._copy: RowCopy | None = None
        self._block_len = 0
        self._next_job = -1
        self._shut = False
        self._discard: set[int] = set()  # fetches to stage nothing from (clear)

    # -- set-up by the host ---------------------------------------------------------

    def configure(
        self, rows: Sequence[int], keys_of: KeysOf, copy: RowCopy, block_len: int
    ) -> None:
        """The host withheld ``rows`` of its primary region for staging, once."""
        if self._rows:
            raise RuntimeError("staging rows were configured already")
        if len(set(rows)) != len(rows) or any(r < 0 for r in rows):
            raise ValueError(f"staging rows must be distinct and >= 0, got {list(rows)[:8]}")
        self._rows = frozenset(rows)
        self._free = list(reversed(rows))
        self._keys_of = keys_of
        self._copy = copy
        self._block_len = block_len

    @property
    def rows(self) -> frozenset[int]:
        return self._rows

    # -- the router's prefetch (invariant 4) -----------------------------------------

    def admit(self, source: str | None, message: Prefetch, now: float) -> AheadFetch | str:
        """What to fetch for ``message`` from the connection at address ``source``
        (None: a transport that cannot tell), or why nothing is."""
        self._counters["prefetches"] += 1
        reason = self._refusal(source, message)
        if reason is not None:
            return self._refused(reason)
        assert self._keys_of is not None
        most = min(len(self._rows), limits.MAX_ITEMS)  # one fetch names at most MAX_ITEMS
        try:
            keys = self._keys_of(message.tokens, most)
        except Exception as exc:  # the host's hash refused these tokens
            return self._refused(f"cannot hash the prompt: {exc}")
        if not keys:
            return self._refused("the prompt is shorter than one block, or the engine "
                                 "cannot hash prompts yet")  # fmt: skip
        wanted = [key for key in dict.fromkeys(keys) if key not in self._entries]
        if not wanted:
            self._counters["already_staged"] += 1
            return self._refused("every block is staged or being fetched already")
        wanted = wanted[:most]
        self._make_room(len(wanted))
        wanted = wanted[: len(self._free)]
        if not wanted:
            return self._refused(f"staging full ({len(self._rows)} rows, staging_blocks)")
        rows = tuple(self._free.pop() for _ in wanted)
        job_id = self._next_job
        self._next_job -= 1
        fetch = AheadFetch(job_id, f"ahead:{-job_id}", message.source, tuple(wanted), rows)
        for key, row in zip(wanted, rows, strict=True):
            self._entries[key] = _Entry(row, job_id, now + self._ttl_s)
        self._fetches[job_id] = fetch
        self._counters["blocks_fetched"] += len(wanted)
        return fetch

    def _refusal(self, source: str | None, message: Prefetch) -> str | None:
        if self._shut:
            return "this node is shutting down"
        if self._allowed.nobody or (source is not None and not self._allowed.allows_source(source)):
            return (f"prefetch from {source or 'this sender'} is not allowed (prefetch_from; by "
                    "default an explicit allowed_peers list, CURVE, or this host's loopback)")
        if not self._rows or self._keys_of is None:
            return "this node stages nothing (staging_blocks is 0, or its engine withholds no rows)"
        if split_peer_id(message.source) is None:
            return f"source {message.source[:64]!r} is not host:port"
        if message.source == self._local_id:
            return "source is this node"
        return None

    def _refused(self, reason: str) -> str:
        self._counters["refused"] += 1
        return reason

    def _make_room(self, needed: int) -> None:
        """Evict staged, unclaimed rows, oldest first, until ``needed`` are free."""
        if len(self._free) >= needed:
            return
        for key, entry in list(self._entries.items()):
            if entry.fetch is None and not entry.claimed:
                del self._entries[key]
                self._free.append(entry.row)
                self._counters["blocks_evicted"] += 1
                if len(self._free) >= needed:
                    return

    def abandon(self, fetch: AheadFetch) -> None:
        """``fetch`` was never sent (its peer refused): its rows are free again."""
        self._end_fetch(fetch.job_id, success=False)

    # -- what the fetches did -----------------------------------------------------------

    def owns(self, job_id: int) -> bool:
        return job_id in self._fetches

    def landed(self, job_id: int, success: bool, now: float) -> list[JobResult]:
        """The fetch ``job_id`` was reported; the engine jobs this settles."""
        fetch = self._fetches.get(job_id)
        if fetch is None:
            return []
        if not success:
            self._counters["fetches_failed"] += 1
        self._end_fetch(job_id, success=success, now=now)
        return self._settle(now)

    def _end_fetch(self, job_id: int, *, success: bool, now: float = 0.0) -> None:
        fetch = self._fetches.pop(job_id)
        if job_id in self._discard:
            self._discard.discard(job_id)
            success = False  # started before the engine dropped its cache
        for key in fetch.keys:
            entry = self._entries.get(key)
            if entry is None or entry.fetch != job_id:
                continue
            if success:
                entry.fetch = None
                entry.deadline = now + self._ttl_s
                self._counters["blocks_staged"] += 1
            else:
                del self._entries[key]
                self._free.append(entry.row)

    # -- the engine's side -----------------------------------------------------------------

    def _usable(self, entry: _Entry, peer_id: str | None) -> bool:
        """Staged, or being fetched from ``peer_id`` (invariant 8)."""
        if entry.fetch is None:
            return True
        fetch = self._fetches.get(entry.fetch)
        return fetch is not None and fetch.peer_id == peer_id

    def holds(self, key: Key, peer_id: str | None = None) -> bool:
        """Staged, or being fetched from ``peer_id`` (the request's own source): a lookup
        of ``key`` by that request may answer HIT."""
        entry = self._entries.get(key)
        return entry is not None and self._usable(entry, peer_id)

    def found(self, req_id: str) -> None:
        """Engine request ``req_id`` found a staged key (its load is worth waiting for)."""
        self._requests.add(req_id)

    def confirmed(self, req_id: str) -> bool:
        return req_id in self._requests

    def forget(self, req_id: str) -> None:
        self._requests.discard(req_id)

    def state(self, keys: Sequence[Key], peer_id: str | None = None) -> bool | None:
        """True: every key staged (and unclaimed); False: every key staged or being
        fetched from ``peer_id``, some still fetching; None: a key is not here (or is
        being fetched from another peer)."""
        fetching = False
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or entry.claimed or not self._usable(entry, peer_id):
                return None
            fetching |= entry.fetch is not None
        return not fetching

    def adopt(self, keys: Sequence[Key], rows: Sequence[int]) -> list[int] | None:
        """Hand the staged rows of ``keys`` to the engine, which takes them into its own
        cache as they are, and take ``rows`` (as many, just allocated by the engine and
        used by nothing) as staging rows in their place: a staged prompt with no copy
        (invariant 7). None, and nothing changes, unless every key is staged."""
        if self._shut or len(rows) != len(keys) or self.state(keys) is not True:
            return None
        if any(row < 0 for row in rows) or len(set(rows)) != len(rows):
            return None
        taken = [self._entries.pop(key).row for key in keys]
        mine = self._rows.difference(taken).union(rows)
        if len(mine) != len(self._rows):
            for key, row in zip(keys, taken, strict=True):  # a row named twice: undo
                self._entries[key] = _Entry(row, None, 0.0)
            return None
        self._rows = frozenset(mine)
        self._free.extend(rows)
        self._counters["blocks_used"] += len(keys)
        self._counters["jobs_adopted"] += 1
        return taken

    def fetching(self) -> list[tuple[str, str]]:
        """(peer id, kv request id on the wire) of every fetch into staging running now."""
        return [(f.peer_id, f.kv_request_id) for f in self._fetches.values()]

    def staged(self) -> list[tuple[Key, int]]:
        """(key, row) of every staged block (fetched, not yet handed to the engine)."""
        return [(key, e.row) for key, e in self._entries.items() if e.fetch is None]

    def take(
        self, job: TransferJob, now: float, peer_id: str | None = None, *,
        give_up_s: float | None = None,
    ) -> list[JobResult] | None:
        """Serve ``job`` from staging (invariant 5): its results now (empty while it
        waits for fetches from ``peer_id``, its request's source), or None if it is not
        ours to serve. ``give_up_s``: a job still waiting that long fails (the engine
        computes its blocks; the fetch goes on and stages them for whoever comes)."""
        entries = self._entries
        if not job.keys or self._shut:
            return None
        for key in job.keys:
            entry = entries.get(key)
            if entry is None or not self._usable(entry, peer_id):
                return None
        if len(set(job.keys)) != len(job.keys):
            return None  # the engine's bug, not ours to copy
        for key in job.keys:
            entries[key].claimed = True
        self._waiting.append(job)
        if give_up_s is not None:
            self._give_up[job.job_id] = now + give_up_s
        return self._settle(now)

    def _settle(self, now: float) -> list[JobResult]:
        """Copy out every waiting job whose keys are all staged; fail those that lost one."""
        results: list[JobResult] = []
        still: list[TransferJob] = []
        for job in self._waiting:
            entries = [self._entries.get(key) for key in job.keys]
            give_up = self._give_up.get(job.job_id)
            if any(entry is None for entry in entries):
                self._release(job.keys)
                self._counters["jobs_failed"] += 1
                results.append(JobResult(job.job_id, False))
            elif any(entry is not None and entry.fetch is not None for entry in entries):
                if give_up is not None and now >= give_up:
                    self._release(job.keys)  # the fetch lands unclaimed: staged as usual
                    self._counters["jobs_given_up"] += 1
                    results.append(JobResult(job.job_id, False))
                else:
                    still.append(job)
            else:
                results.append(self._copy_out(job))
        self._waiting = still
        waiting = {job.job_id for job in still}
        self._give_up = {j: t for j, t in self._give_up.items() if j in waiting}
        return results

    def give_up(self, now: float) -> list[JobResult]:
        """Fail the waiting jobs whose ``give_up_s`` passed (invariant 5)."""
        if not any(now >= due for due in self._give_up.values()):
            return []
        return self._settle(now)

    def _copy_out(self, job: TransferJob) -> JobResult:
        assert self._copy is not None
        entries = self._entries
        pairs = [(entries[key].row, slot) for key, slot in zip(job.keys, job.slots, strict=True)]
        started = time.perf_counter()
        try:
            self._copy(pairs)
        except Exception:  # our own fault (a slot outside the region): compute instead
            log.exception("copying staged blocks of job %s failed", job.job_id)
            self._release(job.keys)
            self._counters["jobs_failed"] += 1
            return JobResult(job.job_id, False)
        seconds = time.perf_counter() - started
        self._release(job.keys)
        self._counters["blocks_used"] += len(pairs)
        self._counters["jobs_served"] += 1
        return JobResult(job.job_id, True, seconds, len(pairs) * self._block_len)

    def _release(self, keys: Sequence[Key]) -> None:
        """A job is done with ``keys``: staged rows are freed, and one still being
        fetched (its job failed over another key) is unclaimed, so it expires or is
        evicted like any other once it lands."""
        for key in keys:
            entry = self._entries.get(key)
            if entry is None:
                continue
            if entry.fetch is None:
                del self._entries[key]
                self._free.append(entry.row)
            else:
                entry.claimed = False

    # -- time and the end ------------------------------------------------------------------

    def expire(self, now: float) -> None:
        """Free staged rows nobody claimed by their deadline (invariant 3)."""
        if not self._entries:
            return
        for key, entry in list(self._entries.items()):
            if entry.fetch is None and not entry.claimed and now >= entry.deadline:
                del self._entries[key]
                self._free.append(entry.row)
                self._counters["blocks_expired"] += 1

    def next_deadline(self) -> float | None:
        return min(
            [*(e.deadline for e in self._entries.values() if e.fetch is None and not e.claimed),
             *self._give_up.values()],
            default=None,
        )

    def clear(self) -> list[JobResult]:
        """The engine dropped its cache (vLLM's ``reset_cache``: new weights, sleep):
        nothing staged may be handed out any more. Staged rows are freed, waiting jobs
        fail, and fetches still running free their rows when they end, staging nothing;
        the set of rows stays."""
        results = [JobResult(job.job_id, False) for job in self._waiting]
        self._waiting = []
        self._give_up.clear()
        self._counters["jobs_failed"] += len(results)
        for key, entry in list(self._entries.items()):
            if entry.fetch is None:
                del self._entries[key]
                self._free.append(entry.row)
            else:
                entry.claimed = False
        self._discard.update(self._fetches)
        return results

    def shutdown(self) -> list[JobResult]:
        """Fail every waiting job; staged rows are free again (fetching ones end with
        their sessions, which the tier closes first)."""
        self._shut = True
        results = [JobResult(job.job_id, False) for job in self._waiting]
        self._waiting = []
        self._give_up.clear()
        for fetch in list(self._fetches.values()):
            self._end_fetch(fetch.job_id, success=False)
        for key in list(self._entries):
            self._free.append(self._entries.pop(key).row)
        # The copier holds a view of the engine's region: dropped, so the engine can unmap
        # it once the tier shut down (vLLM closes the region after its tiers).
        self._copy = None
        self._keys_of = None
        return results

    def statistics(self) -> tuple[int, int, int]:
        """(staged blocks, blocks being fetched, free rows)."""
        fetching = sum(1 for e in self._entries.values() if e.fetch is not None)
        return len(self._entries) - fetching, fetching, len(self._free)


def row_copier(region: PrimaryRegion) -> RowCopy:
    """Copy whole rows of ``region`` (staging row -> the engine's row), each run of
    consecutive rows on both sides as one ``memmove``."""
    flat = np.frombuffer(region.view, dtype=np.uint8)
    size, rows = region.block_len, region.num_blocks

    def copy(pairs: Sequence[tuple[int, int]]) -> None:
        for src, dst in pairs:
            if not (0 <= src < rows and 0 <= dst < rows):
                raise ValueError(f"row copy {src} -> {dst} outside {rows} rows")
        i = 0
        while i < len(pairs):
            src, dst = pairs[i]
            n = 1
            while i + n < len(pairs) and pairs[i + n] == (src + n, dst + n):
                n += 1
            flat[dst * size : (dst + n) * size] = flat[src * size : (src + n) * size]
            i += n

    return copy
