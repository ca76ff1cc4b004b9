"""Session numbers of kvpeer ``connect`` frames (``kvpeer.session.peer`` invariant 3).

A kvpeer process numbers the sessions it opens (``connect.kvpeer.session``,
increasing); with its ``boot_id`` the number says which of two connects of
the same peer process is the later one. vLLM's connects carry neither, older
kvpeer peers no number: then nothing is later than anything.
"""

from __future__ import annotations

from kvpeer.protocol import Connect

__all__ = ["later_session", "session_number"]


def session_number(hello: Connect) -> int | None:
    return hello.kvpeer.session if hello.kvpeer is not None else None


def later_session(hello: Connect, than: Connect) -> bool:
    """``hello`` opens a later session of the same peer process than ``than``."""
    new, old = hello.kvpeer, than.kvpeer
    return (
        new is not None
        and old is not None
        and new.boot_id == old.boot_id
        and new.session is not None
        and old.session is not None
        and new.session > old.session
    )
