"""Drive a real node with generated frames and watch it (``kvpeer fuzz``).

The run: start ``kvpeer serve`` over synthetic blocks on every data plane; attach
the fuzz identities and the pacer; learn the node's ``connect``; then send
generated cases without waiting for answers, echoing through the pacer every
``batch`` frames so the node never falls more than two batches behind. Every
``checkpoint_every`` frames: the node process lives, its log shows no crash, its
resident memory and descriptors are within bounds, and a legitimate consumer on
each data plane pulls synthetic blocks byte-exact. At the end every identity says
goodbye, the node must drop back to about what it held before the fuzzing, a
fresh consumer per plane is served, and SIGINT must stop the node with status 0
and no shared-memory file left.

A node that dies is recorded (its traceback and the cases sent since two echoes
before) and, with ``keep_going``, started again so one run finds every distinct
crash. With ``minimize``, each crash's recent cases are replayed against fresh
nodes and shrunk to a short reproducer.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import tempfile
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from kvpeer.lab.fuzz.fuzz_peers import FuzzPeers, NodeHello, Sinks
from kvpeer.lab.fuzz.fuzz_results import (
    HASH_SEED,
    STALL_S,
    CrashRecord,
    FuzzResult,
    FuzzSpec,
    MiB,
    Progress,
    available_planes,
)
from kvpeer.lab.fuzz.generator import Case, FrameGenerator, Target
from kvpeer.lab.fuzz.legit import LegitConsumer, PullOutcome
from kvpeer.lab.fuzz.process import CRASH_MARKERS, Death, NodeProcess, Usage, deaths_in
from kvpeer.node.trim import TRIM_EVERY_S

__all__ = [
    "STALL_S",
    "CrashRecord",
    "FuzzResult",
    "FuzzSpec",
    "available_planes",
    "run_fuzz",
]

class _Run:
    """State of one run (see the module docstring)."""

    def __init__(self, spec: FuzzSpec, progress: Progress) -> None:
        self.spec = spec
        self.progress = progress
        self.rng = random.Random(spec.seed ^ 0x1E617)
        self.result = FuzzResult(spec, spec.seed, spec.planes)
        self.own_workdir = spec.workdir is None
        self.workdir = spec.workdir or Path(tempfile.mkdtemp(prefix="kvpeer-fuzz-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.node: NodeProcess | None = None
        self.peers = FuzzPeers(
            spec.listening, spec.deaf, block_len=spec.block_len, hash_seed=HASH_SEED
        )
        self.sinks = Sinks()
        self.files = self._region_files()
        self.consumers: list[LegitConsumer] = []
        self.recent: deque[Case] = deque(maxlen=3 * spec.batch)
        self.generated = 0  # cases the generator yielded (recent holds the last ones)
        self.hello: NodeHello | None = None
        self.parsed_to = 0  # how much of the node's log was searched for crashes
        self.last_deaths: list[Death] = []  # what the last died() found
        self.node_died = False  # the current node's death was recorded
        self.starts = 0

    # -- resources ---------------------------------------------------------------------

    def _region_files(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Files of exactly our advertised region's size: two in /dev/shm, one decoy."""
        size = 64 * self.spec.block_len
        shm = tuple(f"/dev/shm/kvpeer-fuzz-{os.getpid()}-{i}" for i in range(2))
        decoy = (str(self.workdir / "decoy-region"),)
        for path in (*shm, *decoy):
            with open(path, "wb") as handle:
                handle.truncate(size)
        return shm, decoy

    def target(self) -> Target:
        assert self.hello is not None
        connect = self.hello.connect
        return Target(
            identities=self.peers.identities,
            listening=self.peers.listening,
            block_len=self.spec.block_len,
            synthetic_blocks=self.spec.blocks,
            odd_identities=self.peers.odd,
            hash_seed=HASH_SEED,
            our_blocks=64,
            host_id=self.hello.host_id,
            node_shm_path=self.hello.shm_path,
            node_agent_metadata=connect.agent_metadata,
            shm_files=self.files[0],
            decoy_files=self.files[1],
            tcp_sinks=self.sinks.addresses,
            dead_port=1,
        )

    # -- the node ------------------------------------------------------------------------

    def start_node(self, *, counted: bool = True) -> None:
        spec = self.spec
        self.starts += 1
        if counted:
            self.result.node_starts += 1
        node = NodeProcess(
            self.workdir,
            planes=spec.planes,
            blocks=spec.blocks,
            block_len=spec.block_len,
            log_level=spec.node_log_level,
            name=f"node-{self.starts}",
            extra_args=spec.node_args,
        )
        node.start()
        self.node = node
        self.parsed_to = 0
        self.node_died = False
        self.peers.attach(node.peer_id)
        self.hello = self.peers.handshake_pacer(self.sinks.port)

    def echoed(self, seconds: float | None) -> None:
        """The pacer's echo took ``seconds`` (None: never came): the node's stalls."""
        result = self.result
        if seconds is None:
            if self.node_alive():
                result.slow_syncs += 1
            return
        result.echo_max_s = max(result.echo_max_s, seconds)
        if seconds >= STALL_S:
            result.stalls += 1

    def node_alive(self) -> bool:
        return self.node is not None and self.node.alive()

    def died(self, *, record: bool = True) -> bool:
        """Record what the node logged as crashes (``record``: in the result too); True
        if it must be started again (its process or its driver died)."""
        node = self.node
        assert node is not None
        text = node.new_log()
        logged = any(marker in text for marker in CRASH_MARKERS)
        if node.alive() and not logged:
            return False
        time.sleep(0.3)  # let it finish writing the traceback (or exiting)
        log = node.log()
        deaths = deaths_in(log[self.parsed_to :])
        if any(d.kind == "driver" for d in deaths):
            self.node_died = True
            deadline = time.monotonic() + 10.0
            while node.alive() and time.monotonic() < deadline:
                time.sleep(0.1)
            if node.alive():
                self.result.problems.append("the node did not exit within 10 s of its driver crash")
            log = node.log()  # with whatever it said on its way out
            deaths = deaths_in(log[self.parsed_to :])
        self.parsed_to = len(log)
        node.new_log()
        if not node.alive() and not self.node_died:
            self.node_died = True
            status = node.returncode
            name = f"signal {-status}" if status is not None and status < 0 else f"status {status}"
            native = [
                line.strip()
                for line in log[-20_000:].splitlines()
                if line.startswith(("Assertion failed", "Fatal Python error", "terminate called"))
            ]
            last_words = f"{native[-1]} ({name})" if native else f"exited with {name}"
            deaths.append(Death("process", "", last_words, "", log[-3000:]))
        self.last_deaths = deaths
        for death in deaths if record else ():
            self.record(death, node.returncode)
        restart = not node.alive() or any(d.kind != "thread" for d in deaths)
        if restart:
            node.kill()
            self.result.node_log = log[-20_000:]
        return restart

    def sent_before_recent(self) -> int:
        """How many cases the generator had yielded before ``recent[0]``."""
        return self.generated - len(self.recent)

    def record(self, death: Death, returncode: int | None) -> None:
        result = self.result
        if death.kind == "thread":
            result.thread_deaths += 1
        elif death.kind != "exit":  # an exit crash follows a driver death, counted once
            result.driver_deaths += 1
        for crash in result.crashes:
            if crash.signature == death.signature:
                crash.count += 1
                return
        result.crashes.append(
            CrashRecord(
                death.signature,
                death.kind,
                death.exception,
                death.traceback,
                returncode,
                result.frames_sent,
                list(self.recent),
                self.sent_before_recent(),
            )
        )
        self.progress(f"new crash after {result.frames_sent:,} frames: {death.signature}")

    # -- checks --------------------------------------------------------------------------

    def check_usage(self, where: str) -> Usage:
        assert self.node is not None
        usage = self.node.usage()
        result = self.result
        peak = result.usage_peak
        if peak is None:
            result.usage_peak = usage
        else:
            result.usage_peak = Usage(
                max(peak.rss_bytes, usage.rss_bytes),
                max(peak.fds, usage.fds),
                max(peak.threads, usage.threads),
            )
        if result.rss_bound and usage.rss_bytes > result.rss_bound:
            result.problems.append(
                f"{where}: RSS {usage.rss_bytes / MiB:.0f} MiB over the bound "
                f"{result.rss_bound / MiB:.0f} MiB"
            )
        if result.fd_bound and usage.fds > result.fd_bound:
            result.problems.append(f"{where}: {usage.fds} fds over the bound {result.fd_bound}")
        mapped = self.node.mapped(self.files[1])
        for path in mapped:
            if path not in result.peer_files_mapped:
                result.peer_files_mapped.append(path)
        return usage

    def pull_all(self, into: list[PullOutcome], consumers: Sequence[LegitConsumer]) -> None:
        assert self.node is not None
        node = self.node
        for consumer in consumers:
            outcome = consumer.pull(node.peer_id, self.spec.blocks, self.rng, timeout_s=30.0)
            if not outcome.ok and not self.crashed_meanwhile():
                # Once more: this shared VM stalls processes for seconds at times (and a
                # peer's NIXL registration holds the node while it lasts). Counted.
                self.result.pulls_retried += 1
                self.progress(f"legitimate pull over {outcome.plane} failed, retrying once")
                first = outcome.detail
                outcome = consumer.pull(node.peer_id, self.spec.blocks, self.rng, timeout_s=30.0)
                if outcome.ok:
                    outcome = replace(outcome, detail=f"second try; the first: {first}")
            if not outcome.ok and self.crashed_meanwhile():
                # The crash fails the run; the pull only happened to be under way.
                self.result.pulls_cut_short.append(outcome)
                self.progress(f"legitimate pull over {outcome.plane} cut short by a crash")
                return
            into.append(outcome)
            if not outcome.ok:
                self.progress(f"legitimate pull over {outcome.plane} failed: {outcome.detail}")

    def crashed_meanwhile(self) -> bool:
        """The node is gone, or logged a crash not yet looked at."""
        node = self.node
        assert node is not None
        if not node.alive():
            return True
        fresh = node.log()[self.parsed_to :]
        return any(marker in fresh for marker in CRASH_MARKERS)

    def open_consumers(self) -> list[LegitConsumer]:
        consumers = []
        for plane in self.spec.planes:
            consumers.append(LegitConsumer(plane, self.spec.block_len, HASH_SEED))
        return consumers

    # -- the run -------------------------------------------------------------------------

    def run(self) -> FuzzResult:
        spec, result = self.spec, self.result
        started = time.monotonic()
        self.start_node()
        assert self.node is not None
        result.usage_start = self.node.usage()
        self.consumers = self.open_consumers()
        self.pull_all(result.pulls, self.consumers)
        generator = FrameGenerator(self.target(), spec.seed, exclude=spec.exclude)
        last_report = time.monotonic()
        pending_sync = False
        for case in generator:
            if result.frames_sent >= spec.frames:
                break
            self.generated += 1
            self.recent.append(case)  # sent or not: positions follow the generator
            if not self.peers.send(case):
                continue
            result.frames_sent += 1
            result.by_kind[case.kind] += 1
            result.by_label[case.label] += 1
            result.by_scenario[case.scenario] += 1
            sent = result.frames_sent
            alive = True
            if sent % spec.batch == 0 or sent == spec.frames:
                self.peers.drain()
                if pending_sync:
                    self.echoed(self.peers.sync(spec.sync_timeout_s, self.node_alive))
                pending_sync = True
                alive = not self.died()
            if alive and sent == spec.warmup:
                self.set_bounds()
            if alive and sent % spec.checkpoint_every == 0:
                alive = self.checkpoint(f"after {sent:,} frames")
            if not alive:
                if not spec.keep_going:
                    break
                self.start_node()
                generator.target = self.target()
                pending_sync = False
            if time.monotonic() - last_report >= 5.0:
                last_report = time.monotonic()
                self.report_progress(started)
        result.elapsed_s = time.monotonic() - started
        if not result.rss_bound:
            self.set_bounds()
        self.finish()
        result.elapsed_s = time.monotonic() - started
        return result

    def set_bounds(self) -> None:
        assert self.node is not None
        spec, result = self.spec, self.result
        warm = result.usage_warm = self.node.usage()
        start = result.usage_start or warm
        result.rss_bound = warm.rss_bytes + spec.rss_growth_bytes
        sessions = spec.listening + spec.deaf + len(self.peers.odd) + 1 + len(spec.planes)
        result.fd_bound = start.fds + spec.fds_per_identity * sessions + spec.fd_slack

    def checkpoint(self, where: str) -> bool:
        """Usage within bounds and legitimate pulls; False if the node died."""
        self.peers.drain()
        # Everything sent so far is handled first: a crash it causes is the frames'
        # doing, not something that happened to the legitimate peers' pulls.
        self.echoed(self.peers.sync(self.spec.sync_timeout_s, self.node_alive))
        if self.died():
            return False
        self.check_usage(where)
        self.pull_all(self.result.pulls, self.consumers)
        return not self.died()

    def report_progress(self, started: float) -> None:
        result = self.result
        elapsed = time.monotonic() - started
        usage = self.node.usage() if self.node is not None else Usage(0, 0, 0)
        self.progress(
            f"{result.frames_sent:,}/{self.spec.frames:,} frames, "
            f"{result.frames_sent / max(elapsed, 1e-9):,.0f} frames/s, {elapsed:.0f} s, "
            f"node RSS {usage.rss_bytes / MiB:.0f} MiB, {usage.fds} fds, "
            f"{usage.threads} threads, crashes {len(result.crashes)}, "
            f"pulls ok {result.pulls_ok} failed {result.pulls_failed}"
        )

    def finish(self) -> None:
        """Goodbyes, then: back to its start-up usage, legitimate peers served, a clean
        SIGINT (each step only while the node lives)."""
        result = self.result
        node = self.node
        assert node is not None
        self.peers.drain()
        if not self.died():
            self.check_usage("end of fuzzing")
            self.peers.goodbye()
            time.sleep(0.2)
            self.peers.drain()
            self.peers.detach()  # the node's inbound connections from us close too
            self.settle()
        if node.alive() and not self.died():
            self.pull_all(result.pulls, self.consumers)
            fresh = self.open_consumers()
            try:
                self.pull_all(result.final_pulls, fresh)
            finally:
                for consumer in fresh:
                    consumer.close()
        for consumer in self.consumers:
            consumer.close()
        self.consumers = []
        if node.alive() and not self.died():
            result.exit_status = node.stop()
            if result.exit_status != 0:
                result.problems.append(f"SIGINT: the node exited with {result.exit_status}")
                result.node_log = node.log()[-20_000:]
            result.shm_left = node.shm_files()
            if result.shm_left:
                result.problems.append(f"the node left shared-memory files: {result.shm_left}")
        else:  # it crashed (recorded): what it could not clean up is the crash's doing
            self.died()
            node.kill()
        result.dials = Counter(self.sinks.dials)
        result.reactions = Counter(self.peers.reactions.counts)
        result.reaction_frames = self.peers.reactions.frames
        result.send_blocked = self.peers.send_blocked
        decoy = Path(self.files[1][0])
        if any(decoy.read_bytes()):  # a finding of the report, not a failed run
            result.decoy_written = True

    def settle(self) -> None:
        """Wait until the node holds about what it held before the fuzzing (its
        sessions with the legitimate consumers aside); a problem if it does not."""
        spec, result, node = self.spec, self.result, self.node
        assert node is not None
        start = result.usage_start
        assert start is not None
        limit_fds = start.fds + spec.end_slack + 8 * len(self.consumers)
        limit_threads = start.threads + spec.end_slack
        deadline = time.monotonic() + spec.settle_timeout_s
        usage = node.usage()
        while time.monotonic() < deadline and node.alive():
            if usage.fds <= limit_fds and usage.threads <= limit_threads:
                break
            time.sleep(0.25)
            usage = node.usage()
        # A node that dies of the goodbyes dies now (see the report); and its driver has
        # looked at its heap once since the fuzzing stopped (kvpeer.node.trim).
        time.sleep(max(1.0, TRIM_EVERY_S + 0.5))
        if not node.alive():
            return
        usage = result.usage_end = node.usage()
        warm = result.usage_warm
        if warm is not None and usage.rss_bytes > warm.rss_bytes + spec.rss_end_growth_bytes:
            result.problems.append(
                f"after the goodbyes the node's RSS is {usage.rss_bytes / MiB:.0f} MiB, "
                f"more than {spec.rss_end_growth_bytes / MiB:.0f} MiB over the "
                f"{warm.rss_bytes / MiB:.0f} MiB it had after the warm-up"
            )
        if usage.fds > limit_fds:
            result.problems.append(
                f"after the goodbyes the node still holds {usage.fds} fds "
                f"(started with {start.fds}; bound {limit_fds})"
            )
        if usage.threads > limit_threads:
            result.problems.append(
                f"after the goodbyes the node still runs {usage.threads} threads "
                f"(started with {start.threads}; bound {limit_threads})"
            )

    # -- reproduction --------------------------------------------------------------------

    def crashes_with(self, crash: CrashRecord, positions: Sequence[int]) -> tuple[bool, list[Case]]:
        """Replay the cases at ``positions`` of ``crash.recent`` against a fresh node,
        as fast as the run sent them: did it die the same way, and what was sent.

        The cases are generated again for the fresh node (same seed, same positions):
        some carry the node's own values (its NIXL metadata, its region's path), and
        the dead node's would mean nothing to the new one.
        """
        self.start_node(counted=False)
        node = self.node
        assert node is not None
        end = crash.first_recent_index + len(crash.recent)
        generator = FrameGenerator(self.target(), self.spec.seed, exclude=self.spec.exclude)
        again = generator.take(end)[crash.first_recent_index :]
        cases = [again[i] for i in positions]
        for sent, case in enumerate(cases, 1):
            self.peers.send(case)
            if sent % self.spec.batch == 0:
                self.peers.sync(10.0, self.node_alive)
        self.peers.sync(10.0, self.node_alive)
        time.sleep(0.5)
        self.last_deaths = []
        self.died(record=False)
        node.kill()
        return any(death.signature == crash.signature for death in self.last_deaths), cases

    def reproduce(self, crash: CrashRecord, budget: int = 40) -> list[Case] | None:
        """A short case sequence that crashes a fresh node like ``crash`` did, or None.

        Replays the cases sent before the crash: first each identity's on their own
        (latest first), else all of them less one identity at a time; then drops
        chunks, halves down to single cases, while the crash stays (delta debugging).
        At most ``budget`` node starts.
        """
        starts = 0
        shown: list[Case] = []

        def crashes(positions: Sequence[int]) -> bool:
            nonlocal starts, shown
            starts += 1
            died, cases = self.crashes_with(crash, positions)
            if died:
                shown = cases
            return died

        everything = list(range(len(crash.recent)))
        groups: dict[int, list[int]] = {}
        for position, case in enumerate(crash.recent):
            groups.setdefault(case.identity, []).append(position)
        latest_first = sorted(groups, key=lambda identity: -groups[identity][-1])
        found: list[int] | None = None
        for identity in latest_first:
            if starts >= budget // 2:
                break
            if crashes(groups[identity]):
                found = groups[identity]
                break
        if found is None:
            if not crashes(everything):
                self.progress(f"{crash.signature}: the recent cases do not reproduce it")
                return None
            found = everything
            for identity in latest_first:
                if starts >= budget:
                    break
                fewer = [p for p in found if crash.recent[p].identity != identity]
                if fewer and crashes(fewer):
                    found = fewer
        parts = 2  # delta debugging: drop ever smaller chunks while the crash stays
        while len(found) > 1 and starts < budget:
            size = -(-len(found) // parts)
            for start in range(0, len(found), size):
                fewer = found[:start] + found[start + size :]
                if fewer and starts < budget and crashes(fewer):
                    found, parts = fewer, max(parts - 1, 2)
                    break
            else:
                if size == 1:
                    break
                parts = min(len(found), parts * 2)
        return shown

    def close(self) -> None:
        for consumer in self.consumers:
            with contextlib.suppress(Exception):
                consumer.close()
        if self.node is not None:  # a node that crashed leaves its region file: remove it
            self.node.kill()
        self.peers.close()
        self.sinks.close()
        for path in self.files[0]:
            with contextlib.suppress(OSError):
                os.unlink(path)
        keep = self.result.problems or self.result.crashes
        if self.own_workdir and not keep:
            shutil.rmtree(self.workdir, ignore_errors=True)


def run_fuzz(
    spec: FuzzSpec, progress: Progress | None = None, *, minimize: bool = False
) -> FuzzResult:
    """Run ``spec`` against a fresh ``kvpeer serve``; never raises for what the node did.
    With ``minimize``, each crash then gets a short reproducer (see ``_Run.reproduce``)."""
    say = progress or (lambda message: None)
    fuzz = _Run(spec, say)
    try:
        result = fuzz.run()
        if minimize:
            for crash in result.crashes:
                say(f"minimizing {crash.signature}")
                crash.reproducer = fuzz.reproduce(crash)
                found = "none found" if crash.reproducer is None else len(crash.reproducer)
                say(f"reproducer of {crash.signature}: {found} frames")
        return result
    finally:
        fuzz.close()
