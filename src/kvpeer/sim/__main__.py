"""``python -m kvpeer.sim --seeds N [--first-seed S] [--nodes K]``: run seeded worlds
(:mod:`kvpeer.lab.sim.seeds`)."""

from kvpeer.lab.sim.seeds import command

if __name__ == "__main__":
    command()
