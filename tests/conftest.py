"""Suite-wide setup: optional dependencies that a run declares required must be present.

``scripts/test`` installs NIXL and vLLM, builds the router's C intake, and sets
``KVPEER_REQUIRE=nixl,vllm,native``, so on CI a missing or broken one fails the run
instead of silently skipping its tests.

``scripts/vllm-compat`` runs the engine-less tests with a newer vLLM's Python tree first
on ``PYTHONPATH`` and ``KVPEER_VLLM_TREE`` naming its version: the run then stops at once
if ``import vllm`` finds another version, and leaves out (deselects, counted in pytest's
summary) every test that starts an engine, which that tree cannot run without its GPU build.
"""

from __future__ import annotations

import os

import pytest

# The fixtures that start or feed real engines (tests/vllm/conftest.py).
ENGINE_FIXTURES = frozenset({"launcher", "tiny_llama", "serve_llama"})


def pytest_sessionstart(session: pytest.Session) -> None:
    tree = os.environ.get("KVPEER_VLLM_TREE")
    if tree:
        import vllm

        if vllm.__version__ != tree:
            pytest.exit(
                f"KVPEER_VLLM_TREE={tree} but import vllm found {vllm.__version__} "
                f"at {vllm.__file__}: the tree is not first on PYTHONPATH",
                returncode=3,
            )
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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not os.environ.get("KVPEER_VLLM_TREE"):
        return
    engine = [item for item in items
              if ENGINE_FIXTURES & set(getattr(item, "fixturenames", ()))]  # fmt: skip
    if engine:
        config.hook.pytest_deselected(items=engine)
        items[:] = [item for item in items if item not in engine]
