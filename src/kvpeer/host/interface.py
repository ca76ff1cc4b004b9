"""The engine-facing tier interface (docs/design.md section 4.2): what a host drives.

The host layer defines it, as vLLM defines the tiers its tiering manager drives,
and :mod:`kvpeer.node` implements it, so the host never imports the node. It
mirrors vLLM's ``SecondaryTierManager`` so the vLLM adapter stays thin. The
engine calls these on one thread, never concurrently. ``get_finished_jobs``
reports every submitted job exactly once; ``serve_external_requests`` is the
only window in which the tier may call the parent.
"""

from __future__ import annotations

from typing import Protocol

from kvpeer.session.ports import Parent
from kvpeer.types import JobResult, Key, LookupResult, OffloadPolicy, RequestContext, TransferJob

__all__ = ["SecondaryTier"]


class SecondaryTier(Protocol):
    """A secondary KV tier driven by a host's tiering manager."""

    def on_new_request(self, request: RequestContext) -> OffloadPolicy: ...

    def lookup(self, key: Key, request: RequestContext) -> LookupResult: ...

    def submit_store(self, job: TransferJob) -> None: ...

    def submit_load(self, job: TransferJob) -> None: ...

    def get_finished_jobs(self) -> list[JobResult]: ...

    def serve_external_requests(self, parent: Parent) -> None: ...

    def on_schedule_end(self) -> None: ...

    def on_request_finished(self, request: RequestContext) -> None: ...

    def has_pending_work(self) -> bool: ...

    def drain_jobs(self) -> None: ...

    def shutdown(self) -> None: ...
