"""kvpeer's vLLM general plugin: the secondary tier type ``"kvpeer"``.

``kvpeer demo`` (tests/vllm/test_demo.py) runs its producer engine with
``"type": "kvpeer"``: that is the end-to-end check that vLLM loads the plugin in
its engine processes.
"""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

pytest.importorskip("vllm")

from vllm.plugins import DEFAULT_PLUGINS_GROUP
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

from kvpeer.integrations.vllm import KVPeerTier
from kvpeer.integrations.vllm.plugin import TIER_TYPE, register


def test_the_plugin_is_an_installed_vllm_entry_point() -> None:
    (found,) = [e for e in entry_points(group=DEFAULT_PLUGINS_GROUP) if e.name == "kvpeer"]
    assert found.load() is register


def test_register_resolves_the_short_type_and_may_run_twice() -> None:
    register()
    register()  # vLLM loads plugins in every process, sometimes more than once
    assert SecondaryTierFactory.get_tier_class({"type": TIER_TYPE}) is KVPeerTier
