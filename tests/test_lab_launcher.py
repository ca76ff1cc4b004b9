"""What the lab's engine launcher gives engines and tells of them: ports (free, outside
the ephemeral range, never twice) and a failed engine's log (its first exceptions first)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from kvpeer.lab.engines import launcher
from kvpeer.lab.engines.launcher import LOG_TAIL_CHARS, free_port, log_excerpt


def test_ports_are_never_handed_out_twice_in_a_row_of_thousands() -> None:
    # Drawn at random from the whole range each time, 2,000 draws repeat one almost
    # surely (birthday bound over 12,000 ports); CI once gave two engines one port.
    ports = [free_port() for _ in range(2000)]
    assert len(set(ports)) == len(ports)
    assert all(launcher._PORTS.start <= p < launcher._PORTS.stop for p in ports)


def test_a_port_someone_listens_on_is_skipped() -> None:
    taken = []
    try:
        for _ in range(50):
            sock = socket.socket()
            sock.bind(("127.0.0.1", free_port()))
            sock.listen()
            taken.append(sock)
        in_use = {s.getsockname()[1] for s in taken}
        assert not in_use & {free_port() for _ in range(len(launcher._PORTS) - 50)}
    finally:
        for sock in taken:
            sock.close()


def test_a_forked_child_draws_its_own_order() -> None:
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its next ports and leave at once
        os.close(read_end)
        os.write(write_end, ",".join(str(free_port()) for _ in range(8)).encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        child = [int(p) for p in pipe.read().split(",")]
    os.waitpid(pid, 0)
    parent = [free_port() for _ in range(8)]
    assert child != parent


def test_a_failed_engines_log_leads_with_the_exceptions_raised_far_above_its_tail(
    tmp_path: Path,
) -> None:
    core = "(EngineCore pid=7) ERROR 12-05 09:02:52 [core.py:1510] "
    lines = [
        "(APIServer pid=6) INFO 12-05 09:02:34 [api_utils.py:286] starting",
        f"{core}Traceback (most recent call last):",
        f"{core}zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:29646')",
        f"{core}kvpeer.errors.ConfigError: cannot bind the control port 127.0.0.1:29646: taken",
        f"{core}zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:29646')",
    ]
    lines += ["(APIServer pid=6) INFO noise " + "y" * 200] * 60
    lines.append("RuntimeError: Engine core initialization failed. See root cause above.")
    log = tmp_path / "a.log"
    log.write_text("\n".join(lines) + "\n")
    head, _, tail = log_excerpt(log).partition("end of the log:\n")
    assert head.splitlines() == [
        "exceptions raised, first 3:",
        "  zmq.error.ZMQError: Address already in use (addr='tcp://127.0.0.1:29646')",
        "  kvpeer.errors.ConfigError: cannot bind the control port 127.0.0.1:29646: taken",
        "  RuntimeError: Engine core initialization failed. See root cause above.",
    ]
    assert tail == log.read_text()[-LOG_TAIL_CHARS:]


def test_a_log_with_no_exception_is_just_its_tail(tmp_path: Path) -> None:
    log = tmp_path / "quiet.log"
    log.write_text("".join(f"line {i}: an Error in prose is not raised\n" for i in range(2000)))
    assert log_excerpt(log, 500) == log.read_text()[-500:]
