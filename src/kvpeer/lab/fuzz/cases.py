"""What the generator produces (:class:`Case`) and what it knows (:class:`Target`)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Case", "Target"]


@dataclass(frozen=True, slots=True)
class Target:
    """The node under test and the fuzzer's own resources, as the generator sees them.

    ``identities`` are the claimed peer ids (``host:port``) of the fuzzer's DEALERs:
    the first ``listening`` of them have a ROUTER behind them that reads the node's
    dial-back, the rest have nobody listening. ``odd_identities`` are raw ZMQ
    identities that are not a usable peer id. Case identities index
    ``identities`` first, then ``odd_identities``.
    """

    identities: tuple[str, ...]
    listening: int
    block_len: int
    synthetic_blocks: int
    odd_identities: tuple[bytes, ...] = ()
    hash_seed: str = "vllm-none-hash"
    our_blocks: int = 64  # the region every connect of ours advertises
    host_id: str = ""  # the node's shm host identity, from its connect
    node_shm_path: str = ""
    node_agent_metadata: bytes = b""
    shm_files: tuple[str, ...] = ()  # our_blocks * block_len bytes, made by the fuzzer
    decoy_files: tuple[str, ...] = ()  # same size, outside /dev/shm
    tcp_sinks: tuple[tuple[str, int], ...] = ()  # listeners that read and discard
    dead_port: int = 1  # nothing listens there

    def __post_init__(self) -> None:
        if not self.identities or not 0 <= self.listening <= len(self.identities):
            raise ValueError("a target needs identities, the first `listening` of them heard")
        if self.synthetic_blocks < 1:
            raise ValueError("the node must hold synthetic blocks to fetch")


@dataclass(frozen=True, slots=True)
class Case:
    """One multipart message from one identity; ``label`` is ``"kind/mutation"``."""

    label: str
    scenario: str
    identity: int
    parts: tuple[bytes, ...]
    sequence: int

    @property
    def kind(self) -> str:
        return self.label.partition("/")[0]
