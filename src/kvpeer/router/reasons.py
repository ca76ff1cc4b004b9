"""Why a plan is what it is: the reasons a plan names (``Plan.reason``, the label of
``kvpeer_router_policy_plans_by_reason_total``)."""

from __future__ import annotations

from typing import Final

__all__ = [
    "REASONS",
    "REASON_CACHE",
    "REASON_LOAD",
    "REASON_NO_ENGINE",
    "REASON_PD",
    "REASON_PD_CACHED",
    "REASON_PD_NO_PREFILL",
    "REASON_PULL",
    "REASON_PULL_EXPLORE",
    "REASON_PULL_PINNED",
    "REASON_PULL_SLOWER",
]

REASON_LOAD: Final = "load"  # nobody holds any of the prompt: least predicted wait
REASON_CACHE: Final = "cache"  # the chosen engine's own cache made it the fastest
REASON_PULL: Final = "pull"  # the chosen engine pulls a longer prefix from a peer
REASON_PULL_SLOWER: Final = "compute: pull slower"  # a peer had more; computing wins
REASON_PULL_PINNED: Final = "pull: pinned source"  # the client pinned the source
REASON_PULL_EXPLORE: Final = "pull: exploring"  # predicted a little slower: tried (rule 6)
REASON_PD: Final = "pd"
REASON_PD_CACHED: Final = "pd: decode-only, cached"
REASON_PD_NO_PREFILL: Final = "pd: decode-only, no prefill engine"
REASON_NO_ENGINE: Final = "no healthy engine"  # Plan.engine is "": answer 503
REASONS: Final = (
    REASON_LOAD, REASON_CACHE, REASON_PULL, REASON_PULL_SLOWER, REASON_PULL_PINNED,
    REASON_PULL_EXPLORE, REASON_PD,
    REASON_PD_CACHED, REASON_PD_NO_PREFILL, REASON_NO_ENGINE,
)
