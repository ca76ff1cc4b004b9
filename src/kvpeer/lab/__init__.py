"""The lab: tools that drive kvpeer from outside, never part of the product.

Benchmarks (:mod:`kvpeer.lab.bench`), the fuzzer (:mod:`kvpeer.lab.fuzz`), the
deterministic simulation (:mod:`kvpeer.lab.sim`), the harness that launches engines
(:mod:`kvpeer.lab.engines`), the engine-less puller (:mod:`kvpeer.lab.pull`) and the
demo's run (:mod:`kvpeer.lab.demo_run`). The lab may import any product layer; no product
module imports the lab (``tests/test_layering.py``); the ``kvpeer`` commands of lab tools
and ``python -m kvpeer.sim`` are the only ways in.
"""
