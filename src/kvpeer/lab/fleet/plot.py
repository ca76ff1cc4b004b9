"""``kvpeer lab fleet --plot FILE.png``: per fleet size, TTFT p90 and reuse against load.

One row per fleet size: TTFT p90 by offered load for every policy (kvpeer and the bounds
once per link), and the reuse each realised as a share of the pooled-memory bound's.
matplotlib is a development dependency, imported only here and only when asked for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvpeer.errors import ConfigError

__all__ = ["plot"]

COLOURS = {"load": "tab:purple", "affinity": "tab:green", "kvpeer": "tab:blue",
           "pooled": "tab:gray", "infinite": "black"}
STYLES = {"rdma": "-", "tcp": "--", "nvlink": ":"}


def plot(result: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib
    except ImportError as exc:
        raise ConfigError("--plot needs matplotlib: pip install -r requirements/dev.txt") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    sizes = sorted({r["engines"] for r in runs})
    fig, axes = plt.subplots(len(sizes), 2, figsize=(11, 3.2 * len(sizes)), squeeze=False)
    for row, size in zip(axes, sizes, strict=True):
        lines: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
        for r in runs:
            if r["engines"] == size:
                lines.setdefault((r["policy"], r["link"]), []).append(
                    (r["load"], r["ttft_p90_s"], r.get("reuse_vs_pooled", float("nan"))))
        for (policy, link), points in sorted(lines.items()):
            points.sort()
            label = policy if policy in ("load", "affinity") else f"{policy} {link}"
            style = "-" if policy in ("load", "affinity") else STYLES.get(link, "-")
            loads = [p[0] for p in points]
            row[0].plot(loads, [p[1] for p in points], style, marker="o", markersize=3,
                        color=COLOURS.get(policy), label=label)
            if policy not in ("pooled",):
                row[1].plot(loads, [100 * p[2] for p in points], style, marker="o",
                            markersize=3, color=COLOURS.get(policy), label=label)
        row[0].set_title(f"{size} engines: TTFT p90")
        row[0].set_xlabel("offered load (fraction of no-reuse capacity)")
        row[0].set_ylabel("seconds")
        row[0].set_yscale("log")
        row[1].set_title(f"{size} engines: reuse, % of the pooled-memory bound")
        row[1].set_xlabel("offered load (fraction of no-reuse capacity)")
        row[1].set_ylabel("%")
        row[0].legend(fontsize=7)
    fig.suptitle(Path(result["trace"]).name + " (fleet model: Llama-3.1-8B on H100, assumptions "
                 "in docs/fleet.md)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)
