"""``kvpeer bench held``'s summary: medians per producer path, ratios, the evidence
columns (pulled from the right producer, same output, serve windows)."""

from __future__ import annotations

from kvpeer.lab.bench.held_bench import HELD, WINDOW, HeldSpec, render, summarize


def test_medians_and_ratios_per_path() -> None:
    samples = {
        HELD: {"computed": [1.0, 3.0, 2.0], "local": [0.1, 0.2, 0.3], "pulled": [0.3, 0.2, 0.9]},
        WINDOW: {"computed": [2.0], "local": [0.2], "pulled": [0.6]},
    }
    sources: dict[str, list[str | None]] = {HELD: ["a", "a", "b"], WINDOW: ["b"]}
    result = summarize(HeldSpec(), samples, sources, {HELD: 0.0, WINDOW: 3.0}, {HELD: 3, WINDOW: 1})
    held, window = result["rows"][HELD], result["rows"][WINDOW]
    assert (held["computed"], held["local"], held["pulled"]) == (2.0, 0.2, 0.3)
    assert held["pulled_over_local"] == 0.3 / 0.2
    assert held["pulled_from_producer"] == 2  # the third was pulled from the wrong engine
    assert window["pulled_from_producer"] == 1
    assert (held["producer_serve_windows"], window["producer_serve_windows"]) == (0.0, 3.0)
    assert result["held_over_window"] == 0.3 / 0.6
    text = render(result)
    assert "0.50x" in text
    assert "1.50x" in text


def test_a_path_without_samples_renders_dashes() -> None:
    empty: dict[str, list[float]] = {"computed": [], "local": [], "pulled": []}
    result = summarize(
        HeldSpec(), {HELD: empty, WINDOW: dict(empty)}, {HELD: [], WINDOW: []},
        {HELD: 0.0, WINDOW: 0.0}, {HELD: 0, WINDOW: 0},
    )  # fmt: skip
    assert result["held_over_window"] is None
    assert "pulled, held / serve-window: -" in render(result)
