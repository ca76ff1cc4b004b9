"""What processes hold, read from ``/proc``: resident memory, open descriptors, the
members of a process group, and which ``/dev/shm`` files any living process uses.

``kvpeer soak`` samples its long-lived processes with it, and :class:`ServeFleet`
(``serving.py``) uses :func:`shm_in_use` before it removes a file a dead engine left:
a file some living process maps or holds open is never a leftover.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ProcessInfo",
    "group_pids",
    "process_info",
    "shm_in_use",
    "shm_names",
    "shm_used_by",
]

PROC = Path("/proc")
SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class ProcessInfo:
    """One process at one moment. ``started`` (clock ticks after boot) tells a process
    from a later one that reused its pid."""

    pid: int
    name: str
    started: int
    rss_bytes: int  # VmRSS = anon_bytes + file_bytes + shmem_bytes
    shmem_bytes: int  # RssShmem: shared-memory pages (e.g. mapped /dev/shm regions)
    fds: int
    anon_bytes: int = 0  # RssAnon: heap, stacks, anonymous mappings: what the process owns
    file_bytes: int = 0  # RssFile: pages of mapped files (libraries, code) paged in

    @property
    def private_bytes(self) -> int:
        """Resident memory less shared-memory pages: where a leak shows."""
        return self.rss_bytes - self.shmem_bytes


def process_info(pid: int) -> ProcessInfo | None:
    """``pid``'s name, start time, resident memory (in all and by kind) and open
    descriptors; None if it is gone."""
    base = PROC / str(pid)
    try:
        stat = (base / "stat").read_text()
        status = (base / "status").read_text()
        fds = len(os.listdir(base / "fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # Field 2 (comm) is in parentheses and may hold spaces: split after its end.
    name = stat[stat.index("(") + 1 : stat.rindex(")")]
    started = int(stat[stat.rindex(")") + 2 :].split()[19])
    fields = {}
    for line in status.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssShmem", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) * 1024
    return ProcessInfo(
        pid,
        name,
        started,
        fields.get("VmRSS", 0),
        fields.get("RssShmem", 0),
        fds,
        anon_bytes=fields.get("RssAnon", 0),
        file_bytes=fields.get("RssFile", 0),
    )


def group_cpu_seconds(pgid: int) -> float:
    """User and system CPU time of the living processes of group ``pgid`` so far."""
    ticks = 0
    for pid in group_pids(pgid):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError, ValueError, OSError):
            stat = (PROC / str(pid) / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return ticks / os.sysconf("SC_CLK_TCK")


def group_pids(pgid: int) -> list[int]:
    """Every living process of process group ``pgid``, lowest pid first."""
    found: list[int] = []
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(FileNotFoundError, ProcessLookupError, ValueError, OSError):
            stat = (entry / "stat").read_text()
            if int(stat[stat.rindex(")") + 2 :].split()[2]) == pgid:
                found.append(int(entry.name))
    return sorted(found)


def shm_names(directory: str = SHM_DIR) -> set[str]:
    try:
        return set(os.listdir(directory))
    except OSError:
        return set()


def shm_in_use(directory: str = SHM_DIR) -> set[str]:
    """Names under ``directory`` that a living process maps or holds open (processes
    we may not read are skipped: as root, that is none)."""
    return shm_used_by((int(e.name) for e in PROC.iterdir() if e.name.isdigit()), directory)


def shm_used_by(pids: Iterable[int], directory: str = SHM_DIR) -> set[str]:
    """Names under ``directory`` that the processes ``pids`` map or hold open.

    Matched by inode as well as by name: glibc's ``sem_open(O_CREAT)`` creates a named
    semaphore under a temporary ``sem.XXXXXX`` name, maps it, then links it as
    ``sem.<name>`` and unlinks the temporary one, so its creator's map names a deleted
    file, but the same inode as the live name. By name alone, a semaphore whose only user
    was its creator looked unused, and a fleet that took "unused" for "leftover" unlinked
    other programs' live semaphores."""
    prefix = directory.rstrip("/") + "/"
    used: set[str] = set()
    inodes: set[int] = set()
    for pid in pids:
        entry = PROC / str(pid)
        with contextlib.suppress(OSError):
            for line in (entry / "maps").read_text().splitlines():
                at = line.find(prefix)
                if at < 0:
                    continue
                used.add(line[at + len(prefix) :].removesuffix(" (deleted)"))
                fields = line[:at].split()  # address perms offset device inode
                if len(fields) == 5 and fields[4].isdigit():
                    inodes.add(int(fields[4]))
        with contextlib.suppress(OSError):
            fd_dir = entry / "fd"
            for fd in os.listdir(fd_dir):
                with contextlib.suppress(OSError):
                    target = os.readlink(fd_dir / fd)
                    if target.startswith(prefix):
                        used.add(target[len(prefix) :].removesuffix(" (deleted)"))
                        inodes.add(os.stat(fd_dir / fd).st_ino)
    if inodes:
        with contextlib.suppress(OSError), os.scandir(directory) as entries:
            for found in entries:
                with contextlib.suppress(OSError):
                    if found.inode() in inodes:
                        used.add(found.name)
    return used
