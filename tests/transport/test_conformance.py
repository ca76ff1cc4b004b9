"""Every data plane against the one conformance suite (kvpeer.testing.conformance).

To add a plane, append a factory to :data:`FACTORIES`: a callable returning a fresh
:class:`~kvpeer.testing.conformance.Cluster`. A plane that needs optional software
skips inside its factory (see :func:`nixl_cluster`).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvpeer.testing.conformance import (
    CHECKS,
    BackendCluster,
    Cluster,
    ClusterFactory,
    FakeCluster,
    NamedBackendCluster,
    Windows,
)
from kvpeer.transport.data.shm import ShmBackend
from kvpeer.transport.data.tcp import TcpBackend


def memory_cluster() -> Cluster:
    return FakeCluster()


def shm_cluster() -> Cluster:
    # Both nodes live in this process: same_process lets them trust each other.
    return NamedBackendCluster(
        lambda name, region, notify: ShmBackend(region, notify, local_id=name, same_process=True),
        shm=True,
        windows=Windows.UNENFORCED,
    )


# The suite names nodes "A", "B", not host:port: these backends dial the host a
# peer's offer names (who is dialed by default is tested in test_tcp.py).
def tcp_cluster() -> Cluster:
    return BackendCluster(
        lambda region, notify: TcpBackend(region, notify, trust_offered_hosts=True),
        shm=False,
        windows=Windows.REFUSED,
    )


def tcp6_cluster() -> Cluster:
    return BackendCluster(
        lambda region, notify: TcpBackend(region, notify, host="::1", trust_offered_hosts=True),
        shm=False,
        windows=Windows.REFUSED,
    )


def nixl_cluster() -> Cluster:
    nixl = pytest.importorskip("kvpeer.transport.data.nixl")
    if not nixl.NixlBackend.available():
        pytest.skip("nixl is not installed")
    return BackendCluster(
        nixl.NixlBackend,
        shm=False,
        windows=Windows.UNENFORCED,
    )


FACTORIES: list[tuple[str, ClusterFactory]] = [
    ("memory", memory_cluster),
    ("shm", shm_cluster),
    ("tcp", tcp_cluster),
    ("nixl", nixl_cluster),
]


@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__.removeprefix("check_") for c in CHECKS])
@pytest.mark.parametrize("make", [f for _, f in FACTORIES], ids=[n for n, _ in FACTORIES])
def test_conformance(make: ClusterFactory, check: Callable[[ClusterFactory], None]) -> None:
    make().close()  # skips here if the plane cannot run on this machine
    check(make)
