"""How much KV-event history a ``vllm serve`` engine holds for replay (``kvpeer soak``).

vLLM's ``ZmqEventPublisher`` keeps its last ``buffer_steps`` published batches (10,000
by default) so subscribers can replay a gap. That buffer lives in the EngineCore
process and fills as the engine steps: a bounded fill, not a leak, but over a soak it
reads as growth of the EngineCore's memory. The soak sizes it so its warm-up fills it
(:data:`SOAK_EVENT_BUFFER_STEPS`) and measures it at both samples with
:func:`event_history`: every buffered batch, asked of the replay endpoint from 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import zmq

from kvpeer.router.feed import REPLAY_END_SEQ, encode_replay_request

__all__ = ["SOAK_EVENT_BUFFER_STEPS", "EventHistory", "event_history"]

#: The soak engines' ``buffer_steps``: the warm-up alone publishes more batches than
#: this (every request stores blocks on the GPU and in the CPU tier, and evicts), so
#: the buffer is full when the first sample is taken. Replays the routers need (a gap
#: of a few seconds around a fault) are far shorter.
SOAK_EVENT_BUFFER_STEPS = 256
#: More frames than a buffer may hold (vLLM's default and then some): the answer is
#: read no further.
MAX_FRAMES = 20_000


@dataclass(frozen=True, slots=True)
class EventHistory:
    batches: int
    payload_bytes: int
    first_seq: int | None
    last_seq: int | None


def event_history(replay_endpoint: str, timeout_s: float = 5.0) -> EventHistory | None:
    """Every batch the engine's replay endpoint holds, counted (None: no complete answer
    within ``timeout_s``, or more than :data:`MAX_FRAMES` frames).

    A context of its own, ended on the way out: the soak asks this right after sampling
    the driver's descriptors, and the process-wide context's I/O thread (5 descriptors)
    would stay and be counted as the driver's growth."""
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    end = REPLAY_END_SEQ.to_bytes(8, "big")
    batches = size = 0
    first: int | None = None
    last: int | None = None
    try:
        sock.connect(replay_endpoint)
        sock.send_multipart(encode_replay_request(0))
        for _ in range(MAX_FRAMES + 1):
            try:
                parts = sock.recv_multipart()
            except zmq.Again:
                return None
            if len(parts) == 4 and parts[2] == end:
                return EventHistory(batches, size, first, last)
            if len(parts) != 4 or len(parts[2]) != 8:
                continue  # not a batch: vLLM sends nothing else here
            seq = int.from_bytes(parts[2], "big")
            first = seq if first is None else first
            last = seq
            batches += 1
            size += len(parts[3])
        return None
    finally:
        sock.close()
        context.term()
