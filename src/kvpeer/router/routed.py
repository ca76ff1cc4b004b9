"""A generation request as the edge parsed it, and what became of it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpeer.router.policy import Plan

__all__ = ["REQUEST_ID_HEADER", "RoutedRequest", "Served"]

REQUEST_ID_HEADER = "X-Request-Id"  # the client's is kept; else the router's id


@dataclass(frozen=True, slots=True)
class RoutedRequest:
    request_id: str  # also the kv_request_id both PD legs carry
    path: str
    chat: bool
    body: dict[str, Any]
    tokens: list[int]
    stream: bool
    started: float
    headers: dict[str, str]
    serve_on: str | None = None  # a pinned serving engine (allow_pinning)
    pull_from: str | None = None  # a pinned source (allow_pinning, shared mode)

    @property
    def client_request_id(self) -> str:
        """The client's ``X-Request-Id`` if it sent one, else the router's id."""
        return self.headers.get(REQUEST_ID_HEADER, self.request_id)


@dataclass(slots=True)
class Served:
    """What became of one request, filled in as it goes: the serving engine of its last
    attempt (``""``: none), its plan and the client's TTFT (the metrics' ``engine``
    label, the access log's line)."""

    engine: str = ""
    plan: Plan | None = None
    ttft_s: float | None = None
