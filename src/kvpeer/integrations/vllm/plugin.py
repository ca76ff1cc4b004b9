"""vLLM general plugin: registers kvpeer's tier as the secondary tier type ``"kvpeer"``.

Installed as the ``vllm.general_plugins`` entry point ``kvpeer`` (pyproject.toml), so with
kvpeer installed a tier entry can be just ``{"type": "kvpeer", "port": 5710, ...}``
instead of naming ``"type": "KVPeerTier", "module_path": "kvpeer.integrations.vllm"``.
vLLM calls plugins in each of its processes, possibly more than once: registering
again is a no-op. Set ``VLLM_PLUGINS`` to a list without ``kvpeer`` to turn it off.
"""

from __future__ import annotations

import logging

__all__ = ["TIER_TYPE", "register"]

TIER_TYPE = "kvpeer"

log = logging.getLogger("kvpeer.vllm")


def register() -> None:
    """Make ``"type": "kvpeer"`` resolve to :class:`~kvpeer.integrations.vllm.KVPeerTier`."""
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    try:
        SecondaryTierFactory.register_tier(
            TIER_TYPE, "kvpeer.integrations.vllm.secondary_tier", "KVPeerTier"
        )
    except ValueError:  # registered already (vLLM loads plugins per process, maybe twice)
        return
    log.debug("registered vLLM secondary tier type %r", TIER_TYPE)
