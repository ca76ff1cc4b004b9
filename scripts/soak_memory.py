"""Where ``kvpeer soak``'s driver memory goes, without real engines.

The soak's driver (its two routers on threads, its client threads, its bookkeeping) is
run here as it is in ``kvpeer soak``: :class:`kvpeer.lab.bench.soak_run.Soak` with its own
traffic threads, two :class:`BackgroundRouter` (pd and shared, the soak's configs) — but
in front of two fake engines on a thread of this process. Each fake answers streamed
completions with ``token_ids`` (a function of the prompt, so references match), keeps an
LRU "GPU" prefix cache of ``--gpu-blocks`` and a CPU tier of ``--cpu-blocks`` 32-token
blocks (the soak's engines: 1 GiB / 768 KiB = 1,365 and 256 MiB / 768 KiB = 341), and
publishes vLLM-shaped KV events (stores, removals on eviction) over ZMQ PUB with vLLM's
replay ROUTER (the last 10,000 batches), so the routers' subscribers, feeds and prefix
index run for real. The fakes' replay buffers live in this process too: their size is
printed, subtract it. ``cache_salt`` requests (the
soak's references) are published with ``extra_keys`` as vLLM does. Faults: engine ``b``
"restarts" (stops listening, comes back on the same port with a new event sequence and
new hashes) and engines "freeze" (answer nothing for ``--freeze-s``; over the routers'
5 s health timeout a frozen engine is taken for restarted, and its history replayed).

Memory: RSS less shared pages from /proc, ``tracemalloc`` snapshots (top growth by
traceback) and ``gc`` object counts by type, at each checkpoint of ``--checkpoints``
(requests served through the routers).

    PYTHONPATH=src:. python scripts/soak_memory.py --checkpoints 1000,3000,6000
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import ctypes
import gc
import hashlib
import json
import os
import sys
import threading
import time
import tracemalloc
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from aiohttp import web

from kvpeer.lab.bench.soak_run import MODEL_NAME, Soak
from kvpeer.lab.bench.soak_verdict import SoakSpec
from kvpeer.lab.engines.procs import process_info
from kvpeer.router.background import BackgroundRouter
from kvpeer.router.config import EngineEntry, RouterConfig
from kvpeer.router.feed import REPLAY_END_SEQ
from kvpeer.router.policy import EngineSpec, Mode, Role
from kvpeer.router.server_socket import bind

BLOCK = 32


class EventEngine:
    """A fake ``vllm serve``: streamed completions, an LRU prefix cache, KV events."""

    def __init__(self, name: str, gpu_blocks: int, cpu_blocks: int) -> None:
        self.name = name
        self.gpu_blocks = gpu_blocks
        self.cpu_blocks = cpu_blocks
        self.port = 0
        self.events_port = 0
        self.frozen_until = 0.0
        self.incarnation = 0
        self._runner: web.AppRunner | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self.replay_port = 0
        self.replays = 0
        self._new_state()

    def _new_state(self) -> None:
        self.incarnation += 1
        self.seq = 0
        self.buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=10_000)
        self.gpu: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self.cpu: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    async def start(self, ctx: zmq.asyncio.Context) -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.2)
        await self._runner.setup()
        sock = bind("127.0.0.1", self.port)
        self.port = sock.getsockname()[1]
        await web.SockSite(self._runner, sock).start()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        if self.events_port:
            self._pub.bind(f"tcp://127.0.0.1:{self.events_port}")
        else:
            self.events_port = self._pub.bind_to_random_port("tcp://127.0.0.1")
        # vLLM's replay ROUTER: every buffered batch from the asked seq on, then an end.
        self._replay = ctx.socket(zmq.ROUTER)
        self._replay.setsockopt(zmq.LINGER, 0)
        if self.replay_port:
            self._replay.bind(f"tcp://127.0.0.1:{self.replay_port}")
        else:
            self.replay_port = self._replay.bind_to_random_port("tcp://127.0.0.1")
        self._replay_task = asyncio.ensure_future(self._serve_replay(self._replay))

    async def _serve_replay(self, sock: zmq.asyncio.Socket) -> None:
        with contextlib.suppress(asyncio.CancelledError, zmq.ZMQError):
            while True:
                ident, _empty, start = await sock.recv_multipart()
                first = int.from_bytes(start, "big")
                self.replays += 1
                for seq, payload in list(self.buffer):
                    if seq >= first:
                        await sock.send_multipart([ident, b"", b"", seq.to_bytes(8, "big"),
                                                   payload])
                await sock.send_multipart([ident, b"", b"", REPLAY_END_SEQ.to_bytes(8, "big"),
                                           b""])

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._pub is not None:
            self._pub.close(0)
            self._pub = None
        if self._replay is not None:
            self._replay_task.cancel()
            self._replay.close(0)
            self._replay = None

    async def restart(self, ctx: zmq.asyncio.Context, down_s: float) -> None:
        await self.stop()
        await asyncio.sleep(down_s)
        self._new_state()
        await self.start(ctx)

    async def _health(self, request: web.Request) -> web.Response:
        await self._wait_thawed()
        return web.Response(status=200)

    async def _wait_thawed(self) -> None:
        while time.monotonic() < self.frozen_until:
            await asyncio.sleep(self.frozen_until - time.monotonic())

    def _hash(self, parent: bytes, tokens: list[int], salt: str) -> bytes:
        data = parent + repr((self.name, self.incarnation, salt, tokens)).encode()
        return hashlib.sha256(data).digest()

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        await self._wait_thawed()
        prompt: list[int] = body["prompt"]
        salt = body.get("cache_salt") or ""
        max_tokens = int(body.get("max_tokens") or 4)
        events, cached = self._cache(prompt, salt)
        if events:
            await self._publish(events)
        await asyncio.sleep(0.002)  # a little compute: requests overlap as in the soak
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        seed = sum(prompt) % 1000
        for i in range(max_tokens):
            chunk = {"id": "cmpl-x", "object": "text_completion", "model": MODEL_NAME,
                     "choices": [{"index": 0, "text": f"t{i}", "token_ids": [seed + i],
                                  "logprobs": None,
                                  "finish_reason": "length" if i == max_tokens - 1 else None}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"prompt_tokens": len(prompt), "completion_tokens": max_tokens,
                 "total_tokens": len(prompt) + max_tokens,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        final = {"id": "cmpl-x", "object": "text_completion", "model": MODEL_NAME,
                 "choices": [], "usage": usage}
        await response.write(f"data: {json.dumps(final)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def _cache(self, prompt: list[int], salt: str) -> tuple[list[dict[str, Any]], int]:
        """Store the prompt's full blocks (LRU, GPU then CPU): events and cached tokens."""
        events: list[dict[str, Any]] = []
        parent = b""
        cached = 0
        new: list[tuple[bytes, bytes | None, list[int]]] = []
        for start in range(0, len(prompt) - len(prompt) % BLOCK, BLOCK):
            tokens = prompt[start : start + BLOCK]
            h = self._hash(parent, tokens, salt)
            if h in self.gpu:
                self.gpu.move_to_end(h)
                if cached == start:
                    cached += BLOCK
            else:
                new.append((h, parent or None, tokens))
            parent = h
        extra = [[salt]] if salt else None
        for h, par, tokens in new:
            self.gpu[h] = None
            events.append({"type": "BlockStored", "block_hashes": [h], "parent_block_hash": par,
                           "token_ids": tokens, "block_size": BLOCK, "lora_id": None,
                           "medium": "GPU", "lora_name": None, "extra_keys": extra})
            if h not in self.cpu:
                self.cpu[h] = None
                events.append({**events[-1], "medium": "CPU"})
        gone = []
        while len(self.gpu) > self.gpu_blocks:
            gone.append(self.gpu.popitem(last=False)[0])
        if gone:
            events.append({"type": "BlockRemoved", "block_hashes": gone, "medium": "GPU"})
        gone = []
        while len(self.cpu) > self.cpu_blocks:
            gone.append(self.cpu.popitem(last=False)[0])
        if gone:
            events.append({"type": "BlockRemoved", "block_hashes": gone, "medium": "CPU"})
        return events, cached

    async def _publish(self, events: list[dict[str, Any]]) -> None:
        assert self._pub is not None
        payload = msgspec.msgpack.encode([time.time(), events, None])
        await self._pub.send_multipart([b"", self.seq.to_bytes(8, "big"), payload])
        self.buffer.append((self.seq, payload))
        self.seq += 1


