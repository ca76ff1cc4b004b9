"""Region files that outlive their process: claims, and the sweep that removes them.

A process that creates (or adopts) a shared region file under ``/dev/shm`` holds a
*claim* on it for as long as it lives: a file ``kvpeer-claim-<name>`` beside it,
locked with ``flock(LOCK_SH)`` on a descriptor the process keeps open. The kernel
drops the lock when the process dies, however it dies (SIGKILL included), so a
claim nobody holds belongs to a dead process. :func:`sweep` - run by every node
that starts - removes such claims and the files they name.

Invariants:

1. A claim file is created under a temporary name, locked, and only then linked
   to its final name: a sweeper never sees an unlocked claim of a live owner.
2. The sweep touches only files named by claims (in the claim's own directory, by
   base name): never a file of another program, never a path outside.
3. Several owners may claim one file: a later one locks the existing claim file
   (shared locks); the file is removed once none holds it.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from pathlib import Path

__all__ = ["CLAIM_PREFIX", "Claim", "sweep"]

log = logging.getLogger("kvpeer.host")

CLAIM_PREFIX = "kvpeer-claim-"
SHM_DIR = "/dev/shm"


class Claim:
    """This process's hold on ``path`` (invariant 1); :meth:`release` gives it up."""

    def __init__(self, path: str) -> None:
        target = Path(path)
        self.path = str(target)
        self._claim = target.parent / f"{CLAIM_PREFIX}{target.name}"
        self._fd: int | None = self._hold(target.parent)

    def _hold(self, directory: Path) -> int:
        """A locked descriptor of the claim file, created or joined (invariants 1, 3)."""
        for _ in range(8):
            staging = directory / f".{CLAIM_PREFIX}{os.getpid()}-{id(self):x}"
            fd = os.open(staging, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)
                os.link(staging, self._claim)  # fails if a claim exists: join it
                return fd
            except FileExistsError:
                os.close(fd)
            except FileNotFoundError:  # a sweep took our staging file before the lock
                os.close(fd)
                continue
            except OSError:
                os.close(fd)
                raise
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(staging)
            try:
                fd = os.open(self._claim, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
            except FileNotFoundError:
                continue  # swept meanwhile: create it
            fcntl.flock(fd, fcntl.LOCK_SH)
            try:
                if os.fstat(fd).st_ino == os.stat(self._claim).st_ino:
                    return fd  # still the claim the name points to
            except FileNotFoundError:
                pass
            os.close(fd)  # a sweeper removed the one we locked: try again
        raise OSError(f"cannot claim {self.path}: its claim file keeps changing")

    def release(self, *, remove_claim: bool = True) -> None:
        """Drop the lock; remove the claim file if no other owner holds it."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if remove_claim:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    pass  # another owner still holds it
                else:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self._claim)
        finally:
            os.close(fd)


def sweep(directory: str = SHM_DIR) -> list[str]:
    """Remove files whose claims no living process holds; returns what was removed."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        staging = name.startswith(f".{CLAIM_PREFIX}")  # its owner died before the link
        if not (staging or name.startswith(CLAIM_PREFIX)):
            continue
        claim = os.path.join(directory, name)
        try:
            fd = os.open(claim, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its owner lives
            if not staging:
                target = os.path.join(directory, name[len(CLAIM_PREFIX) :])
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(target)
                    removed.append(target)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(claim)
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d region files left by processes that died: %s", len(removed), removed)
    return removed
