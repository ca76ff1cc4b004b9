"""Test kit shipped with kvpeer: fake clock, in-memory link, fake data plane,
fake parent and a two-session harness. Usable by any host's own tests."""

from kvpeer.testing.clock import FakeClock
from kvpeer.testing.dataplane import Fabric, FakeDataPlane, PendingWrite, Region
from kvpeer.testing.harness import Node, SessionPair, make_hello
from kvpeer.testing.link import LinkEnd, MemoryLink
from kvpeer.testing.parent import FakeParent

__all__ = [
    "Fabric",
    "FakeClock",
    "FakeDataPlane",
    "FakeParent",
    "LinkEnd",
    "MemoryLink",
    "Node",
    "PendingWrite",
    "Region",
    "SessionPair",
    "make_hello",
]
