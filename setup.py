"""kvpeer's one C extension; everything else about the package is in pyproject.toml.

``kvpeer.router._intake`` runs the router's KV event intake past msgspec: the batch's
translation and token ids (``kvpeer/router/events.py``), the index's per-block loops, its
holder masks and its chain keys (``kvpeer/router/index.py``; docs/scale.md). It links
OpenSSL's libcrypto, which CPython's hashlib already loads (building needs its headers:
Debian's ``libssl-dev``). It is optional: without a C compiler or those headers the
install still succeeds and the router runs the same
work in Python, at about 2.4 times the CPU per event at 256 engines; ``kvpeer router``
logs which one it runs.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvpeer.router._intake",
            ["src/kvpeer/router/_intake.c"],
            libraries=["crypto"],  # OpenSSL's SHA-256 for the chain keys (hashlib's own)
            optional=True,
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror=implicit-function-declaration"],
        )
    ]
)