class FakeProcess:
    def __init__(self) -> None:
        self.pid = os.getpid()


class FakeFleetEngine:
    def __init__(self, engine: EventEngine) -> None:
        self.engine = engine
        self.process = FakeProcess()

    @property
    def spec(self) -> Any:
        return argparse.Namespace(url=f"http://127.0.0.1:{self.engine.port}")

    def healthy(self) -> bool:
        return time.monotonic() >= self.engine.frozen_until and self.engine._runner is not None


class FakeFleet:
    def __init__(self, engines: dict[str, EventEngine]) -> None:
        self.engines = {name: FakeFleetEngine(e) for name, e in engines.items()}


def engine_spec(engine: EventEngine, role: Role = Role.BOTH) -> EngineSpec:
    return EngineSpec(name=engine.name, url=f"http://127.0.0.1:{engine.port}",
                      peer_host="127.0.0.1", peer_port=engine.port + 1, role=role,
                      kv_events=f"tcp://127.0.0.1:{engine.events_port}",
                      kv_events_replay=f"tcp://127.0.0.1:{engine.replay_port}")


def private_mib() -> float:
    info = process_info(os.getpid())
    assert info is not None
    return info.private_bytes / (1 << 20)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


_LIBC = ctypes.CDLL("libc.so.6")
_LIBC.mallinfo2.restype = _MallInfo2


