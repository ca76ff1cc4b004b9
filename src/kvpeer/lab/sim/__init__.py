"""Deterministic multi-node simulation of kvpeer tiers behind reference hosts.

``python -m kvpeer.sim --seeds N`` runs N seeded worlds (see
:mod:`kvpeer.sim.world`) and checks the invariants of :mod:`kvpeer.sim.checks`,
:mod:`kvpeer.sim.budgets` and :mod:`kvpeer.sim.reunion`; a failing seed prints
a one-line reproduction command.
"""

from kvpeer.sim.world import SeedResult, World, run_seed

__all__ = ["SeedResult", "World", "run_seed"]
