"""kvpeer.router.feedwatch: what changed in an engine's KV event feed, said once (rules
1-3 of its docstring), on a clock the test moves."""

from __future__ import annotations

import dataclasses
import logging

from kvpeer.router.feed import FeedStatistics
from kvpeer.router.feedwatch import FeedNote, FeedWatch

NEVER = FeedStatistics(
    synced=False, next_seq=None, replaying=False, frames=0, batches_applied=0,
    events_applied=0, gaps=0, restarts=0, resets=0, replays_requested=0,
    replays_completed=0, replays_incomplete=0, replays_reasked=0, replays_over_budget=0,
    verified=(), dropped=(), skipped=(),
)


def stats(**changes: object) -> FeedStatistics:
    return dataclasses.replace(NEVER, **changes)  # type: ignore[arg-type]


def texts(notes: list[FeedNote], level: int) -> list[str]:
    return [n.text for n in notes if n.level == level]


def test_synced_is_said_once_at_info() -> None:
    watch = FeedWatch("a", "tcp://e:5557", 0.0)
    assert watch.observe(NEVER, 0.0) == []
    synced = stats(synced=True, batches_applied=1)
    assert texts(watch.observe(synced, 1.0), logging.INFO) == [
        "engine a: KV events synced: KV-aware routing on"]
    assert watch.observe(synced, 2.0) == []


def test_losing_sync_names_why_at_warning() -> None:
    synced = stats(synced=True, batches_applied=3)
    for change, why in (
        ({"restarts": 1, "resets": 1}, "a new engine process"),
        ({"gaps": 1, "resets": 1}, "a gap in its sequence"),
        ({"resets": 1}, "a resync"),
    ):
        watch = FeedWatch("a", "tcp://e:5557", 0.0)
        watch.observe(synced, 0.0)
        notes = watch.observe(stats(synced=False, **change), 1.0)
        warnings = texts(notes, logging.WARNING)
        assert warnings[0] == (f"engine a: KV events out of sync ({why}): what it holds is "
                               "forgotten, routed by load only until resynced")


def test_losses_are_counted_in_one_line_each_time_they_grow() -> None:
    watch = FeedWatch("a", "tcp://e:5557", 0.0)
    watch.observe(stats(synced=True), 0.0)
    grown = stats(synced=True, gaps=2, replays_incomplete=1,
                  dropped=(("bad_seq", 1), ("unknown_field", 3)))
    assert texts(watch.observe(grown, 1.0), logging.WARNING) == [
        "engine a: KV events lost: 2 gap(s), 1 incomplete replay(s), dropped bad_seq 1, "
        "unknown_field 3"]
    assert watch.observe(grown, 2.0) == []  # nothing new: nothing said
    more = dataclasses.replace(grown, dropped=(("bad_seq", 1), ("unknown_field", 4)))
    assert texts(watch.observe(more, 3.0), logging.WARNING) == [
        "engine a: KV events lost: dropped unknown_field 1"]


def test_a_feed_never_synced_is_named_once_after_the_grace() -> None:
    watch = FeedWatch("b", "tcp://10.0.0.6:5557", 100.0, unsynced_after_s=30.0)
    assert watch.observe(NEVER, 100.0) == []
    assert watch.observe(NEVER, 129.9) == []
    (note,) = watch.observe(NEVER, 130.0)
    assert note.level == logging.WARNING
    assert note.text.startswith(
        "engine b: KV events not synced from tcp://10.0.0.6:5557 after 30 s")
    assert watch.observe(NEVER, 500.0) == []  # said once


def test_a_feed_that_synced_in_time_is_not_called_unsynced() -> None:
    watch = FeedWatch("b", "tcp://e:5557", 0.0, unsynced_after_s=30.0)
    watch.observe(stats(synced=True), 10.0)
    notes = watch.observe(stats(synced=False, resets=1), 40.0)
    assert not any("not synced from" in n.text for n in notes)
