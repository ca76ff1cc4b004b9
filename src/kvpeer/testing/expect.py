"""Assertions the shipped conformance suites use, so they need no test runner.

A failed check raises :class:`AssertionError`; a check that does not apply to an
implementation raises :class:`unittest.SkipTest` (pytest and unittest both report it
as a skip).
"""

from __future__ import annotations

import re
import unittest
from collections.abc import Hashable, Iterator, MutableMapping
from contextlib import contextmanager
from typing import TypeVar

__all__ = ["raises", "record_once", "skip"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@contextmanager
def raises(kind: type[BaseException], match: str | None = None) -> Iterator[None]:
    """Assert that the block raises ``kind`` (whose text contains ``match``, a regex)."""
    try:
        yield
    except kind as exc:
        if match is not None and not re.search(match, str(exc)):
            raise AssertionError(f"{kind.__name__} {str(exc)!r} does not match {match!r}") from exc
        return
    raise AssertionError(f"did not raise {kind.__name__}")


def skip(reason: str) -> None:
    """This check does not apply to the implementation under test."""
    raise unittest.SkipTest(reason)


def record_once(seen: MutableMapping[K, V], key: K, value: V, what: str = "job") -> None:
    """Record ``value`` under ``key``, failing if ``key`` was reported before (every
    job, transfer or result is reported exactly once)."""
    if key in seen:
        raise AssertionError(f"{what} {key} reported twice")
    seen[key] = value
