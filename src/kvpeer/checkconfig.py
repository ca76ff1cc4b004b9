"""``kvpeer check-config``: every problem of a vLLM ``kv_transfer_config``, with its key.

Accepts either a whole ``kv_transfer_config`` (as given to ``--kv-transfer-config``)
or one kvpeer tier entry. Checks the connector and offloading spec kvpeer needs,
finds the kvpeer entries of ``secondary_tiers`` and validates their keys with
:func:`kvpeer.config.validate_dict`. Pure: no vLLM import, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvpeer.config import HELD_BYTES_MAX, HELD_SHARE, TierConfig, validate_dict

__all__ = ["DEVICES", "check_transfer_config", "effective_settings"]

TIER_TYPES = ("KVPeerTier", "kvpeer")
TIERING_SPECS = ("TieringOffloadingSpec", "CpuTieringOffloadingSpec", "KVPeerTieringOffloadingSpec")
KVPEER_SPECS = ("CpuTieringOffloadingSpec", "KVPeerTieringOffloadingSpec")
#: Specs whose worker copies KV caches only on the CPU (it refuses a cuda/xpu tensor at
#: start, so the engine never comes up), and the spec to name instead.
CPU_ONLY_SPECS = {"CpuTieringOffloadingSpec": "KVPeerTieringOffloadingSpec"}
#: Devices an engine's KV cache may live on (``--device``); all but ``cpu`` are GPUs.
DEVICES = ("cpu", "cuda", "rocm", "xpu")
SPEC_MODULE = "kvpeer.integrations.vllm.cpu_spec"
CONNECTORS = ("OffloadingConnector", "KVPeerOffloadingConnector")
CONNECTOR_MODULE = "kvpeer.integrations.vllm.connector"
_VLLM_TIER_KEYS = ("type", "module_path")


def _is_kvpeer_tier(entry: Mapping[str, object]) -> bool:
    module = entry.get("module_path")
    return entry.get("type") in TIER_TYPES or (
        isinstance(module, str) and module.split(".")[0] == "kvpeer"
    )


def _check_tier(entry: Mapping[str, object], where: str) -> list[str]:
    problems = []
    if entry.get("type") == "KVPeerTier" and entry.get("module_path") is None:
        problems.append(
            f"{where}.module_path: missing; vLLM finds 'KVPeerTier' only with "
            '"module_path": "kvpeer.integrations.vllm"'
        )
    if "backpressure" in entry:
        problems.append(
            f"{where}.backpressure: not supported by kvpeer (dropping a producer's "
            "store strands its decoder)"
        )
    keys = {k: v for k, v in entry.items() if k not in (*_VLLM_TIER_KEYS, "backpressure")}
    problems.extend(f"{where}.{line}" for line in validate_dict(keys))
    return problems


def check_transfer_config(config: object, device: str | None = None) -> list[str]:
    """Problem lines for ``config`` (a kv_transfer_config or a tier entry); [] if fine.

    ``device``: where the engine's KV cache lives (one of :data:`DEVICES`), if known; a
    CPU-only spec on a GPU engine is then a problem."""
    if not isinstance(config, Mapping):
        return [f"expected a JSON object, got {type(config).__name__}"]
    if "kv_connector" not in config and "kv_connector_extra_config" not in config:
        return _check_tier(config, "tier")  # a single tier entry
    problems: list[str] = []
    connector = config.get("kv_connector")
    if connector not in CONNECTORS:
        problems.append(
            f"kv_connector: kvpeer is a secondary tier of 'KVPeerOffloadingConnector' "
            f"(or vLLM's 'OffloadingConnector'), got {connector!r}"
        )
    elif connector == "KVPeerOffloadingConnector" and (
        config.get("kv_connector_module_path") != CONNECTOR_MODULE
    ):
        problems.append(
            f"kv_connector_module_path: 'KVPeerOffloadingConnector' lives in "
            f"{CONNECTOR_MODULE!r}, got {config.get('kv_connector_module_path')!r}"
        )
    extra = config.get("kv_connector_extra_config")
    if not isinstance(extra, Mapping):
        problems.append(f"kv_connector_extra_config: expected an object, got {extra!r}")
        return problems
    spec = extra.get("spec_name", "CPUOffloadingSpec")
    if spec not in TIERING_SPECS:
        problems.append(
            f"kv_connector_extra_config.spec_name: secondary tiers need one of "
            f"{list(TIERING_SPECS)}, got {spec!r}"
        )
    if device is not None and device != "cpu" and spec in CPU_ONLY_SPECS:
        problems.append(
            f"kv_connector_extra_config.spec_name: {spec!r} copies KV caches on the CPU only "
            f"and refuses a {device} engine's at start; use {CPU_ONLY_SPECS[spec]!r} "
            "(same spec_module_path) on GPUs"
        )
    if spec in KVPEER_SPECS and extra.get("spec_module_path") != SPEC_MODULE:
        problems.append(
            f"kv_connector_extra_config.spec_module_path: {spec!r} lives in "
            f"{SPEC_MODULE!r}, got {extra.get('spec_module_path')!r}"
        )
    sync_load = extra.get("kvpeer_sync_load", True)
    if not isinstance(sync_load, bool):
        problems.append(
            f"kv_connector_extra_config.kvpeer_sync_load: expected true or false, got {sync_load!r}"
        )
    tiers = extra.get("secondary_tiers")
    if not isinstance(tiers, list):
        problems.append(
            f"kv_connector_extra_config.secondary_tiers: expected a list, got {tiers!r}"
        )
        return problems
    found = 0
    for index, entry in enumerate(tiers):
        where = f"kv_connector_extra_config.secondary_tiers[{index}]"
        if not isinstance(entry, Mapping):
            problems.append(f"{where}: expected an object, got {entry!r}")
        elif _is_kvpeer_tier(entry):
            found += 1
            problems.extend(_check_tier(entry, where))
    if not found:
        problems.append(
            "kv_connector_extra_config.secondary_tiers: no kvpeer tier (an entry with "
            '"type": "KVPeerTier", "module_path": "kvpeer.integrations.vllm")'
        )
    return problems


def effective_settings(config: object) -> list[str]:
    """What each valid kvpeer tier entry of ``config`` will do that its keys do not say:
    the held blocks' size (from ``cpu_bytes_to_use``, the CPU tier's) and whose prefetches
    it obeys. One line each; [] for anything :func:`check_transfer_config` refuses."""
    if not isinstance(config, Mapping) or check_transfer_config(config):
        return []
    if "kv_connector" not in config and "kv_connector_extra_config" not in config:
        entries: list[tuple[str, Mapping[str, object]]] = [("tier", config)]
        cpu_bytes: object = None
    else:
        extra = config["kv_connector_extra_config"]
        cpu_bytes = extra.get("cpu_bytes_to_use")
        entries = [(f"kv_connector_extra_config.secondary_tiers[{i}]", entry)
                   for i, entry in enumerate(extra["secondary_tiers"])
                   if isinstance(entry, Mapping) and _is_kvpeer_tier(entry)]  # fmt: skip
    lines = []
    for where, entry in entries:
        keys = {k: v for k, v in entry.items() if k not in _VLLM_TIER_KEYS}
        tier = TierConfig.from_dict(keys)
        lines.append(f"{where}: held blocks: {_held(tier, cpu_bytes)}")
        trusted = tier.prefetch_trusted()
        if trusted.nobody:
            ahead = "off (prefetch_from is [])"
        else:
            whom = ("anyone CURVE admits" if trusted.everyone
                    else ", ".join(trusted.to_entries() or []))  # fmt: skip
            origin = "prefetch_from" if tier.prefetch_from is not None else "by default"
            ahead = (f"obeys prefetches from {whom} ({origin}), staging "
                     f"{tier.staging_blocks} rows of the CPU tier")
        lines.append(f"{where}: pulling ahead: {ahead}")
    return lines


def _held(tier: TierConfig, cpu_bytes: object) -> str:
    if "shm" not in tier.data_transports:
        return "none (only the shm data plane serves them)"
    if tier.held_bytes is not None:
        if tier.held_bytes == 0:
            return "off (held_bytes 0)"
        return f"{_mib(tier.held_bytes)} (held_bytes)"
    share = f"a quarter of the CPU tier, at most {_mib(HELD_BYTES_MAX)}"
    if isinstance(cpu_bytes, int) and not isinstance(cpu_bytes, bool) and cpu_bytes > 0:
        size = min(cpu_bytes // HELD_SHARE, HELD_BYTES_MAX)
        return f"up to {_mib(size)} ({share}; cpu_bytes_to_use {_mib(cpu_bytes)})"
    return share


def _mib(size: int) -> str:
    return f"{size / 2**20:,.0f} MiB"
