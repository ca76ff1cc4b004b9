"""``kvpeer soak`` measures vLLM's KV-event replay buffer (kvpeer.lab.bench.soak_events):
against vLLM's own ``ZmqEventPublisher`` (in this process, on ipc sockets), the count is
what it published, up to the ``buffer_steps`` the soak gives its engines."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from kvpeer.lab.bench.soak_events import EventHistory, event_history
from kvpeer.lab.engines.serving import ServeSpec


def publish(kv: Any, publisher: Any, n: int) -> None:
    event = kv.BlockStored(
        block_hashes=[n.to_bytes(8, "big")], parent_block_hash=None, token_ids=list(range(32)),
        block_size=32, lora_id=None, medium="GPU", lora_name=None,
    )  # fmt: skip
    publisher.publish(kv.KVEventBatch(ts=float(n), events=[event]))


def history_when(endpoint: str, last_seq: int) -> EventHistory:
    """The history once the publisher's thread has buffered batch ``last_seq`` (it
    publishes from a queue on its own thread)."""
    deadline = time.monotonic() + 10.0
    while True:
        history = event_history(endpoint, timeout_s=5.0)
        assert history is not None, "the replay endpoint did not answer"
        if history.last_seq == last_seq or time.monotonic() > deadline:
            return history
        time.sleep(0.05)


def test_the_buffer_is_counted_and_bounded_by_buffer_steps(tmp_path: Path) -> None:
    kv = pytest.importorskip("vllm.distributed.kv_events")
    pub_ep, replay_ep = f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay"
    publisher = kv.ZmqEventPublisher(0, endpoint=pub_ep, replay_endpoint=replay_ep,
                                     buffer_steps=8)  # fmt: skip
    try:
        for n in range(5):
            publish(kv, publisher, n)
        few = history_when(replay_ep, 4)
        assert (few.batches, few.first_seq, few.last_seq) == (5, 0, 4)
        assert few.payload_bytes > 5 * 32  # each batch carries its 32 token ids
        for n in range(5, 20):
            publish(kv, publisher, n)
        full = history_when(replay_ep, 19)
        assert (full.batches, full.first_seq, full.last_seq) == (8, 12, 19)
    finally:
        publisher.shutdown()


def test_no_answer_is_none(tmp_path: Path) -> None:
    assert event_history(f"ipc://{tmp_path}/nobody", timeout_s=0.2) is None


def test_the_spec_passes_buffer_steps_to_vllm() -> None:
    spec = ServeSpec("a", Path("/models/m"), event_buffer_steps=256)
    assert '"buffer_steps": 256' in " ".join(spec.command())
    assert "buffer_steps" not in " ".join(ServeSpec("a", Path("/models/m")).command())


def test_asking_leaves_no_descriptor_behind(tmp_path: Path) -> None:
    # The soak asks right after counting the driver's descriptors: a context (and its
    # I/O thread's descriptors) kept past the call would read as the driver's growth.
    import os

    def descriptors() -> int:
        return len(os.listdir("/proc/self/fd"))

    event_history(f"ipc://{tmp_path}/nobody", timeout_s=0.05)  # any lazy import settles
    before = descriptors()
    for _ in range(3):
        assert event_history(f"ipc://{tmp_path}/nobody", timeout_s=0.05) is None
    assert descriptors() == before
