"""Request trace: one log line per step of a pull, off by default.

When enabled, a node writes every event of a pull on logger ``kvpeer.trace``
(level INFO) as one line::

    kvpeer.trace t=1715000000.123456 node=10.0.0.6:5710 id=<kv_request_id> \
        event=fetch_sent peer=10.0.0.5:5710 blocks=32 round=0

(one line in the log; split here).

``t`` is wall-clock time (``time.time()``), deliberately not the tier's clock:
lines of the router and of both engines, in different processes, merge into one
timeline by it. :func:`kvpeer.lab.bench.serve_trace.parse_line` reads the lines back.

Events. Consumer: ``lookup_asked`` (the engine's first probe of an id),
``lookup_sent`` (a lookup round on the wire), ``lookup_answered`` (its answer:
hits of keys), ``load_submitted``, ``fetch_sent``, ``transfer_done_received``,
``load_done`` / ``load_failed`` (bytes, seconds from the fetch). Producer:
``lookup_received``, ``lookup_answered`` (hits, ``waited_s``: received →
answered, i.e. the wait for the engine's serve window), ``fetch_received``,
``transfer_started`` (blocks), ``transfer_done`` (ok, blocks, bytes). Both sides:
``connect_sent`` / ``connect_received``, ``connect_ack_sent`` / ``_received``,
``disconnect_sent`` / ``_received`` (id ``-``: a session names no request).

Consumer events seen by the engine carry ``step``, the engine's scheduler steps
so far (the tier counts ``on_schedule_end``): ``lookup_asked``, ``lookup_hit``
(the first step whose lookup of the id returned HIT: the gap from
``lookup_answered`` is time spent waiting for that step), ``load_submitted``,
``load_reported`` (the step that handed the load's result to the engine), and
``request_finished``. Differences of ``step`` count the engine steps a pull took.

Invariants:

1. Disabled, a hook costs its caller one boolean check: the frame wrapper and
   the data plane are the unwrapped originals, nothing is decoded or kept.
2. Wire events come from the frames themselves (inbound ones as the peer table
   decoded them; outbound ones decoded once more, only when enabled), so both
   sides' lines name the same ``kv_request_id`` and round.
3. A write is attributed to the id of the last fetch received or supply added
   for that peer: writes start only inside those two calls (producer ``_match``).
4. What the trace keeps per request (first probes, lookups awaiting their
   answer) is bounded by :data:`MAX_TRACKED`, oldest dropped first.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from kvpeer.errors import ProtocolError
from kvpeer.protocol import (
    AbortAck,
    AbortFetch,
    Codec,
    Connect,
    ConnectAck,
    Disconnect,
    Fetch,
    Inbound,
    Lookup,
    LookupResponse,
    TransferDone,
    TransportChoice,
)
from kvpeer.session.ports import DataPlane, TransferEvent

__all__ = ["MAX_TRACKED", "TRACE_ENV", "TRACE_LOGGER", "Trace"]

TRACE_LOGGER = "kvpeer.trace"
TRACE_ENV = "KVPEER_TRACE"  # read by the vLLM adapter and the CLI only
MAX_TRACKED = 4096
#: Session frames name no request: traced under id "-" by these names.
_SESSION_EVENTS: dict[type, str] = {
    Connect: "connect",
    ConnectAck: "connect_ack",
    Disconnect: "disconnect",
}

K = TypeVar("K")
V = TypeVar("V")


class Trace:
    """One node's request trace (a no-op unless ``enabled``)."""

    def __init__(
        self,
        node: str,
        *,
        enabled: bool = False,
        block_len: Callable[[], int] = lambda: 0,
        wall_clock: Callable[[], float] = time.time,
        logger: logging.Logger | None = None,
    ) -> None:
        """``block_len``: bytes of one block (what a transfer moves per block)."""
        self.enabled = enabled
        self._node = node
        self._block_len = block_len
        self._wall = wall_clock
        self._log = logger or logging.getLogger(TRACE_LOGGER)
        self._codec = Codec()
        self._asked: dict[str, None] = {}  # ids whose first probe was traced (invariant 4)
        self._hit: dict[str, None] = {}  # ids whose first HIT was traced
        self._jobs: dict[int, tuple[str, str]] = {}  # load job -> (id, peer) until reported
        self._waiting: dict[tuple[str, str, int], float] = {}  # lookups received, unanswered
        self._writing: dict[str, str] = {}  # peer -> id its next write serves (invariant 3)

    def emit(self, kv_request_id: str, event: str, **values: object) -> None:
        """One trace line (callers check :attr:`enabled` first)."""
        fields = " ".join(f"{k}={_value(v)}" for k, v in values.items() if v is not None)
        self._log.info(
            "kvpeer.trace t=%.6f node=%s id=%s event=%s %s",
            self._wall(), self._node, _value(kv_request_id), event, fields,
        )  # fmt: skip

    # -- hooks the tier and peer table call when enabled -----------------------------

    def lookup_asked(self, kv_request_id: str, peer_id: str, step: int | None = None) -> None:
        """The engine probed an id: traced once per id."""
        if kv_request_id in self._asked:
            return
        _bounded_put(self._asked, kv_request_id, None)
        self.emit(kv_request_id, "lookup_asked", peer=peer_id, step=step)

    def lookup_hit(self, kv_request_id: str, peer_id: str, step: int) -> None:
        """The engine's lookup of an id returned HIT: traced once per id."""
        if kv_request_id in self._hit:
            return
        _bounded_put(self._hit, kv_request_id, None)
        self.emit(kv_request_id, "lookup_hit", peer=peer_id, step=step)

    def load_submitted(self, kv_request_id: str, peer_id: str, job_id: int, blocks: int,
                       step: int) -> None:  # fmt: skip
        _bounded_put(self._jobs, job_id, (kv_request_id, peer_id))
        self.emit(kv_request_id, "load_submitted", peer=peer_id, blocks=blocks, step=step)

    def load_reported(self, job_id: int, success: bool, step: int) -> None:
        """The engine took a load job's result (jobs not submitted by a pull: ignored)."""
        job = self._jobs.pop(job_id, None)
        if job is not None:
            self.emit(job[0], "load_reported", peer=job[1], ok=int(success), step=step)

    def promotion(self, kv_request_id: str, peer_id: str, *, waited_s: float, done: bool,
                  step: int) -> None:  # fmt: skip
        """The engine's scheduler waited ``waited_s`` inside its lookup for a load it
        submitted at once (kvpeer.integrations.vllm.manager); ``done``: it landed."""
        self.emit(kv_request_id, "promotion", peer=peer_id, waited_ms=round(waited_s * 1000, 3),
                  landed=int(done), step=step)  # fmt: skip

    def forget(self, kv_request_id: str, peer_id: str, step: int) -> None:
        """The engine's request for the id (pulling from ``peer_id``) finished."""
        if kv_request_id in self._asked or kv_request_id in self._hit:
            self.emit(kv_request_id, "request_finished", peer=peer_id, step=step)
        self._asked.pop(kv_request_id, None)
        self._hit.pop(kv_request_id, None)

    def supplying(self, peer_id: str, kv_request_id: str) -> None:
        """Supply for the id goes to ``peer_id``'s session (a write may start)."""
        self._writing[peer_id] = kv_request_id

    def wrap_send(self, peer_id: str, send: Callable[[bytes], bool]) -> Callable[[bytes], bool]:
        """``send`` tracing every frame to ``peer_id`` (``send`` itself when disabled)."""
        if not self.enabled:
            return send

        def traced(frame: bytes) -> bool:
            self._frame(peer_id, frame, outbound=True)
            return send(frame)

        return traced

    def received(self, peer_id: str, message: Inbound) -> None:
        """A frame from ``peer_id`` (decoded by the peer table) is about to reach its
        session."""
        self._message(peer_id, message, outbound=False)

    def wrap_data_plane(self, plane: DataPlane) -> DataPlane:
        """``plane`` tracing the writes sessions start (``plane`` itself when disabled)."""
        return _TracedPlane(plane, self) if self.enabled else plane

    # -- frames ---------------------------------------------------------------------

    def _frame(self, peer_id: str, frame: bytes, *, outbound: bool) -> None:
        try:
            message = self._codec.decode(frame)
        except ProtocolError:
            return
        self._message(peer_id, message, outbound=outbound)

    def _message(self, peer_id: str, message: Inbound, *, outbound: bool) -> None:
        if isinstance(message, Lookup):
            key = (peer_id, message.kv_request_id, message.round_seq)
            if not outbound:
                _bounded_put(self._waiting, key, self._wall())
            event = "lookup_sent" if outbound else "lookup_received"
            self.emit(message.kv_request_id, event, peer=peer_id, keys=len(message.keys),
                      round=message.round_seq)  # fmt: skip
        elif isinstance(message, LookupResponse):
            waited = None
            if outbound and message.round_seq is not None:
                received = self._waiting.pop((peer_id, message.kv_request_id, message.round_seq),
                                             None)  # fmt: skip
                waited = None if received is None else round(self._wall() - received, 6)
            self.emit(message.kv_request_id, "lookup_answered", peer=peer_id,
                      hits=sum(message.hits), keys=len(message.keys), round=message.round_seq,
                      waited_s=waited)  # fmt: skip
        elif isinstance(message, Fetch):
            if not outbound:
                self._writing[peer_id] = message.kv_request_id
            event = "fetch_sent" if outbound else "fetch_received"
            self.emit(message.kv_request_id, event, peer=peer_id,
                      blocks=len(message.block_indexes), round=message.round_seq)  # fmt: skip
        elif isinstance(message, TransferDone):
            event = "transfer_done" if outbound else "transfer_done_received"
            blocks = message.blocks
            size = None if blocks is None else blocks * self._block_len()
            self.emit(message.kv_request_id, event, peer=peer_id, ok=int(message.success),
                      blocks=blocks, bytes=size, round=message.round_seq,
                      reason=message.reason)  # fmt: skip
        elif isinstance(message, Connect | ConnectAck | Disconnect):
            # Session events name no request: they stand on the peer's line ("-").
            name = _SESSION_EVENTS[type(message)]
            self.emit("-", f"{name}_{'sent' if outbound else 'received'}", peer=peer_id)
        elif isinstance(message, AbortFetch | AbortAck):
            kind = "abort_fetch" if isinstance(message, AbortFetch) else "abort_ack"
            event = f"{kind}_{'sent' if outbound else 'received'}"
            self.emit(message.kv_request_id, event, peer=peer_id, round=message.round_seq)

    def _write_started(self, peer_id: str, blocks: int) -> None:
        self.emit(self._writing.get(peer_id, "?"), "transfer_started", peer=peer_id,
                  blocks=blocks)  # fmt: skip


