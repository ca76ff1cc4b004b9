"""``python -m kvpeer.sim``: the command line of the deterministic simulation.

Only the entry point lives here; the simulation is lab code, :mod:`kvpeer.lab.sim`
(its command line: :mod:`kvpeer.lab.sim.seeds`).
"""
