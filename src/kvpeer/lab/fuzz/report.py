"""What a fuzzing run tried and how the node reacted: a table, or one JSON object."""

from __future__ import annotations

from collections import Counter
from typing import Any

from kvpeer.lab.fuzz.fuzz_run import STALL_S, FuzzResult
from kvpeer.lab.fuzz.legit import PullOutcome
from kvpeer.lab.fuzz.process import Usage

__all__ = ["render", "to_json"]

MiB = 1 << 20
TOP_REACTIONS = 40
TOP_LABELS = 25


def _usage(usage: Usage | None) -> dict[str, int] | None:
    return None if usage is None else usage.to_json()


def _by_plane(pulls: list[PullOutcome]) -> dict[str, dict[str, int]]:
    planes: dict[str, dict[str, int]] = {}
    for pull in pulls:
        entry = planes.setdefault(pull.plane, {"ok": 0, "failed": 0})
        entry["ok" if pull.ok else "failed"] += 1
    return planes


def to_json(result: FuzzResult) -> dict[str, Any]:
    """Everything the table shows, and more (every label, every reaction)."""
    return {
        "ok": result.ok,
        "seed": result.seed,
        "data_planes": list(result.planes),
        "frames_sent": result.frames_sent,
        "elapsed_s": round(result.elapsed_s, 3),
        "frames_per_s": round(result.rate, 1),
        "node_starts": result.node_starts,
        "frames_by_kind": dict(result.by_kind.most_common()),
        "frames_by_scenario": dict(result.by_scenario.most_common()),
        "frames_by_label": dict(result.by_label.most_common()),
        "reaction_frames": result.reaction_frames,
        "reactions": dict(result.reactions.most_common()),
        "send_blocked": result.send_blocked,
        "slow_syncs": result.slow_syncs,
        "echo_max_s": round(result.echo_max_s, 3),
        "stalls": result.stalls,
        "driver_deaths": result.driver_deaths,
        "thread_deaths": result.thread_deaths,
        "crashes": [crash.to_json() for crash in result.crashes],
        "usage": {
            "start": _usage(result.usage_start),
            "after_warmup": _usage(result.usage_warm),
            "peak": _usage(result.usage_peak),
            "end": _usage(result.usage_end),
            "rss_bound_bytes": result.rss_bound,
            "fd_bound": result.fd_bound,
        },
        "legit_pulls": {
            "ok": result.pulls_ok,
            "failed": result.pulls_failed,
            "cut_short_by_a_crash": len(result.pulls_cut_short),
            "retried": result.pulls_retried,
            "by_plane": _by_plane(result.pulls),
            "fresh_peers_after": [p.to_json() for p in result.final_pulls],
            "failures": [p.to_json() for p in (*result.pulls, *result.final_pulls) if not p.ok],
        },
        "findings": {
            "dials_to_peer_named_addresses": result.dials.get("named", 0),
            "dials_to_own_sinks": result.dials.get("own", 0),
            "peer_named_files_mapped": list(result.peer_files_mapped),
            "peer_named_file_written": result.decoy_written,
        },
        "exit_status": result.exit_status,
        "shm_left": list(result.shm_left),
        "problems": list(result.problems),
    }


def _share(counts: Counter[str], total: int, limit: int | None = None) -> list[str]:
    rows = counts.most_common(limit)
    lines = [f"  {count:>11,}  {count / max(total, 1):6.1%}  {name}" for name, count in rows]
    rest = sum(counts.values()) - sum(count for _, count in rows)
    if rest:
        lines.append(
            f"  {rest:>11,}  {rest / max(total, 1):6.1%}  ({len(counts) - len(rows)} more)"
        )
    return lines


def _usage_row(name: str, usage: Usage | None) -> str:
    if usage is None:
        return f"  {name:24} {'-':>9} {'-':>6} {'-':>8}"
    return f"  {name:24} {usage.rss_bytes / MiB:>5.0f} MiB {usage.fds:>6} {usage.threads:>8}"


def memory_line(result: FuzzResult) -> str:
    """Warmed-up RSS, RSS after the run and the difference (issue 30, item 3)."""
    warm, end = result.usage_warm, result.usage_end
    if warm is None or end is None:
        return "  memory: not measured (the node did not live to the end)"
    grown = (end.rss_bytes - warm.rss_bytes) / MiB
    return (
        f"  memory: RSS {warm.rss_bytes / MiB:.1f} MiB after warm-up, "
        f"{end.rss_bytes / MiB:.1f} MiB after {result.frames_sent:,} frames "
        f"and the goodbyes: {grown:+.1f} MiB"
    )


