"""What a fuzz run is asked to do and what it found: ``FuzzSpec``, ``FuzzResult``,
``CrashRecord`` (the harness in :mod:`kvpeer.lab.fuzz.fuzz_run` fills them in)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvpeer.lab.fuzz.generator import Case
from kvpeer.lab.fuzz.legit import PullOutcome
from kvpeer.lab.fuzz.process import Usage

__all__ = ["CrashRecord", "FuzzResult", "FuzzSpec", "available_planes", "describe_case"]

HASH_SEED = "vllm-none-hash"
#: An echo this late means the node's driver was stuck on something a peer sent.
STALL_S = 1.0
MiB = 1 << 20

Progress = Callable[[str], None]


def available_planes() -> tuple[str, ...]:
    """shm and tcp. Not nixl by default: a node loads NIXL agent metadata only from
    the peers it trusts for it (``nixl_peers``), which a hostile network is not, and
    the fuzzer's legitimate consumer shares their address (``--data-planes`` may
    still name nixl: then every nixl peer, the legitimate one too, is refused)."""
    return ("shm", "tcp")


@dataclass(frozen=True, slots=True)
class FuzzSpec:
    """One fuzzing run. Bounds are relative to the node's usage after warm-up.

    ``rss_growth_bytes``: resident memory may exceed the post-warm-up figure by this
    much at any checkpoint (the warm-up has every kind of session, data plane and
    buffer in use once; what grows past it by a quarter GiB keeps growing: at a
    leak of one kilobyte per session the run's ~150,000 sessions per million frames
    cross it). ``fds_per_identity``: descriptors one peer may hold at the node: its
    DEALER (socket, mailbox), monitor (two inproc ends), the inbound connection and
    a data connection - about six, with room for one closing while the next opens -
    times every identity that can hold a session, plus ``fd_slack``; a leak of one
    per session crosses it within a few thousand frames. At the end, after the
    goodbyes, descriptors and threads must be back within ``end_slack`` of what the
    node held before the first fuzz frame (plus the legitimate consumers' sessions).
    """

    frames: int = 1_000_000
    seed: int = 0
    planes: tuple[str, ...] = ("shm", "tcp")
    listening: int = 40
    deaf: int = 12
    blocks: int = 256
    block_len: int = 4096
    batch: int = 400
    checkpoint_every: int = 25_000
    warmup: int = 10_000
    rss_growth_bytes: int = 256 * MiB
    fds_per_identity: int = 8
    fd_slack: int = 64
    end_slack: int = 24
    sync_timeout_s: float = 60.0
    settle_timeout_s: float = 30.0
    keep_going: bool = True
    exclude: tuple[str, ...] = ()  # case label prefixes not to send
    node_log_level: str = "WARNING"
    node_args: tuple[str, ...] = ()  # more ``kvpeer serve`` options for the node
    #: resident memory after the run (the goodbyes) may exceed the post-warm-up
    #: figure by this much (issue 30, item 3)
    rss_end_growth_bytes: int = 64 * MiB
    workdir: Path | None = None  # default: a temporary directory, kept only on problems

    def __post_init__(self) -> None:
        if self.frames < 1 or self.batch < 1 or self.checkpoint_every < 1:
            raise ValueError("frames, batch and checkpoint_every must be positive")
        unknown = sorted(set(self.planes) - {"shm", "tcp", "nixl"})
        if unknown or not self.planes:
            raise ValueError(f"data planes: choose from shm,tcp,nixl (got {list(self.planes)})")


@dataclass(slots=True)
class CrashRecord:
    """One distinct crash (by signature): what the node logged the first time, how
    often it happened, and the cases sent shortly before its first time."""

    signature: str
    kind: str  # "driver", "thread", "exit" or "process"
    exception: str
    traceback: str
    returncode: int | None
    first_at_frame: int
    recent: list[Case]
    first_recent_index: int  # the generator's index of recent[0]
    count: int = 1
    reproducer: list[Case] | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "signature": self.signature,
            "kind": self.kind,
            "exception": self.exception,
            "traceback": self.traceback,
            "returncode": self.returncode,
            "first_at_frame": self.first_at_frame,
            "count": self.count,
            "recent_cases": len(self.recent),
            "reproducer": None
            if self.reproducer is None
            else [describe_case(case) for case in self.reproducer],
        }


@dataclass(slots=True)
class FuzzResult:
    spec: FuzzSpec
    seed: int
    planes: tuple[str, ...]
    frames_sent: int = 0
    by_kind: Counter[str] = field(default_factory=Counter)
    by_label: Counter[str] = field(default_factory=Counter)
    by_scenario: Counter[str] = field(default_factory=Counter)
    reactions: Counter[str] = field(default_factory=Counter)
    reaction_frames: int = 0
    send_blocked: int = 0
    slow_syncs: int = 0  # echoes that never came while the node lived
    echo_max_s: float = 0.0  # the longest the node took to answer the pacer
    stalls: int = 0  # echoes that took STALL_S or longer
    crashes: list[CrashRecord] = field(default_factory=list)  # distinct, first seen first
    driver_deaths: int = 0  # the driver thread or the whole process died
    thread_deaths: int = 0  # another thread died (the process went on)
    node_starts: int = 0
    usage_start: Usage | None = None
    usage_warm: Usage | None = None
    usage_peak: Usage | None = None
    usage_end: Usage | None = None
    rss_bound: int = 0
    fd_bound: int = 0
    pulls: list[PullOutcome] = field(default_factory=list)
    final_pulls: list[PullOutcome] = field(default_factory=list)
    pulls_cut_short: list[PullOutcome] = field(default_factory=list)  # the node crashed
    pulls_retried: int = 0  # pulls that failed once and were tried again
    exit_status: int | None = None
    shm_left: list[str] = field(default_factory=list)
    dials: Counter[str] = field(default_factory=Counter)
    peer_files_mapped: list[str] = field(default_factory=list)  # files outside /dev/shm
    decoy_written: bool = False  # a peer-named file outside /dev/shm got block bytes
    problems: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    node_log: str = ""

    @property
    def pulls_ok(self) -> int:
        return sum(p.ok for p in (*self.pulls, *self.final_pulls))

    @property
    def pulls_failed(self) -> int:
        return sum(not p.ok for p in (*self.pulls, *self.final_pulls))

    @property
    def ok(self) -> bool:
        return not self.problems and not self.crashes and self.pulls_failed == 0

    @property
    def rate(self) -> float:
        return self.frames_sent / self.elapsed_s if self.elapsed_s else 0.0


def describe_case(case: Case) -> dict[str, object]:
    """A case as JSON: its label, identity and parts (decoded where they are msgpack)."""
    return {
        "label": case.label,
        "scenario": case.scenario,
        "identity": case.identity,
        "sequence": case.sequence,
        "parts": [_show(part) for part in case.parts],
    }


def _show(part: bytes, limit: int = 600) -> str:
    import msgspec

    try:
        text = repr(msgspec.msgpack.decode(part))
    except (msgspec.DecodeError, RecursionError, ValueError):
        text = "raw " + part[:200].hex()
    if len(text) > limit:
        text = f"{text[:limit]}... ({len(part)} bytes)"
    return text
