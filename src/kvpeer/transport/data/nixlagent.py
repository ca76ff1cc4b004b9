"""The typed face of one NIXL agent: the only code that touches NIXL.

The ``nixl`` data plane (:mod:`~kvpeer.transport.data.nixl`) drives its agent through
:class:`Nixl` alone, and only with its ``_agent_lock`` held (its invariant 1). What
this module adds to NIXL's own Python API: types at the boundary (``Handle`` is the one
``Any`` the plane sees), an agent made without NIXL's listen thread or telemetry, and a
progress thread that waits for UCX events instead of busy-polling (:func:`_new_agent`;
the plane's invariant 8).
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
from collections.abc import Sequence
from typing import Any, TypeAlias

__all__ = ["Handle", "Nixl"]

log = logging.getLogger("kvpeer.nixl")

# How long NIXL's progress thread may wait for UCX events between progress rounds. NIXL
# 1.5.1's Python API hard-codes 0, and its thread then busy-polls a whole core for as
# long as the agent lives. Measured here (two agents, 64 KiB writes): 0 -> 0.36 cores
# idle, 114 us median write; 100 ms -> 0.004 cores, 122 us (the thread wakes on events,
# so the wait bounds nothing a transfer needs).
_PROGRESS_WAIT_US = 100_000
_AGENT_CONFIG_LOCK = threading.Lock()

# nixl ships no type information (its facade package has no py.typed), so its modules
# are loaded with importlib and its objects are Any in Nixl and nowhere else.
Handle: TypeAlias = Any  # nixl_prepped_dlist_handle, nixl_xfer_handle, nixlRegDList


def _new_agent(api: Any, name: str, config: Any) -> Any:
    """``api.nixl_agent(name, config)`` whose progress thread waits ``_PROGRESS_WAIT_US``.

    The binding's agent config has the field (``pthrDelay``) but the Python constructor
    overwrites it with 0; while constructing, the binding's config class is swapped for
    a subclass that keeps our value. A NIXL without that field gets a default agent.
    """
    home = sys.modules[api.nixl_agent.__module__]
    binding = getattr(home, "nixlBind", None)
    base = getattr(binding, "nixlAgentConfig", None)
    if base is None or not hasattr(base, "pthrDelay"):
        log.warning("this NIXL has no progress-thread delay: its progress thread busy-polls")
        return api.nixl_agent(name, config)
    field = base.pthrDelay

    class _WaitingConfig(base):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self) -> int:
            return int(field.__get__(self))

        @pthrDelay.setter
        def pthrDelay(self, _: int) -> None:
            field.__set__(self, _PROGRESS_WAIT_US)

    with _AGENT_CONFIG_LOCK:
        binding.nixlAgentConfig = _WaitingConfig  # type: ignore[union-attr]
        try:
            return api.nixl_agent(name, config)
        finally:
            binding.nixlAgentConfig = base  # type: ignore[union-attr]


class Nixl:
    """The typed face of one ``nixl._api.nixl_agent``: the only code touching NIXL."""

    def __init__(self, name: str, backends: Sequence[str], num_threads: int) -> None:
        self._api: Any = importlib.import_module("nixl._api")
        self._np: Any = importlib.import_module("numpy")
        config = self._api.nixl_agent_config(
            enable_prog_thread=True,
            enable_listen_thread=False,  # metadata travels in our connect, not NIXL's
            capture_telemetry=False,
            num_threads=num_threads,
            backends=list(backends),
            sync_mode=self._api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        self._agent: Any = _new_agent(self._api, name, config)
        if not self._agent.backends:
            raise RuntimeError(f"none of the NIXL backends {list(backends)} could be created")

    def register(self, addr: int, nbytes: int) -> Handle:
        return self._agent.register_memory([(addr, nbytes, 0, "")], mem_type="DRAM")

    def deregister(self, registration: Handle) -> None:
        self._agent.deregister_memory(registration)

    def metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def load(self, metadata: bytes) -> str | bytes:
        name = self._agent.add_remote_agent(metadata)
        return name if isinstance(name, bytes) else str(name)  # 1.5.1 returns bytes

    def unload(self, name: str | bytes) -> None:
        self._agent.remove_remote_agent(name)

    def prep_rows(self, agent: str | bytes | None, addr: int, count: int, length: int) -> Handle:
        """Prepared list of ``count`` rows of ``length`` bytes from ``addr`` (None: ours)."""
        np = self._np
        rows = np.array([[addr, length, 0, length, count]], dtype=np.uint64)
        target = "NIXL_INIT_AGENT" if agent is None else agent
        return self._agent.prep_xfer_dlist(target, rows, mem_type="DRAM")

    def make_write(
        self, local: Handle, local_rows: Sequence[int], remote: Handle, remote_rows: Sequence[int]
    ) -> Handle:
        np = self._np
        return self._agent.make_prepped_xfer(
            "WRITE",
            local,
            np.asarray(local_rows, dtype=np.int32),
            remote,
            np.asarray(remote_rows, dtype=np.int32),
        )

    def post(self, xfer: Handle) -> str:
        return str(self._agent.transfer(xfer))

    def state(self, xfer: Handle) -> str:
        return str(self._agent.check_xfer_state(xfer))

    def release(self, handle: Handle) -> None:
        handle.release()

    def shutdown(self) -> None:
        self._agent = None  # the agent is destroyed with its last reference
