"""Raw NIXL baseline: one agent writes rows straight into another process's agent.

No kvpeer involved: two NIXL agents (this process and a spawned child), each
with a page-aligned region registered as DRAM, the child's metadata loaded
here, and ``blocks`` rows of ``block_len`` bytes written with one prepared
WRITE — the same descriptors kvpeer's ``nixl`` plane uses, without any
control traffic. Returns GB/s (median of ``reps``), or None without nixl.
"""

from __future__ import annotations

import ctypes
import importlib
import mmap
import multiprocessing
import statistics
import time
import uuid
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["raw_nixl_gbps"]


def _agent(api: Any, name: str) -> Any:
    config = api.nixl_agent_config(
        enable_prog_thread=True, enable_listen_thread=False, capture_telemetry=False,
        num_threads=4, backends=["UCX"],
    )  # fmt: skip
    return api.nixl_agent(name, config)


def _region(nbytes: int) -> tuple[mmap.mmap, int]:
    region = mmap.mmap(-1, nbytes)
    view = memoryview(region)
    view[::4096] = bytes(len(range(0, nbytes, 4096)))
    address = ctypes.addressof(ctypes.c_char.from_buffer(view))
    view.release()
    return region, address


def _target(conn: Connection, nbytes: int) -> None:
    api = importlib.import_module("nixl._api")
    agent = _agent(api, f"raw-target-{uuid.uuid4()}")
    region, address = _region(nbytes)
    registration = agent.register_memory([(address, nbytes, 0, "")], mem_type="DRAM")
    conn.send((bytes(agent.get_agent_metadata()), address))
    conn.recv()  # done
    agent.deregister_memory(registration)
    del agent
    region.close()


def raw_nixl_gbps(block_len: int, blocks: int, reps: int) -> float | None:
    try:
        api = importlib.import_module("nixl._api")
        np = importlib.import_module("numpy")
    except ImportError:
        return None
    nbytes = block_len * blocks
    context = multiprocessing.get_context("spawn")
    parent_end, child_end = context.Pipe()
    child = context.Process(target=_target, args=(child_end, nbytes), daemon=True)
    child.start()
    try:
        metadata, remote_address = parent_end.recv()
        agent = _agent(api, f"raw-source-{uuid.uuid4()}")
        region, address = _region(nbytes)
        registration = agent.register_memory([(address, nbytes, 0, "")], mem_type="DRAM")
        remote = agent.add_remote_agent(metadata)
        rows = np.array([[address, block_len, 0, block_len, blocks]], dtype=np.uint64)
        remote_rows = np.array([[remote_address, block_len, 0, block_len, blocks]], dtype=np.uint64)
        local_list = agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows, mem_type="DRAM")
        remote_list = agent.prep_xfer_dlist(remote, remote_rows, mem_type="DRAM")
        indexes = np.arange(blocks, dtype=np.int32)
        samples = []
        for _ in range(reps + 1):  # the first write warms the UCX endpoint up
            handle = agent.make_prepped_xfer("WRITE", local_list, indexes, remote_list, indexes)
            start = time.perf_counter()
            state = agent.transfer(handle)
            while state not in ("DONE", "ERR"):
                state = agent.check_xfer_state(handle)
            samples.append(time.perf_counter() - start)
            handle.release()
            if state == "ERR":
                raise RuntimeError("raw NIXL write failed")
        local_list.release()
        remote_list.release()
        agent.remove_remote_agent(remote)
        agent.deregister_memory(registration)
        del agent
        region.close()
        return nbytes / statistics.median(samples[1:]) / 1e9
    finally:
        parent_end.send("done")
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
