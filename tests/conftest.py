"""Suite-wide setup: optional dependencies that a run declares required must be present.

``scripts/test`` installs NIXL and vLLM, builds the router's C intake, and sets
``KVPEER_REQUIRE=nixl,vllm,native``, so on CI a missing or broken one fails the run
instead of silently skipping its tests.
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
    if "vllm" in required:
        import importlib.util

        from kvpeer.integrations.vllm import VLLM_INSTALL_HINT

        if importlib.util.find_spec("vllm") is None:
            pytest.exit(f"KVPEER_REQUIRE=vllm but {VLLM_INSTALL_HINT}", returncode=3)
    if "native" in required:
        from kvpeer.router.index import PrefixIndex

        if not PrefixIndex().native:
            pytest.exit(
                "KVPEER_REQUIRE=native but kvpeer.router._intake is not built: reinstall "
                "kvpeer (pip install -e .) with gcc and the Python headers",
                returncode=3,
            )
