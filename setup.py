"""kvpeer's one C extension; everything else about the package is in pyproject.toml.

``kvpeer.router._intake`` runs the router's KV event intake past msgspec: the batch's
translation and token ids (``kvpeer/router/events.py``), the index's per-block loops, its
holder masks and its chain keys (``kvpeer/router/index.py``; docs/scale.md). It is
optional: without a C compiler the install still succeeds and the router runs the same
work in Python, at about 2.4 times the CPU per event at 256 engines; ``kvpeer router``
logs which one it runs.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvpeer.router._intake",
            ["src/kvpeer/router/_intake.c"],
            optional=True,
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror=implicit-function-declaration"],
        )
    ]
)