def malloc_mib() -> tuple[float, float, float]:
    """glibc: bytes in use by malloc (all arenas), bytes free but held, mmapped chunks."""
    info = _LIBC.mallinfo2()
    return info.uordblks / 2**20, info.fordblks / 2**20, info.hblkhd / 2**20


def pymalloc_arenas() -> tuple[int, int]:
    """pymalloc's arenas (1 MiB mmaps each): allocated now, and the most at once."""
    import tempfile

    with tempfile.TemporaryFile() as out:
        saved = os.dup(2)
        os.dup2(out.fileno(), 2)
        try:
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        out.seek(0)
        text = out.read().decode()
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition("=")
        fields[key.strip().lstrip("# ")] = value.strip().replace(",", "")
    # Another thread may log to stderr meanwhile: a garbled report reads as -1.
    current = fields.get("arenas allocated current", "-1")
    peak = fields.get("arenas highwater mark", "-1")
    return (int(current), int(peak)) if (current + peak).lstrip("-").isdigit() else (-1, -1)


def type_counts() -> collections.Counter[str]:
    return collections.Counter(type(o).__name__ for o in gc.get_objects())


def served(soak: Soak) -> int:
    with soak.lock:
        return sum(n for by in soak.tally.counts.values() for n in by.values())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoints", default="1000,3000,6000")
    parser.add_argument("--warmup", type=int, default=300, help="requests before the baseline")
    parser.add_argument("--gpu-blocks", type=int, default=1365)
    parser.add_argument("--cpu-blocks", type=int, default=341)
    parser.add_argument("--fault-every", type=int, default=400, help="requests between faults")
    parser.add_argument("--down-s", type=float, default=2.5, help="how long b is down")
    parser.add_argument("--freeze-s", type=float, default=2.0,
                        help="how long a freeze lasts (over 5 s: the routers see a restart)")
    parser.add_argument("--no-tracemalloc", action="store_true")
    parser.add_argument("--frames", type=int, default=1)
    parser.add_argument("--trim", action="store_true", help="malloc_trim(0) at checkpoints")
    args = parser.parse_args()
    checkpoints = [int(c) for c in args.checkpoints.split(",")]

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True, name="fakes").start()

    def on_loop(coro: Any, timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    async def make_ctx() -> zmq.asyncio.Context:
        return zmq.asyncio.Context()

    ctx = on_loop(make_ctx())
    engines = {n: EventEngine(n, args.gpu_blocks, args.cpu_blocks) for n in ("a", "b")}
    for e in engines.values():
        on_loop(e.start(ctx))
    a, b = engines["a"], engines["b"]
    shared = RouterConfig(Mode.SHARED, (EngineEntry(engine_spec(a)), EngineEntry(engine_spec(b))),
                          listen_port=0, allow_pinning=True, health_timeout_s=5.0)
    pd = RouterConfig(Mode.PD, (EngineEntry(engine_spec(a, Role.PREFILL)),
                                EngineEntry(engine_spec(b, Role.DECODE))),
                      listen_port=0, health_timeout_s=5.0)
    log: list[str] = []
    soak = Soak(SoakSpec(minutes=1.0), FakeFleet(engines), log.append)
    import openai  # noqa: F401  (imported under tracemalloc it takes a minute)

    from kvpeer.lab.engines.openai_client import OpenAIClient

    OpenAIClient("http://127.0.0.1:1", MODEL_NAME).close()  # its lazy imports too
    if not args.no_tracemalloc:
        tracemalloc.start(args.frames)
    with BackgroundRouter(shared) as via_shared, BackgroundRouter(pd) as via_pd:
        soak.urls = {"shared": via_shared.url, "pd": via_pd.url}
        threads = soak.traffic(0)
        faults = 0
        next_fault = args.fault_every
        baseline = None
        started = time.monotonic()
        for mark in [args.warmup, *checkpoints]:
            while (n := served(soak)) < mark:
                if n >= next_fault:
                    faults += 1
                    next_fault += args.fault_every
                    if faults % 2:
                        asyncio.run_coroutine_threadsafe(b.restart(ctx, args.down_s), loop)
                    else:
                        frozen = engines["ab"[faults // 2 % 2]]
                        frozen.frozen_until = time.monotonic() + args.freeze_s
                time.sleep(0.05)
            soak.pause(threads)
            gc.collect()
            rss = private_mib()
            snap = None if args.no_tracemalloc else tracemalloc.take_snapshot()
            counts = type_counts()
            stats = [via_shared.call(lambda: via_shared.router.index.statistics(time.monotonic())),
                     via_pd.call(lambda: via_pd.router.index.statistics(time.monotonic()))]
            traced = tracemalloc.get_traced_memory()[0] / (1 << 20) if snap else 0.0
            used, held, mapped = malloc_mib()
            arenas, arena_peak = pymalloc_arenas()
            if args.trim:
                _LIBC.malloc_trim(0)
            print(f"requests {n:>6} faults {faults:>3} private RSS {rss:7.1f} MiB traced "
                  f"{traced:6.1f} MiB objects {sum(counts.values()):>8} "
                  f"({time.monotonic() - started:.0f} s); malloc in use {used:.1f} free "
                  f"{held:.1f} mmapped {mapped:.1f} MiB; pymalloc arenas {arenas} "
                  f"(peak {arena_peak})"
                  + (f"; after malloc_trim {private_mib():.1f}" if args.trim else ""),
                  flush=True)
            for st in stats:
                print("   index", st.blocks, st.speculative, st.hash_mappings, flush=True)
            pending = [via_shared.call(lambda: via_shared.router.policy.stats()["pending_plans"]),
                       via_pd.call(lambda: via_pd.router.policy.stats()["pending_plans"])]
            fake_mib = sum(len(p) for e in engines.values() for _, p in e.buffer) / 2**20
            print("   pending plans (shared, pd):", pending, "replays served (a, b):",
                  a.replays, b.replays, f"fakes' replay buffers {fake_mib:.1f} MiB", flush=True)
            if baseline is None:
                baseline = (snap, counts)
            else:
                if snap is not None and baseline[0] is not None:
                    top = snap.compare_to(baseline[0], "traceback")[:14]
                    for stat in top:
                        print(f"  {stat.size_diff / 1024:+9.1f} KiB {stat.count_diff:+7d} blocks",
                              flush=True)
                        for line in stat.traceback.format()[-12:]:
                            print("      " + line, flush=True)
                diff = counts - baseline[1]
                print("  objects grown:", diff.most_common(12), flush=True)
            threads = soak.traffic(1)
        soak.pause(threads)
    print("soak log tail:", log[-3:], file=sys.stderr)
    print("tally:", soak.tally.counts, "unexplained", soak.tally.unexplained[:3])


if __name__ == "__main__":
    main()
