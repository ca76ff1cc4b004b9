"""Deterministic multi-node simulation of kvpeer tiers behind reference hosts.

``python -m kvpeer.sim --seeds N`` runs N seeded worlds (see
:mod:`kvpeer.lab.sim.world`) and checks the invariants of :mod:`kvpeer.lab.sim.checks`,
:mod:`kvpeer.lab.sim.budgets` and :mod:`kvpeer.lab.sim.reunion`; a failing seed prints
a one-line reproduction command.
"""

from kvpeer.lab.sim.world import SeedResult, World, run_seed

__all__ = ["SeedResult", "World", "run_seed"]
