"""Former home of the real-network test helpers, now split by role: ``common``
(constants, waits, ports, keys, configs), ``localnode``, ``servingnode``, ``rawpeer``,
``processes`` (node subprocesses) and ``producer`` (the PD producer program).

Kept only for ``tests/metrics/test_standalone.py``, which imports these names from
here; new code imports from the modules above.
"""

from tests.net.common import BLOCK_LEN, free_port, keys_of, wait_until
from tests.net.localnode import LocalNode
from tests.net.processes import NodeProcess, start_serve

__all__ = [
    "BLOCK_LEN",
    "LocalNode",
    "NodeProcess",
    "free_port",
    "keys_of",
    "start_serve",
    "wait_until",
]
