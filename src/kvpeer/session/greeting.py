"""Checks on a peer's ``connect`` (``kvpeer.session.peer`` invariants 2 and 3).

Whether it can pair with ours at all (:func:`incompatibility`), and session
numbers.

A kvpeer process numbers the sessions it opens (``connect.kvpeer.session``,
increasing); with its ``boot_id`` the number says which of two connects of
the same peer process is the later one. vLLM's connects carry neither, older
kvpeer peers no number: then nothing is later than anything.
"""

from __future__ import annotations

from kvpeer.protocol import PROTOCOL_VERSION, Connect

__all__ = ["incompatibility", "later_session", "session_number"]


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


def incompatibility(hello: Connect, ours: Connect) -> str | None:
    """Why the peer's ``connect`` cannot pair with ours (None: it can)."""
    if hello.block_len != ours.block_len:
        return f"block_len mismatch: peer {hello.block_len}, ours {ours.block_len}"
    if (
        hello.config_fingerprint
        and ours.config_fingerprint
        and hello.config_fingerprint != ours.config_fingerprint
    ):  # an empty or missing fingerprint on either side skips the check
        return (
            f"config fingerprint mismatch: peer {hello.config_fingerprint!r}, "
            f"ours {ours.config_fingerprint!r}"
        )
    if hello.hash_seed != ours.hash_seed:
        return (
            f"hash seed mismatch: peer {hello.hash_seed!r}, ours {ours.hash_seed!r} "
            "(set the same PYTHONHASHSEED on every peer)"
        )
    if hello.kvpeer is not None and hello.kvpeer.version[0] != PROTOCOL_VERSION[0]:
        return f"protocol major version {hello.kvpeer.version[0]}, ours {PROTOCOL_VERSION[0]}"
    return None
