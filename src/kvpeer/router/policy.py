"""The contract between the router's HTTP edge and its decision core.

The HTTP edge (``router.app``) owns sockets, health checks, retries and the two PD legs;
the decision core (``router.index``, ``router.decide``) owns what each engine holds and
which plan is predicted fastest. They meet here, in plain data and one protocol, so each
side is tested without the other. The core is sans-IO: every call that depends on time
takes ``now`` (seconds, ``time.monotonic()`` of the caller).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

__all__ = [
    "MAX_ENGINE_WAIT_S",
    "EngineLoad",
    "EngineSpec",
    "Mode",
    "Outcome",
    "Plan",
    "Policy",
    "Role",
]

#: The longest ``engine_wait_s`` a tier can be configured with (kvpeer.config's
#: ``MAX_SECONDS``): a longer one reported on an engine's ``/metrics`` is no tier's.
MAX_ENGINE_WAIT_S = 1e9


class Mode(StrEnum):
    PD = "pd"  # prefill pool + decode pool: prefill leg, then decode leg pulls all
    SHARED = "shared"  # every engine serves whole requests; pull a longer cached prefix


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """One engine (one data-parallel rank) the router may send requests to."""

    name: str  # unique, stable across restarts: "e0", "prefill-1", ...
    url: str  # its OpenAI server, e.g. "http://127.0.0.1:8100"
    peer_host: str  # its kvpeer tier's control address, named to other engines
    peer_port: int  # already + its data-parallel rank
    role: Role = Role.BOTH
    kv_events: str | None = None  # its vLLM KV-event publisher, "tcp://host:port"
    kv_events_replay: str | None = None  # its replay endpoint, if configured
    #: its kvpeer tier serves held blocks (``held_bytes``) without its engine's serve
    #: window: a pull it answers from them waits for no engine step, busy or not
    #: (how many it does: :attr:`EngineLoad.held_share`)
    serves_held: bool = False
    #: it runs kvpeer's connector and manager (docs/vllm.md): a pull into it lands in
    #: the step that looked it up, so it costs no extra engine step of its own
    sync_pulls: bool = False
    #: its kvpeer tier obeys this router's ``prefetch`` (its ``prefetch_from`` names the
    #: router): a pull into it starts when the router sends the request (kvpeer.node.ahead)
    pulls_ahead: bool = False

    @property
    def peer(self) -> str:
        return f"{self.peer_host}:{self.peer_port}"

    def held_share(self, load: EngineLoad) -> float:
        """The share of pulls from it answered from held blocks, as the cost model takes
        it (``held``): ``load``'s reported share if its tier serves held blocks, else 0."""
        return min(1.0, max(0.0, load.held_share)) if self.serves_held else 0.0


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What the edge knows of an engine's load when a request arrives."""

    healthy: bool
    in_flight: int  # requests sent and not finished
    queued_prompt_tokens: int  # prompt tokens of requests sent whose first token is not back
    #: of peers' lookups, the share its tier answered from held blocks lately (reported,
    #: kvpeer.router.heldshare; 1.0 until known): only a busy source's pulls depend on it
    held_share: float = 1.0
    #: how long its kvpeer tier lets a peer's lookup wait for its busy engine at most
    #: (its ``engine_wait_s``, reported on its ``/metrics``; ``inf``: no bound), None
    #: when not reported: the cost model's prior for a ``held`` source
    engine_wait_s: float | None = None


@dataclass(frozen=True, slots=True)
class Plan:
    """Where one request goes.

    ``engine`` serves the client's request (the decode engine in PD mode).
    ``prefill_engine`` (PD only) runs the ``max_tokens=1`` producer leg first; ``None``
    means decode-only. ``source`` (shared only) is named in ``remote_kv_source`` so
    ``engine`` pulls the prefix it lacks; ``None`` means compute locally.
    """

    engine: str
    prefill_engine: str | None = None
    source: str | None = None
    predicted_cached_tokens: int = 0  # prompt tokens ``engine`` will not compute
    predicted_pulled_tokens: int = 0  # of those, pulled from ``source``/``prefill_engine``
    predicted_ttft_s: float | None = None
    reason: str = ""  # one short phrase for logs and the request trace
    #: how much of the prompt ``source`` holds in its CPU tier, in whole blocks, the
    #: prompt's last block included (sent to ``engine`` as ``held_tokens``): more than
    #: ``predicted_cached_tokens`` when the prompt is held whole, because a consumer
    #: loading synchronously takes the last block too and computes one token only
    source_held_tokens: int = 0
    #: (shared, with ``source``) how long after its engine submits the pull it should
    #: stop waiting and compute instead (kvpeer.router.decide rule 8)
    give_up_s: float | None = None
    #: (``compute: pull slower``) the predicted TTFT of the best pull it passed over
    rejected_pull_ttft_s: float | None = None


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the edge observed for one finished request (for online learning)."""

    request_id: str
    engine: str
    ok: bool
    prompt_tokens: int
    cached_tokens: int | None  # the engine's ``usage.prompt_tokens_details.cached_tokens``
    ttft_s: float | None  # first byte of the client's response, from the router's send
    prefill_leg_s: float | None = None  # PD: the prefill leg's whole duration


class Policy(Protocol):
    """The decision core as the HTTP edge sees it. Never raises on engine data."""

    def plan(
        self,
        request_id: str,
        prompt: Sequence[int],
        loads: Mapping[str, EngineLoad],
        now: float,
        *,
        serve_on: str | None = None,
        pull_from: str | None = None,
    ) -> Plan:
        """Choose; only engines with ``loads[name].healthy`` may appear in the plan.

        ``serve_on`` (a healthy engine that may serve) pins the serving engine; the
        policy still chooses the source or prefill engine for it. ``pull_from`` (a
        healthy engine, shared mode) pins the source: the serving engine pulls from
        it whenever it holds more of the prompt, whatever pulling is predicted to
        cost (benchmarks that compare tiers, not routing decisions)."""
        ...

    def on_sent(self, request_id: str, plan: Plan, prompt: Sequence[int], now: float) -> None:
        """The request went out as planned: add short-lived speculative index entries."""
        ...

    def on_outcome(self, outcome: Outcome, now: float) -> None:
        """A request finished (or failed): learn rates, record predicted vs actual."""
        ...

    def on_engine_restart(self, engine: str, now: float) -> None:
        """The edge saw the engine go away and come back: forget what it held."""
        ...
