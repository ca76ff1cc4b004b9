"""The public surface, pinned: changing an ``__all__`` must be a deliberate act."""

from __future__ import annotations

import importlib

import pytest

PUBLIC_SURFACE: dict[str, list[str]] = {
    "kvpeer": [
        "ConfigError",
        "DataPlaneError",
        "HandshakeRejected",
        "KVPeerError",
        "Key",
        "LocalFault",
        "LookupResult",
        "PeerLost",
        "ProtocolError",
        "ServeRequest",
        "StoreJob",
        "__version__",
    ],
    "kvpeer.protocol": [
        "AbortAck",
        "AbortFetch",
        "AckExtension",
        "Codec",
        "Connect",
        "ConnectAck",
        "ConnectExtension",
        "Disconnect",
        "Fetch",
        "Inbound",
        "KNOWN_TYPES",
        "Key",
        "Lookup",
        "LookupResponse",
        "Message",
        "PING_VERSION",
        "PROTOCOL_VERSION",
        "Ping",
        "Pong",
        "Prefetch",
        "PrefetchRefused",
        "RESOLVE_VERSION",
        "TransferDone",
        "TransportChoice",
        "TransportOffer",
        "Undecodable",
        "UnknownMessage",
    ],
    "kvpeer.session": [
        "Admit",
        "CloseKind",
        "ConsumerStatistics",
        "DataPlane",
        "LoadFinished",
        "Parent",
        "PeerSession",
        "PollResult",
        "ProducerStatistics",
        "SessionClosed",
        "SessionSettings",
        "SessionStatistics",
        "StoreFinished",
        "TransferEvent",
    ],
    "kvpeer.testing": [
        "Fabric",
        "FakeClock",
        "FakeDataPlane",
        "FakeParent",
        "LinkEnd",
        "MemoryLink",
        "Node",
        "PendingWrite",
        "Region",
        "SessionPair",
        "make_hello",
    ],
}


class TestPublicSurface:
    """Each package exports exactly the names listed here."""

    @pytest.mark.parametrize("module_name", sorted(PUBLIC_SURFACE))
    def test_all_is_pinned(self, module_name: str) -> None:
        """``__all__`` holds exactly the pinned names, each once."""
        exported = list(importlib.import_module(module_name).__all__)
        assert len(exported) == len(set(exported)), "duplicate names in __all__"
        assert sorted(exported) == PUBLIC_SURFACE[module_name]

    @pytest.mark.parametrize(
        ("module_name", "name"),
        [(module, name) for module, names in sorted(PUBLIC_SURFACE.items()) for name in names],
    )
    def test_every_exported_name_is_importable(self, module_name: str, name: str) -> None:
        """``from <module> import <name>`` works for every exported name."""
        namespace: dict[str, object] = {}
        exec(f"from {module_name} import {name}", namespace)
        assert name in namespace

    def test_pinned_lists_are_sorted(self) -> None:
        """Keep this file easy to review."""
        for names in PUBLIC_SURFACE.values():
            assert names == sorted(names)

    def test_star_import_gives_exactly_all(self) -> None:
        """``from kvpeer.protocol import *`` brings exactly ``__all__`` and nothing private."""
        for module_name, names in PUBLIC_SURFACE.items():
            namespace: dict[str, object] = {}
            exec(f"from {module_name} import *", namespace)
            assert sorted(k for k in namespace if k != "__builtins__") == names