class _TracedPlane:
    """A session data plane whose ``write_blocks`` is traced (invariant 3)."""

    def __init__(self, inner: DataPlane, trace: Trace) -> None:
        self._inner = inner
        self._trace = trace

    def register_peer(self, peer_id: str, hello: Connect) -> TransportChoice | None:
        return self._inner.register_peer(peer_id, hello)

    def peer_acknowledged(self, peer_id: str, choice: TransportChoice | None) -> None:
        self._inner.peer_acknowledged(peer_id, choice)

    def unregister_peer(self, peer_id: str) -> None:
        self._inner.unregister_peer(peer_id)

    def write_blocks(
        self, peer_id: str, local_slots: Sequence[int], remote_slots: Sequence[int]
    ) -> int:
        transfer_id = self._inner.write_blocks(peer_id, local_slots, remote_slots)
        self._trace._write_started(peer_id, len(local_slots))
        return transfer_id

    def poll(self, peer_id: str) -> list[TransferEvent]:
        return self._inner.poll(peer_id)

    def cancel(self, transfer_ids: Sequence[int], *, wait: bool) -> list[int]:
        return self._inner.cancel(transfer_ids, wait=wait)

    def expect_writes(self, peer_id: str, slots: Sequence[int]) -> None:
        self._inner.expect_writes(peer_id, slots)

    def revoke_writes(self, peer_id: str, slots: Sequence[int]) -> None:
        self._inner.revoke_writes(peer_id, slots)


def _bounded_put(entries: dict[K, V], key: K, value: V) -> None:
    entries.pop(key, None)
    entries[key] = value
    while len(entries) > MAX_TRACKED:
        del entries[next(iter(entries))]


def _value(value: object) -> str:
    """A field value as one token: quoted (JSON) when it has spaces, quotes or ``=``."""
    if isinstance(value, float):
        return f"{value:.6f}"
    text = str(value)
    if not text or any(c in text for c in ' "=\n\t'):
        return json.dumps(text)
    return text
