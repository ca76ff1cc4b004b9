"""Small steps and readings over a :class:`~kvpeer.testing.harness.SessionPair`.

Node ``a`` is the consumer and ``b`` the producer in the helpers that need one
role; ``sent``, ``kinds`` and ``closed`` read what any node did.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from kvpeer.protocol import Codec, Message, UnknownMessage
from kvpeer.session.results import SessionClosed
from kvpeer.testing.harness import Node, SessionPair
from kvpeer.types import Key

__all__ = [
    "closed",
    "fetch",
    "inject",
    "kinds",
    "probe",
    "sent",
    "serve_lookups",
]

M = TypeVar("M", bound=Message)


def sent(node: Node, kind: type[M]) -> list[M]:
    """Messages of one type ``node`` put on the wire, in order."""
    return [m for m in node.sent() if isinstance(m, kind)]


def kinds(node: Node) -> list[type[Message | UnknownMessage]]:
    """The type of every message ``node`` put on the wire, in order."""
    return [type(m) for m in node.sent()]


def closed(node: Node) -> SessionClosed:
    """How ``node``'s session ended (it must have)."""
    assert node.closed is not None, f"session of {node.node_id} is still open"
    return node.closed


def inject(pair: SessionPair, node: Node, frame: bytes | Message) -> None:
    """Hand ``node`` a frame as if its peer had sent it."""
    raw = frame if isinstance(frame, bytes) else Codec().encode(frame)
    node.session.receive(raw, pair.clock.now)


def probe(pair: SessionPair, kv_request_id: str, *keys: Key) -> list[bool | None]:
    """The consumer's answers to the engine for ``keys`` right now."""
    return [pair.a.session.register_probe(kv_request_id, k, pair.clock.now) for k in keys]


def serve_lookups(pair: SessionPair) -> None:
    """Flush the consumer's probes, let the producer resolve them against its parent,
    deliver the answers."""
    pair.a.session.flush_lookups()
    pair.deliver()
    pair.serve()
    pair.pump()


def fetch(
    pair: SessionPair, keys: Sequence[Key], slots: Sequence[int], kv_request_id: str
) -> int:
    """Submit a load job on the consumer (nothing delivered yet); return its job id."""
    job = pair.next_job_id()
    pair.a.session.request_blocks(job, kv_request_id, keys, slots, pair.clock.now)
    return job

