"""Which data planes a node starts: NIXL only where some peer may use it.

NIXL (with UCX) costs a node about 300 MiB of resident memory; its plane is useless
unless some peer is trusted with NIXL metadata (``nixl_peers``, an explicit
``allowed_peers`` list, or CURVE), so without one it is not loaded at all.
"""

from __future__ import annotations

import pytest

from kvpeer.config import AllowList, TierConfig
from kvpeer.host import BlockPool
from kvpeer.node.build import _backends
from kvpeer.transport.data.base import PrimaryRegion
from kvpeer.transport.data.nixl import NixlBackend
from kvpeer.transport.data.tcp import TcpBackend


def planes(config: TierConfig) -> list[type]:
    pool = BlockPool(4, 4096)
    try:
        region = PrimaryRegion(pool.view, 4, 4096, pool.shm_path)
        backends = _backends(config, region, lambda: None, local_id=config.peer_id,
                             shm_same_process=True, held=None)  # fmt: skip
        try:
            return [type(backend) for backend in backends]
        finally:
            for backend in backends:
                backend.close()
    finally:
        pool.close()


def test_no_nixl_plane_when_no_peer_may_use_it() -> None:
    config = TierConfig.from_dict({"data_transports": ["tcp", "nixl"], "port": 0})
    assert config.nixl_trusted().nobody
    assert planes(config) == [TcpBackend]


@pytest.mark.parametrize(
    "settings",
    [{"nixl_peers": ["127.0.0.0/8"]}, {"allowed_peers": ["127.0.0.0/8"]}],
)
def test_the_nixl_plane_starts_for_trusted_peers(settings: dict[str, object]) -> None:
    config = TierConfig.from_dict({"data_transports": ["tcp", "nixl"], "port": 0, **settings})
    assert not config.nixl_trusted().nobody
    expected = [TcpBackend, NixlBackend] if NixlBackend.available() else [TcpBackend]
    assert planes(config) == expected


def test_nobody_means_an_empty_allow_list() -> None:
    assert AllowList().nobody
    assert not AllowList.allow_all().nobody
    assert not AllowList.from_entries(["10.0.0.0/8"]).nobody
