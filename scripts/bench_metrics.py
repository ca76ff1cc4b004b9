"""Hot-path cost of metrics: one-block pull round trips (lookup + load, shm, two nodes
in this process), median of N, with no scraper and with a Prometheus scrape every
100 ms; and what one scrape costs. Run with PYTHONPATH of the tree to measure
(a tree without kvpeer.metrics measures the no-counters baseline only).

    PYTHONPATH=src:. python scripts/bench_metrics.py [N]
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import threading
import time

from tests.net.procs import LocalNode, ServingNode, keys_of


def pulls(consumer: LocalNode, peer: str, n: int) -> float:
    times = []
    for i in range(n):
        key = keys_of([i % 64])
        slot = [i % 64]
        start = time.perf_counter()
        result = consumer.pull(peer, key, slot)
        times.append(time.perf_counter() - start)
        assert result.loaded
    return statistics.median(times) * 1e6


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    has_metrics = importlib.util.find_spec("kvpeer.metrics") is not None
    with ServingNode("shm") as producer, LocalNode("shm") as consumer:
        pulls(consumer, producer.peer_id, 50)  # warm-up
        rows = {"off_us": [], "scraped_us": []}
        scrape_us: list[float] = []
        for _ in range(3):
            rows["off_us"].append(pulls(consumer, producer.peer_id, n))
            if not has_metrics:
                continue
            from prometheus_client import generate_latest

            from kvpeer.metrics.prom import registry_for

            registries = [registry_for(consumer.node), registry_for(producer.node)]
            stop = threading.Event()

            def scrape() -> None:
                while not stop.wait(0.1):
                    for registry in registries:
                        t0 = time.perf_counter()
                        generate_latest(registry)
                        scrape_us.append((time.perf_counter() - t0) * 1e6)

            scraper = threading.Thread(target=scrape, name="scraper", daemon=True)
            scraper.start()
            rows["scraped_us"].append(pulls(consumer, producer.peer_id, n))
            stop.set()
            scraper.join()
    print({k: [round(v, 1) for v in vs] for k, vs in rows.items()})
    if scrape_us:
        print(f"one scrape: median {statistics.median(scrape_us):.0f} us over {len(scrape_us)}")


if __name__ == "__main__":
    main()
