"""``--plot FILE.png``: the TTFT CDF of every arm, one panel per workload.

matplotlib is a development dependency (``requirements/dev.txt``), imported only here and
only when a plot is asked for; the Agg backend draws to a file with no display.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvpeer.errors import ConfigError
from kvpeer.lab.bench.serve_stats import Cell

__all__ = ["plot"]

ARM_COLOURS = {"none": "tab:gray", "affinity": "tab:green", "load": "tab:purple",
               "kvpeer": "tab:blue", "vllm-p2p": "tab:orange"}


def plot(cells: Sequence[Cell], path: Path) -> None:
    """Write the CDFs of ``cells`` to ``path`` (PNG)."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ConfigError(
            "--plot needs matplotlib: pip install -r requirements/dev.txt"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(c.workload for c in cells))
    if not workloads:
        raise ConfigError(f"--plot {path}: nothing was measured")
    figure, axes = plt.subplots(
        1, len(workloads), figsize=(4.2 * len(workloads), 3.6), squeeze=False
    )
    try:
        for axis, workload in zip(axes[0], workloads, strict=True):
            for cell in (c for c in cells if c.workload == workload):
                if not cell.ttfts_s:
                    continue
                xs = [t * 1000 for t in cell.ttfts_s]
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                axis.step(xs, ys, where="post", label=cell.arm,
                          color=ARM_COLOURS.get(cell.arm))
            axis.set_title(workload)
            axis.set_xlabel("TTFT (ms)")
            axis.set_xscale("log")
            axis.set_ylim(0, 1.02)
            axis.grid(True, alpha=0.3)
        axes[0][0].set_ylabel("fraction of requests")
        axes[0][0].legend(loc="lower right")
        figure.suptitle("kvpeer bench serve: TTFT CDF per arm")
        figure.tight_layout()
        figure.savefig(path, dpi=100)
    finally:
        plt.close(figure)