NODE_LOG_LINES = 30  # of a node with a problem, in the report


def render(result: FuzzResult) -> str:
    lines = [
        f"kvpeer fuzz: {result.frames_sent:,} frames in {result.elapsed_s:.0f} s "
        f"({result.rate:,.0f} frames/s), seed {result.seed}, data planes "
        f"{','.join(result.planes)}, node started {result.node_starts} time(s)",
        "",
        "frames sent, by kind",
        *_share(result.by_kind, result.frames_sent),
        "frames sent, by scenario",
        *_share(result.by_scenario, result.frames_sent),
        f"frames sent, the {TOP_LABELS} most frequent of {len(result.by_label)} labels "
        "(kind/mutation; --json lists all)",
        *_share(result.by_label, result.frames_sent, TOP_LABELS),
        "",
        f"node reactions: {result.reaction_frames:,} frames to the fuzz identities, "
        "by message and disconnect reason",
        *_share(result.reactions, result.reaction_frames, TOP_REACTIONS),
        "",
        f"driver deaths: {result.driver_deaths}   thread deaths: {result.thread_deaths}   "
        f"distinct crashes: {len(result.crashes)}",
    ]
    for crash in result.crashes:
        lines.append(f"  {crash.count:>6,}x  {crash.signature}")
        lines.append(f"           {crash.exception[:160]}")
        lines.append(f"           first after {crash.first_at_frame:,} frames")
        if crash.reproducer is not None:
            lines.append(f"           reproducer ({len(crash.reproducer)} frames):")
            for case in crash.reproducer:
                lines.append(f"             {case.label}  identity {case.identity}")
    lines += [
        "",
        f"  {'node usage':24} {'RSS':>9} {'fds':>6} {'threads':>8}",
        _usage_row("before fuzzing", result.usage_start),
        _usage_row("after warm-up", result.usage_warm),
        _usage_row("peak at checkpoints", result.usage_peak),
        _usage_row("after the goodbyes", result.usage_end),
        f"  bounds: RSS <= {result.rss_bound / MiB:.0f} MiB, fds <= {result.fd_bound}",
        memory_line(result),
        "",
    ]
    planes = _by_plane(result.pulls)
    per_plane = ", ".join(f"{p} {c['ok']}/{c['ok'] + c['failed']}" for p, c in planes.items())
    fresh = sum(p.ok for p in result.final_pulls)
    ok = sum(p.ok for p in result.pulls)
    lines.append(
        f"legitimate pulls: {ok} ok, {len(result.pulls) - ok} failed ({per_plane}); "
        f"fresh peers after the run: {fresh}/{len(result.final_pulls)} ok"
    )
    if result.pulls_retried:
        lines.append(f"  {result.pulls_retried} failed once and were tried again")
    if result.pulls_cut_short:
        lines.append(f"  {len(result.pulls_cut_short)} more cut short by a crash of the node")
    for pull in [p for p in (*result.pulls, *result.final_pulls) if not p.ok][:5]:
        lines.append(f"  failed over {pull.plane}: {pull.detail}")
    lines += [
        f"findings: dials to an address a peer named (127.0.0.9): {result.dials.get('named', 0)}; "
        f"peer-named files outside /dev/shm the node mapped: "
        f"{', '.join(result.peer_files_mapped) or 'none'}"
        f"{' (and wrote)' if result.decoy_written else ''}",
        f"node stop: SIGINT -> exit {result.exit_status}; shared-memory files left: "
        f"{', '.join(result.shm_left) or 'none'}",
    ]
    lines.append(
        f"node answers: the pacer's echo took at most {result.echo_max_s:.2f} s; "
        f"{result.stalls} echoes took {STALL_S:g} s or more, {result.slow_syncs} never came; "
        f"{result.send_blocked} frames not taken"
    )
    for problem in result.problems:
        lines.append(f"problem: {problem}")
    if result.problems and result.node_log:
        tail = result.node_log.splitlines()[-NODE_LOG_LINES:]
        lines.append(f"the node's log, last {len(tail)} lines:")
        lines.extend(f"  | {line}" for line in tail)
    verdict = "ok" if result.ok else "FAILED"
    lines.append(f"kvpeer fuzz {verdict}")
    return "\n".join(lines)
