"""The per-peer view of a node: ``GET /peers`` next to ``/metrics``, and its table.

Metrics carry no peer labels (catalog invariant 1); an operator who needs to
know *which* peer is stuck reads this instead. Invariants:

1. The document is read under the node's lock in one go and holds at most
   :data:`LIMIT` peers (the peer table is bounded anyway); ``total`` says how many
   there were.
2. Peer ids come from the network: the document carries them as received (JSON
   escapes them), and :func:`render` shows only printable ASCII, cut to
   :data:`ID_WIDTH` characters, so nothing a peer names reaches a terminal raw.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import asdict
from typing import Any

from kvpeer.node.driver import DrivenTier

__all__ = ["LIMIT", "PeersUnavailable", "fetch_peers", "peers_document", "peers_url", "render"]

LIMIT = 256
ID_WIDTH = 22
#: Rows ``kvpeer stats`` shows (one screen); the rest is summarised.
SHOWN = 8
FORMAT = "kvpeer-peers/1"


class PeersUnavailable(Exception):
    """The address has no kvpeer ``/peers`` (e.g. vLLM's ``/metrics``)."""


def peers_document(node: DrivenTier, limit: int = LIMIT) -> dict[str, Any]:
    """What ``GET /peers`` returns for ``node``."""
    with node.locked():
        tier = node.tier
        views, total = tier.peers(limit)
        local_id = tier.peer_id
    return {
        "format": FORMAT,
        "node": local_id,
        "total": total,
        "peers": [asdict(view) for view in views],
    }


def encode(document: dict[str, Any]) -> bytes:
    return json.dumps(document, ensure_ascii=True, separators=(",", ":")).encode()


def peers_url(metrics_url: str) -> str:
    """The ``/peers`` URL next to a ``/metrics`` URL."""
    base = metrics_url.split("?", 1)[0].rstrip("/")
    return base.removesuffix("/metrics") + "/peers"


def fetch_peers(url: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """The document at ``url``; :class:`PeersUnavailable` if there is none."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            body = response.read(4 << 20)
    except urllib.error.HTTPError as exc:
        raise PeersUnavailable(f"{url} answered HTTP {exc.code}") from exc
    try:
        document = json.loads(body)
    except ValueError as exc:
        raise PeersUnavailable(f"{url} is not a kvpeer peer list") from exc
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise PeersUnavailable(f"{url} is not a kvpeer peer list")
    return document


def safe(text: object, width: int = ID_WIDTH) -> str:
    """``text`` with anything but printable ASCII replaced, cut to ``width``."""
    shown = "".join(c if " " <= c <= "~" else "?" for c in str(text))
    return shown if len(shown) <= width else shown[: width - 1] + "~"


def _seconds(value: object) -> str:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return "-"
    return f"{value:.0f}s" if value >= 10 else f"{value:.1f}s"


def _int(value: object) -> str:
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else "?"


def render(document: dict[str, Any]) -> str:
    """The table ``kvpeer stats`` prints under the counters."""
    peers = [p for p in document.get("peers", []) if isinstance(p, dict)]
    total = document.get("total", len(peers))
    if not peers:
        return "peers             none"
    header = (
        f"{'peer':<{ID_WIDTH}} {'state':<12} {'age':>5} {'heard':>5} {'req c/p':>7} "
        f"{'loads':>5} {'keys w/q':>8} {'xfers':>5} {'pulled':>6} {'served':>6}"
    )
    lines = [f"peers             {_int(total)}", header]
    for p in peers[:SHOWN]:
        state = safe(p.get("state"), 12)
        if state == "backed_off":
            state = f"backoff {_seconds(p.get('retry_in_s'))}"  # retried in
        requests = _int(p.get("consumer_requests")) + "/" + _int(p.get("producer_requests"))
        keys = _int(p.get("lookups_waiting")) + "/" + _int(p.get("lookups_queued"))
        lines.append(
            f"{safe(p.get('peer_id')):<{ID_WIDTH}} {state:<12} "
            f"{_seconds(p.get('age_s')):>5} {_seconds(p.get('silent_s')):>5} {requests:>7} "
            f"{_int(p.get('loads_in_flight')):>5} {keys:>8} "
            f"{_int(p.get('transfers_in_flight')):>5} {_int(p.get('blocks_pulled')):>6} "
            f"{_int(p.get('blocks_served')):>6}"
        )
    hidden = (total if isinstance(total, int) else len(peers)) - min(len(peers), SHOWN)
    if hidden > 0:
        lines.append(f"... and {hidden} more (GET /peers for all)")
    return "\n".join(lines)
