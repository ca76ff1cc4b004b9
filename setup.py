"""kvpeer's one C extension; everything else about the package is in pyproject.toml.

``kvpeer.router._intake`` runs the router's per-block event intake (docs/scale.md). It is
optional: without a C compiler the install still succeeds and the router runs the same
loops in Python (``kvpeer/router/index.py``), at about twice the CPU per event at 256
engines; ``kvpeer router`` logs which one it runs.
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
