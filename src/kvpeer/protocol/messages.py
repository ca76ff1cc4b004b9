"""Wire messages of the kvpeer / vLLM-p2p control protocol.

Every message is a frozen, tagged msgspec struct. On the wire it is one
msgpack map whose ``"type"`` key carries the tag; the base fields are exactly
those of vLLM 0.32's built-in p2p tier, and the optional extension fields
(``kvpeer``, ``reason``, ``round_seq`` on ``lookup_resp``, ``blocks``,
``prefill_done``, ``resolve``) are
omitted when unset, so a base-only message is the same map vLLM sends (key
order aside, which msgpack maps do not carry as meaning).
vLLM ignores keys it does not know, and so do we (forward compatibility).

All bounds of docs/protocol.md section 5 live in the field types below.
"""

from __future__ import annotations

from typing import Annotated, TypeAlias

import msgspec
from msgspec import Meta

from kvpeer.protocol import limits as L

__all__ = [
    "PING_VERSION",
    "PROTOCOL_VERSION",
    "RESOLVE_VERSION",
    "AbortAck",
    "AbortFetch",
    "AckExtension",
    "Connect",
    "ConnectAck",
    "ConnectExtension",
    "Disconnect",
    "Fetch",
    "Key",
    "Lookup",
    "LookupResponse",
    "Message",
    "Ping",
    "Pong",
    "Prefetch",
    "PrefetchRefused",
    "TransferDone",
    "TransportChoice",
    "TransportOffer",
    "UnknownMessage",
]

PROTOCOL_VERSION: tuple[int, int] = (1, 2)
#: The first version that answers :class:`Ping` (1.0 peers ignore it).
PING_VERSION: tuple[int, int] = (1, 1)
#: The first version that serves a :attr:`Fetch.resolve` fetch (older peers would
#: fail it: they match a symmetric fetch against what a lookup pinned).
RESOLVE_VERSION: tuple[int, int] = (1, 2)

Key: TypeAlias = Annotated[bytes, Meta(min_length=L.MIN_KEY_BYTES, max_length=L.MAX_KEY_BYTES)]
Keys: TypeAlias = Annotated[tuple[Key, ...], Meta(max_length=L.MAX_ITEMS)]
WireInt: TypeAlias = Annotated[int, Meta(ge=0, le=L.INT_LIMIT - 1)]
PositiveInt: TypeAlias = Annotated[int, Meta(gt=0, le=L.INT_LIMIT - 1)]
Name: TypeAlias = Annotated[str, Meta(min_length=1, max_length=L.MAX_NAME_CHARS)]
Reason: TypeAlias = Annotated[str, Meta(max_length=L.MAX_NAME_CHARS)]
TokenId: TypeAlias = Annotated[int, Meta(ge=0, lt=2**32)]
Fingerprint: TypeAlias = Annotated[str, Meta(max_length=L.MAX_FINGERPRINT_CHARS)]
AgentMetadata: TypeAlias = Annotated[bytes, Meta(max_length=L.MAX_AGENT_METADATA_BYTES)]
VersionPart: TypeAlias = Annotated[int, Meta(ge=0, lt=2**16)]
TransportName: TypeAlias = Annotated[str, Meta(min_length=1, max_length=L.MAX_TRANSPORT_NAME_CHARS)]
TransportValue: TypeAlias = (
    Annotated[str, Meta(max_length=L.MAX_TRANSPORT_VALUE_BYTES)]
    | Annotated[int, Meta(ge=-L.INT_LIMIT, le=L.INT_LIMIT - 1)]
)
#: Transport-specific parameters (a segment name, a port, a host identity...),
#: strings or integers only (msgspec unions allow one str-like type).
#: The data-plane layer parses these into its own typed offers.
TransportOffer: TypeAlias = Annotated[
    dict[TransportName, TransportValue], Meta(max_length=L.MAX_TRANSPORT_FIELDS)
]


def _same_length(kind: str, first: str, n_first: int, second: str, n_second: int) -> None:
    if n_first != n_second:
        raise ValueError(f"{kind}: {first} has {n_first} entries but {second} has {n_second}")


class _Base(msgspec.Struct, frozen=True, tag_field="type", omit_defaults=True):
    """Common struct options: frozen, tagged by ``type``, extensions omitted."""


class ConnectExtension(msgspec.Struct, frozen=True, omit_defaults=True):
    """kvpeer-only part of ``connect``: version, restart detection, data planes."""

    version: tuple[VersionPart, VersionPart]
    boot_id: Annotated[bytes, Meta(min_length=L.BOOT_ID_BYTES, max_length=L.BOOT_ID_BYTES)]
    transports: Annotated[
        dict[TransportName, TransportOffer], Meta(max_length=L.MAX_TRANSPORTS)
    ] = {}
    #: This session's number, increasing with every session the process opens
    #: (``kvpeer.session.peer`` invariant 3); absent from older kvpeer peers.
    session: WireInt | None = None


class TransportChoice(msgspec.Struct, frozen=True, omit_defaults=True):
    """The data plane an acker will use to write into the other side."""

    name: TransportName
    params: TransportOffer = {}


class AckExtension(msgspec.Struct, frozen=True, omit_defaults=True):
    """kvpeer-only part of ``connect_ack``."""

    version: tuple[VersionPart, VersionPart]
    transport: TransportChoice | None = None
    #: The number of the ``connect`` this acknowledges (its ``session``), if it had one.
    session: WireInt | None = None


