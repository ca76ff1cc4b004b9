"""Held blocks between two real nodes over shm (kvpeer.node.held): the producer's engine
never opens a serve window, its store jobs are reported and their slots overwritten, and
the consumer still pulls the original bytes; over tcp held rows are never served."""

from __future__ import annotations

import pytest

from kvpeer.types import RequestContext, TransferJob
from tests.net.common import BLOCK_LEN, keys_of
from tests.net.localnode import LocalNode

BLOCKS = 8


def store_and_reuse(producer: LocalNode, wanted: list[bytes]) -> list[bytes]:
    """The producer's engine stores ``wanted`` (slots 0..), its store job is reported,
    then the engine reuses the slots. Returns the bytes that were stored."""
    stored = []
    for slot in range(len(wanted)):
        data = bytes([slot + 1]) * BLOCK_LEN
        producer.pool.slot_view(slot)[:] = data
        stored.append(data)
    context = RequestContext("local", None)
    node = producer.node
    node.on_new_request(context)
    job_id = producer.next_job_id()
    node.submit_store(TransferJob(job_id, tuple(wanted), tuple(range(len(wanted))), context))
    assert producer.wait_job(job_id) is True
    node.on_request_finished(context)
    for slot in range(len(wanted)):
        producer.pool.slot_view(slot)[:] = b"\xee" * BLOCK_LEN
    return stored


def test_pulled_from_held_copies_without_a_serve_window() -> None:
    wanted = keys_of(range(BLOCKS))
    with (
        LocalNode("shm", held_bytes=2 * BLOCKS * BLOCK_LEN) as producer,
        LocalNode("shm") as consumer,
    ):
        stored = store_and_reuse(producer, wanted)
        slots = list(range(16, 16 + BLOCKS))
        result = consumer.pull(producer.peer_id, wanted, slots)
        assert (result.hits, result.loaded) == (BLOCKS, True)
        assert [bytes(consumer.pool.slot_view(s)) for s in slots] == stored
        stats = producer.statistics()
        assert (stats.held_blocks, stats.held_bytes) == (BLOCKS, BLOCKS * BLOCK_LEN)
        assert stats.pinned_blocks == 0  # the write finished: nothing pinned


@pytest.mark.parametrize("plane", ["tcp"])
def test_other_planes_wait_for_the_serve_window(plane: str) -> None:
    wanted = keys_of(range(2))
    with (
        LocalNode(plane, held_bytes=4 * BLOCK_LEN) as producer,
        LocalNode(plane) as consumer,
    ):
        store_and_reuse(producer, wanted)
        result = consumer.pull(producer.peer_id, wanted, [16, 17], timeout_s=1.0)
        assert result.hits == 0  # nobody opened a serve window: no answer
        assert producer.statistics().held_blocks == 0  # tcp: not even kept
