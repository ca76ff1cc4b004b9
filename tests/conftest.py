"""Suite-wide setup: optional dependencies that a run declares required must be present.

``scripts/test`` installs NIXL and sets ``KVPEER_REQUIRE=nixl``, so on CI a missing
or broken NIXL fails the run instead of silently skipping its tests.
"""

from __future__ import annotations

import os

import pytest


def pytest_sessionstart(session: pytest.Session) -> None:
    required = {name for name in os.environ.get("KVPEER_REQUIRE", "").split(",") if name}
    if "nixl" in required:
        from kvpeer.transport.data.nixl import INSTALL_HINT, NixlBackend

        if not NixlBackend.available():
            pytest.exit(f"KVPEER_REQUIRE=nixl but {INSTALL_HINT}", returncode=3)