class Connect(_Base, tag="connect", frozen=True):
    """First message in each direction: who we are and where our blocks live."""

    peer_id: Name
    agent_metadata: AgentMetadata
    base_addr: WireInt
    num_blocks: PositiveInt
    block_len: PositiveInt
    hash_seed: Name
    # vLLM always sends the key, even empty; None only when a peer left it out.
    config_fingerprint: Fingerprint | None = None
    kvpeer: ConnectExtension | None = None


class ConnectAck(_Base, tag="connect_ack", frozen=True):
    """The peer's connect passed our checks and the peer is registered."""

    peer_id: Name
    kvpeer: AckExtension | None = None


class Disconnect(_Base, tag="disconnect", frozen=True):
    """Best-effort goodbye; ``reason`` is a kvpeer extension."""

    reason: Reason = ""


class Lookup(_Base, tag="lookup", frozen=True):
    """Consumer asks which of ``keys`` the producer holds, for one round."""

    kv_request_id: Name
    keys: Keys
    round_seq: WireInt


class LookupResponse(_Base, tag="lookup_resp", frozen=True):
    """Producer answers key by key; ``round_seq`` is a kvpeer extension."""

    kv_request_id: Name
    keys: Keys
    hits: Annotated[tuple[bool, ...], Meta(max_length=L.MAX_ITEMS)]
    round_seq: WireInt | None = None

    def __post_init__(self) -> None:
        _same_length("lookup_resp", "keys", len(self.keys), "hits", len(self.hits))


class Fetch(_Base, tag="fetch", frozen=True):
    """Consumer demands ``keys`` written into its slots ``block_indexes``.

    An empty fetch is the consumer's "request finished" signal for the id.
    ``prefill_done`` (extension) says the orchestrator saw the producer's prefill
    leg for the id answer before it sent ours: a producer with no record of the
    id (it restarted, or reaped it) fails the round at once instead of waiting
    for a producer request that will never come.
    ``resolve`` (extension, peers of version >= :data:`RESOLVE_VERSION`) asks the
    producer to look the keys up itself, as a lookup of the same round would, and
    to write those it holds: a consumer told which blocks the producer holds (the
    router's ``held_tokens``) skips the lookup round trip. Any key the producer
    does not hold fails the round.
    """

    kv_request_id: Name
    keys: Keys
    block_indexes: Annotated[tuple[WireInt, ...], Meta(max_length=L.MAX_ITEMS)]
    round_seq: WireInt
    prefill_done: bool = False
    resolve: bool = False

    def __post_init__(self) -> None:
        _same_length("fetch", "keys", len(self.keys), "block_indexes", len(self.block_indexes))

    @property
    def is_terminal(self) -> bool:
        """True for the empty fetch that closes the id's lookup state."""
        return not self.keys


class TransferDone(_Base, tag="transfer_done", frozen=True):
    """Producer ends one fetch round; ``blocks``/``reason`` are extensions."""

    kv_request_id: Name
    success: bool
    round_seq: WireInt
    blocks: WireInt | None = None
    reason: Reason | None = None


class AbortFetch(_Base, tag="abort_fetch", frozen=True):
    """Consumer gives up on one round."""

    kv_request_id: Name
    round_seq: WireInt


class AbortAck(_Base, tag="abort_ack", frozen=True):
    """Producer confirms nothing of the round touches consumer memory any more."""

    kv_request_id: Name
    round_seq: WireInt


class Ping(_Base, tag="ping", frozen=True):
    """kvpeer only (peers of version >= :data:`PING_VERSION`): are you there?
    Sent while a request of ours waits on a peer that has been quiet; answered
    at once with :class:`Pong` by the node, not its engine, so a busy peer answers."""


class Pong(_Base, tag="pong", frozen=True):
    """kvpeer only: the answer to :class:`Ping`."""


class Prefetch(_Base, tag="prefetch", frozen=True):
    """kvpeer only, router -> node, outside any session: the router just sent this
    node's engine request ``kv_request_id``, whose prompt starts with ``tokens``, which
    peer ``source`` (``host:port``) holds; fetch those blocks now (pull-ahead,
    :mod:`kvpeer.node.ahead`). Accepted only from ``prefetch_from``; anyone else is
    answered :class:`PrefetchRefused`."""

    kv_request_id: Name
    source: Name
    tokens: Annotated[tuple[TokenId, ...], Meta(min_length=1, max_length=L.MAX_PREFETCH_TOKENS)]


class PrefetchRefused(_Base, tag="prefetch_refused", frozen=True):
    """kvpeer only, node -> router: nothing of prefetch ``kv_request_id`` was staged."""

    kv_request_id: Name
    reason: Reason


Message: TypeAlias = (
    Connect
    | ConnectAck
    | Disconnect
    | Lookup
    | LookupResponse
    | Fetch
    | TransferDone
    | AbortFetch
    | AbortAck
    | Ping
    | Pong
    | Prefetch
    | PrefetchRefused
)


class UnknownMessage(msgspec.Struct, frozen=True):
    """A well-formed map whose ``type`` we do not know (logged and ignored)."""

    type: Annotated[str, Meta(max_length=L.MAX_TYPE_CHARS)]
