"""Assemble a real node from a config: ZMQ control, data planes, tier, driver."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

from kvpeer.config import AllowList, TierConfig
from kvpeer.errors import ConfigError, DataPlaneError
from kvpeer.host.claims import sweep
from kvpeer.node.driver import DrivenTier
from kvpeer.node.held import HeldBlocks
from kvpeer.node.params import split_peer_id
from kvpeer.node.tier import Tier
from kvpeer.transport.data.base import Backend, PrimaryRegion
from kvpeer.transport.data.planes import DataPlaneSet
from kvpeer.transport.zmq_control import CurveKeys, ZmqControl

__all__ = ["open_node"]

log = logging.getLogger("kvpeer.node")


class _Completions:
    """A callable whose target is set once the driven tier exists: where every data
    plane asks for a poll (the loop's ``request_poll``) or where the plane set wakes
    the loop (``wake``); before it, nothing polls and no transfer runs."""

    def __init__(self) -> None:
        self.target: Callable[[], None] = _nothing

    def __call__(self) -> None:
        self.target()


def _nothing() -> None:
    """No poll to ask for yet."""


def _allows(allowed: AllowList, peer_id: str) -> bool:
    address = split_peer_id(peer_id)
    return address is not None and allowed.allows(*address)


def _backends(
    config: TierConfig,
    region: PrimaryRegion,
    completions: Callable[[], None],
    *,
    local_id: str,
    shm_same_process: bool,
    held: HeldBlocks | None,
) -> list[Backend]:
    backends: list[Backend] = []
    for name in config.data_transports:
        if name == "shm":
            if region.shm_path is None:
                log.info("data plane shm skipped: the primary region is not a shared file")
                continue
            from kvpeer.transport.data.shm import ShmBackend

            backends.append(
                ShmBackend(
                    region,
                    completions,
                    local_id=local_id,
                    same_process=shm_same_process,
                    held=(held.base_addr, held.rows) if held is not None else None,
                )
            )
        elif name == "tcp":
            from kvpeer.transport.data.tcp import TcpBackend

            backends.append(
                TcpBackend(
                    region,
                    completions,
                    host=config.host,
                    trust_offered_hosts=config.trust_peer_addresses,
                )
            )
        elif name == "nixl":
            if config.nixl_trusted().nobody:
                # NIXL and UCX cost a node ~300 MiB of RSS: not loaded for no peer at all.
                log.info("data plane nixl skipped: no peer may use it (give nixl_peers, or "
                         "an allowed_peers list, or CURVE)")
                continue
            from kvpeer.transport.data.nixl import NixlBackend

            if not NixlBackend.available():
                log.info("data plane nixl skipped: nixl is not installed")
                continue
            trusted = functools.partial(_allows, config.nixl_trusted())
            backends.append(NixlBackend(region, completions, trusted=trusted))
    if not backends:
        raise ConfigError(f"data_transports: none of {list(config.data_transports)!r} can run here")
    return backends


def _held_blocks(
    config: TierConfig, region: PrimaryRegion, serves: Callable[[str], bool]
) -> HeldBlocks | None:
    """The held copy (``held_bytes``; by default a quarter of the region, at most 4 GiB),
    read by the shm plane only: ``serves`` says whether a peer's session writes with it."""
    size = config.held_bytes_for(region.num_blocks * region.block_len, region.block_len)
    if size < region.block_len:
        return None
    if region.shm_path is None or "shm" not in config.data_transports:
        if config.held_bytes is not None:
            log.warning("held_bytes ignored: only the shm data plane serves held blocks")
        return None
    how = "held_bytes" if config.held_bytes is not None else "automatic: a quarter of the region"
    log.info("holding up to %.0f MiB of stored blocks for peers (%s)", size / 2**20, how)
    return HeldBlocks(region.view, region.num_blocks, region.block_len, size, serves=serves)


def open_node(
    config: TierConfig,
    region: PrimaryRegion,
    *,
    hash_seed: str | Callable[[], str] | None = None,
    clock: Callable[[], float] = time.monotonic,
    wake_host: Callable[[], None] | None = None,
    shm_same_process: bool = False,
    trace: bool = False,
    trim_heap: bool = False,
) -> DrivenTier:
    """Bind the control port, start the data planes and the driver thread.

    ``shm_same_process``: let the shm plane exchange regions with other nodes of this
    very process (tests run several in one; otherwise such a region is refused).
    First, region files that processes which died left in /dev/shm are removed
    (``kvpeer.host.claims``). ``trace``: the tier logs each pull's steps
    (:mod:`kvpeer.node.trace`). ``trim_heap``: the node owns its process (``kvpeer
    serve``), so its driver may hand the process's freed heap back to the system
    (:mod:`kvpeer.node.trim`); never inside an engine's process, whose heap is the
    engine's (a trim of a 1.7 GiB fragmented heap took 0.24-1.7 s here, holding
    glibc's arena locks)."""
    sweep()
    curve = None
    if config.curve is not None:
        curve = CurveKeys.load(
            config.curve.server_secret_key_file,
            config.curve.server_public_key_file,
            config.curve.client_public_keys_dir,
        )
    control = ZmqControl(
        config.host,
        config.port,
        heartbeat_interval_s=config.heartbeat_interval_s,
        heartbeat_timeout_s=config.heartbeat_timeout_s,
        max_queued_frames=config.max_queued_messages,
        max_link_bytes=config.max_peer_bytes,
        curve=curve,
    )
    completions = _Completions()
    prepared = _Completions()  # a registration made off the lock: wake the loop
    held = _held_blocks(config, region, lambda peer_id: data.chosen(peer_id) == "shm")
    try:
        backends = _backends(
            config,
            region,
            completions,
            local_id=control.local_id,
            shm_same_process=shm_same_process,
            held=held,
        )
        data = DataPlaneSet(
            region, backends, notify=prepared, held_rows=held.rows if held is not None else 0
        )
    except (ConfigError, DataPlaneError):
        control.close()
        if held is not None:
            held.close()
        raise
    tier = Tier(
        config, control, data, clock=clock, sleep=time.sleep, hash_seed=hash_seed, trace=trace,
        held=held,
    )  # fmt: skip
    log.info(
        "kvpeer node %s: %d blocks x %d bytes, data planes %s",
        control.local_id,
        region.num_blocks,
        region.block_len,
        ",".join(data.backends),
    )
    driven = DrivenTier(tier, control, clock=clock, wake_host=wake_host, trim_heap=trim_heap)
    completions.target = driven.loop.request_poll
    prepared.target = driven.loop.wake  # never a poll on the reaper thread (it may wait for it)
    return driven
