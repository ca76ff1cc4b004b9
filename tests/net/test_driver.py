"""The driver thread next to an engine thread that waits in ``wait_for_work``.

One thread watches for frames (driver.py, invariant 2): while an engine thread
waits in ``wait_for_work`` it polls the frames that arrive itself, and the driver
keeps only the timers; once nobody waits, the driver watches frames again.
"""

from __future__ import annotations

import threading

import pytest

from kvpeer.transport.base import InboundFrame
from tests.net.procs import LocalNode, ServingNode, keys_of, plane_params


@pytest.mark.parametrize("plane", plane_params())
def test_frames_go_to_the_waiting_engine_and_back_to_the_driver(plane: str) -> None:
    producer = ServingNode(plane)
    try:
        with LocalNode(plane) as consumer:
            node = consumer.node
            node._max_wait = 60.0  # no periodic polls: the driver wakes for timers only
            control = node.tier._control
            receive = control.receive
            # (thread, an engine thread was waiting) for each poll that got frames
            polled: list[tuple[str, bool]] = []

            def recording() -> list[InboundFrame]:
                frames = receive()
                if frames:
                    polled.append((threading.current_thread().name, node._watchers > 0))
                return frames

            control.receive = recording  # type: ignore[method-assign]
            for _ in range(20):
                result = consumer.pull(producer.peer_id, keys_of(range(8)), range(8))
                assert (result.hits, result.loaded) == (8, True)
    finally:
        producer.close()

    while_waiting = [thread for thread, waiting in polled if waiting]
    otherwise = [thread for thread, waiting in polled if not waiting]
    # A load's transfer_done mostly arrives while the puller waits in wait_for_work,
    # and the puller polls it (tcp's receiving thread may too, when it completes).
    # The driver gets one only if it woke for it just before the puller began to
    # wait, or on a timer; with both threads watching it would get about half.
    assert len(while_waiting) >= 10
    assert while_waiting.count("kvpeer-driver") <= len(while_waiting) // 10
    assert while_waiting.count(threading.main_thread().name) >= len(while_waiting) // 2
    # Lookup answers arrive while the puller does not wait: the driver reads them.
    assert "kvpeer-driver" in otherwise
