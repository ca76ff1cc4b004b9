"""The one exception tree of kvpeer.

Foreign exceptions (msgspec, zmq, nixl, OS errors) are translated into these
where they enter kvpeer, with ``raise ... from``.
"""

from __future__ import annotations

__all__ = [
    "BudgetExceeded",
    "ConfigError",
    "DataPlaneError",
    "HandshakeRejected",
    "KVPeerError",
    "LocalFault",
    "PeerLost",
    "ProtocolError",
]


class KVPeerError(Exception):
    """Base class of every error kvpeer raises on purpose."""


class ProtocolError(KVPeerError):
    """A peer sent something the protocol forbids (or we misused the API).

    Final for the session that saw it, never for the engine.
    """


class BudgetExceeded(ProtocolError):
    """A peer made us hold more on its behalf than its budget allows (bytes of
    queued answers, parked demand, unanswered lookups). Ends that session."""


class HandshakeRejected(KVPeerError):
    """A peer's ``connect`` failed a compatibility or policy check."""


class PeerLost(KVPeerError):
    """A peer went away: disconnect, timeout, restart or transport failure."""


class DataPlaneError(KVPeerError):
    """A data plane could not register a peer or start/complete a transfer.

    Raised while handling something a peer sent, it is the peer's fault: the
    session with that peer ends and every other session goes on.
    """


class LocalFault(DataPlaneError):
    """A data plane failed through no fault of the peer (our backend closed, our
    region unmapped, our NIXL agent broken). A session that meets it still ends,
    but the fault is logged and counted as ours, not the peer's."""


class ConfigError(KVPeerError, ValueError):
    """A configuration value is invalid; the message names the key and value."""
