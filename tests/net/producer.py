"""A PD producer program: ``python -m tests.net.producer producer ...`` (from the
repository's root) prints its peer id, stores synthetic blocks for one or more
``remote_decoder`` requests (in batches, so a transfer can be made to last), finishes
them and keeps serving until its stdin closes or it gets SIGTERM. It imports only
kvpeer, the standard library and ``tests.net.common``."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from kvpeer.host import BlockPool, TieringHost
from kvpeer.node.build import open_node
from kvpeer.node.synthetic import synthetic_block
from kvpeer.transport.data.base import PrimaryRegion
from kvpeer.types import RequestContext
from tests.net.common import BLOCK_LEN, keys_of, tier_config

__all__ = [
    "main",
]

def _batches(indexes: list[int], batches: int) -> list[list[int]]:
    size = max(1, -(-len(indexes) // max(1, batches)))
    return [indexes[i : i + size] for i in range(0, len(indexes), size)]


def _producer_main(args: argparse.Namespace) -> int:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())

    def watch_stdin() -> None:
        sys.stdin.buffer.read()
        stop.set()

    threading.Thread(target=watch_stdin, name="stdin-watch", daemon=True).start()
    mapping: dict[str, object] = {}
    if args.config:
        mapping.update(json.loads(Path(args.config).read_text()))
    config = tier_config(args.plane.split(","), args.host, args.port, **mapping)
    pool = BlockPool(max(args.count, 1), args.block_len, shm_path=args.shm_path or None)
    try:
        region = PrimaryRegion(pool.view, pool.num_blocks, pool.block_len, pool.shm_path)
        node = open_node(config, region)
        host = TieringHost(pool, [node])
        print(f"peer {node.tier.peer_id}", flush=True)

        def step_for(seconds: float) -> None:
            deadline = time.monotonic() + seconds
            while not stop.is_set():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                node.wait_for_work(min(0.02, remaining))
                host.step()

        contexts = [
            RequestContext(
                f"prefill-{kv_request_id}", {"remote_decoder": {"kv_request_id": kv_request_id}}
            )
            for kv_request_id in args.kv_request_id
        ]
        for context in contexts:
            host.new_request(context)
        host.step()
        step_for(args.delay)
        for number, batch in enumerate(_batches(list(range(args.count)), args.batches)):
            if number:
                step_for(args.interval)
            if stop.is_set():
                break
            blocks = [synthetic_block(i, args.block_len) for i in batch]
            for context in contexts:  # the second request finds them resident: warm producer
                host.store(context, keys_of(batch), blocks)
            host.step()
            print(f"stored batch {number}", flush=True)
        for context in contexts:
            host.finish_request(context)
        host.step()
        print("stored all", flush=True)
        while not stop.is_set():
            node.wait_for_work(0.05)
            host.step()
        host.shutdown()
        print("stopped", flush=True)
    finally:
        pool.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="producer")
    commands = parser.add_subparsers(dest="command", required=True)
    producer = commands.add_parser("producer", help="a PD producer of synthetic blocks")
    producer.add_argument("--kv-request-id", action="append", required=True)
    producer.add_argument("--count", type=int, required=True)
    producer.add_argument("--plane", default="tcp")
    producer.add_argument("--block-len", type=int, default=BLOCK_LEN)
    producer.add_argument("--batches", type=int, default=1)
    producer.add_argument("--interval", type=float, default=0.0)
    producer.add_argument("--delay", type=float, default=0.0)
    producer.add_argument("--host", default="127.0.0.1")
    producer.add_argument("--port", type=int, default=0)
    producer.add_argument("--shm-path", default="")
    producer.add_argument("--config")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stdout,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    return _producer_main(args)


if __name__ == "__main__":
    sys.exit(main())
