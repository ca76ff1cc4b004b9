"""The engine-facing tier interface, where the node's users look for it.

Defined by the host layer (:mod:`kvpeer.host.interface`), which sits below the
node; :class:`~kvpeer.node.tier.Tier` and :class:`~kvpeer.node.driver.DrivenTier`
implement it.
"""

from __future__ import annotations

from kvpeer.host.interface import SecondaryTier

__all__ = ["SecondaryTier"]
