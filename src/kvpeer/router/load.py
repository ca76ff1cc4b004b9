"""This router's own load per engine: requests in flight, prompt tokens queued, the mean prompt.

Counted by the request path (:mod:`kvpeer.router.forward`) as legs are sent and
answered, read by the health filter (:mod:`kvpeer.router.candidates`) for every plan.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["MEAN_PROMPT_PRIOR", "Load", "Loads"]

MEAN_PROMPT_PRIOR = 1024  # prompt tokens per request, until this router has seen some


@dataclass(slots=True)
class Load:
    """This router's requests on one engine."""

    in_flight: int = 0
    queued_prompt_tokens: int = 0
    queued: int = 0  # requests whose first token is not back

    def sent(self, tokens: int) -> None:
        self.in_flight += 1
        self.queued_prompt_tokens += tokens
        self.queued += 1

    def answering(self, tokens: int) -> None:
        """The first token is back (or the request ended before it)."""
        self.queued_prompt_tokens -= tokens
        self.queued -= 1


class Loads(dict[str, Load]):
    """A :class:`Load` per engine, and the prompt tokens per serving leg sent, a moving
    mean (how many tokens another router's waiting request is taken to queue)."""

    def __init__(self, names: Iterable[str]) -> None:
        super().__init__((name, Load()) for name in names)
        self.mean_prompt_tokens = float(MEAN_PROMPT_PRIOR)

    def serving(self, name: str, tokens: int) -> Load:
        """A serving leg of ``tokens`` prompt tokens goes to ``name``: its load."""
        load = self[name]
        load.sent(tokens)
        self.mean_prompt_tokens += 0.1 * (tokens - self.mean_prompt_tokens)
        return load
