"""``kvpeer serve`` stops cleanly on SIGINT or SIGTERM wherever the signal lands,
even in the middle of a tier poll run by the serving thread itself.

Before the fix a Ctrl-C that arrived inside such a poll raised KeyboardInterrupt
there; the driver took it for a crash and the node exited with status 2 (seen by
the fuzzer's clean-stop check in CI)."""

from __future__ import annotations

import contextlib
import io
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvpeer.node.serve import serve
from kvpeer.node.synthetic import synthetic_key
from kvpeer.node.tier import Tier
from tests.net.common import tier_config
from tests.net.localnode import LocalNode

pytestmark = pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(),
    reason="signals are delivered to the main thread only",
)


@pytest.fixture
def signal_inside_poll(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """Arm: the next tier poll the main thread runs raises ``signum`` inside it."""
    armed: list[int] = []
    original = Tier.poll

    def poll(self: Tier) -> None:
        if armed and threading.current_thread() is threading.main_thread():
            signal.raise_signal(armed.pop())
            for _ in range(100):  # the handler runs here, between bytecodes of the poll
                pass
        original(self)

    monkeypatch.setattr(Tier, "poll", poll)
    return armed.append


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_inside_a_poll_stops_the_node_cleanly(
    signum: int, signal_inside_poll: Callable[[int], None], tmp_path: Path
) -> None:
    ready = tmp_path / "ready"
    out = io.StringIO()

    def consumer() -> None:
        deadline = time.monotonic() + 10
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        with LocalNode("tcp") as node:
            # a pull wakes the serving thread's watcher: it polls the tier
            signal_inside_poll(signum)
            # the node may stop before the pull ends: only the node's exit is checked
            with contextlib.suppress(Exception):
                node.pull(ready.read_text(), [synthetic_key(0)], [0], timeout_s=5)

    previous = signal.getsignal(signum)
    thread = threading.Thread(target=consumer, daemon=True)
    thread.start()
    started = time.monotonic()
    status = serve(
        tier_config("tcp"),
        num_blocks=8,
        block_len=4096,
        synthetic_blocks=8,
        duration_s=20,
        ready_file=str(ready),
        out=out,
    )
    elapsed = time.monotonic() - started
    thread.join(10)
    assert status == 0, out.getvalue()
    assert f"stopping ({signal.Signals(signum).name})" in out.getvalue()
    assert elapsed < 10, f"the node kept serving {elapsed:.1f} s after the signal"
    assert signal.getsignal(signum) is previous, "serve left its signal handler installed"
