"""Progress lines of the long-running commands: ``kvpeer <command>: <message>`` on stderr.

Stdout is the command's result (a table or one JSON object), so progress never goes
there; each line is flushed at once so a watcher sees where a slow run is.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

__all__ = ["progress_printer"]


def progress_printer(command: str) -> Callable[[str], None]:
    """The ``progress`` callback of ``kvpeer <command>`` (e.g. ``"bench serve"``)."""

    def progress(message: str) -> None:
        print(f"kvpeer {command}: {message}", file=sys.stderr, flush=True)

    return progress
