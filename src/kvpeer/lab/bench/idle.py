"""``kvpeer bench idle``: what an idle vLLM engine costs, and how fast it answers a peer.

vLLM's own ``p2p`` tier reports pending work forever, so an idle engine that has it
keeps stepping. kvpeer's tier reports work only while it has some and wakes the idle
engine loop when a peer's lookup needs a serve window. Both are measured in one run,
side by side, with engines in vLLM's default multiprocessing mode (the tiny random
Llama of :mod:`kvpeer.lab.engines.model`), all started together:

- ``none``: the offloading connector with no secondary tier (the baseline),
- ``vllm-p2p``: vLLM's built-in ``p2p`` tier,
- ``kvpeer-tcp``: kvpeer's tier with ``data_transports: ["tcp"]``,
- ``kvpeer-nixl``: kvpeer's tier with ``["nixl"]`` (full run only; a NIXL progress
  thread that busy-polls shows here: a cost of that plane, not of the tier).

1. **Idle CPU.** Each engine computes a prompt (its warm-up request) and waits; once
   every engine got there, each waits ``settle_s`` and then ``idle_s``, measuring the
   CPU seconds of its processes (main, ``VLLM::EngineCore``, ``VLLM::Worker``) over
   that wall time: cores used while idle.
2. **Lookup -> answer of an idle producer.** A kvpeer node in this process (no
   engine; ``nixl`` toward vLLM's tier, the only plane it speaks, ``tcp`` toward
   kvpeer's) asks the ``vllm-p2p`` producer, then the ``kvpeer-tcp`` one, about the
   blocks of the prompt it computed (keys: vLLM's block hashes, computed here with
   vLLM's own functions), ``lookups`` times, ``spacing_s`` apart so the producer is
   idle again before each. The time from sending the lookup to its answer is
   reported (median, max), after one unmeasured lookup that opens the session. Each
   producer is asked alone: the other engines have exited by then (a spinning
   vLLM-p2p engine would otherwise slow the kvpeer producer's wake-up).

The machine is shared and noisy: a spinning engine gets less than a core when others
compete for it, so compare the rows of one run, not runs.
"""

from __future__ import annotations

import contextlib
import random
import re
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvpeer.lab.engines.launcher import EngineLauncher, EngineOutcome

__all__ = ["IdleSpec", "LookupTiming", "idle_row", "lookup_row", "render", "run", "summarize"]

HOST = "127.0.0.1"
BLOCK_TOKENS = 32  # the runner's vLLM block size
PROMPT_TOKENS = 256
CPU_BYTES = 64 * 1024 * 1024
VOCAB = (3, 512)  # token ids of the tiny model, past its special tokens
LOOKUP_TIMEOUT_S = 10.0  # an unanswered lookup counts as a timeout
SIGNAL_TIMEOUT_S = 900.0  # backstop only: a failed engine stops the run at once
POLL_S = 0.0005  # how often the consumer looks for the answer
ENGINE_CORE = "VLLM::EngineCor"  # the process title as Linux keeps it (15 characters)
SPINNING_CORES = 0.2  # an idle row above this keeps a thread busy
BASELINE, VLLM_P2P, KVPEER_TCP, KVPEER_NIXL = "none", "vllm-p2p", "kvpeer-tcp", "kvpeer-nixl"
LOOKUP_TARGETS = (VLLM_P2P, KVPEER_TCP)  # the order they are asked in
CONSUMER_PLANE = {KVPEER_TCP: "tcp", VLLM_P2P: "nixl"}
# logged by KVPeerTier: "kvpeer tier NAME ready: N blocks x B bytes, data planes ..."
READY_LINE = re.compile(r"kvpeer tier \S+ ready: \d+ blocks x (\d+) bytes")

Progress = Callable[[str], None]


@dataclass(frozen=True)
class IdleSpec:
    """What one run measures."""

    name: str
    engines: tuple[str, ...]
    idle_s: float
    settle_s: float
    lookups: int
    spacing_s: float

    @classmethod
    def full(cls, idle_s: float = 10.0) -> IdleSpec:
        return cls("full", (BASELINE, VLLM_P2P, KVPEER_TCP, KVPEER_NIXL), idle_s, 3.0, 15, 2.0)

    @classmethod
    def quick(cls, idle_s: float = 4.0) -> IdleSpec:
        return cls("quick", (VLLM_P2P, KVPEER_TCP), idle_s, 2.0, 5, 1.5)


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(*VOCAB) for _ in range(length)]


PROMPT = prompt(21, PROMPT_TOKENS)


def block_keys(tokens: Sequence[int]) -> tuple[list[bytes], str]:
    """The offload keys of ``tokens``' full blocks as a vLLM engine of the runner
    computes them (sha256 block hashes chained from vLLM's seeded ``NONE_HASH``,
    group 0, one block per key), and that hash seed."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.kv_offload.base import make_offload_key

    hash_fn = get_hash_fn_by_name("sha256")  # vLLM's default prefix_caching_hash_algo
    kv_cache_utils.init_none_hash(hash_fn)
    keys: list[bytes] = []
    parent: Any = None
    for start in range(0, len(tokens) - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        parent = kv_cache_utils.hash_block_tokens(
            hash_fn, parent, tokens[start : start + BLOCK_TOKENS]
        )
        keys.append(bytes(make_offload_key(parent, 0)))
    return keys, kv_cache_utils.get_none_hash_seed()


# -- engines -----------------------------------------------------------------------------


def _tiers(name: str, port: int) -> list[dict[str, Any]]:
    from kvpeer.lab.engines import scenario as sc

    if name == BASELINE:
        return []
    if name == VLLM_P2P:
        return [sc.vllm_p2p_tier(port, host=HOST)]
    plane = {KVPEER_TCP: "tcp", KVPEER_NIXL: "nixl"}[name]
    return [sc.kvpeer_tier(port, plane, host=HOST)]


def _scenario(
    launcher: EngineLauncher, name: str, port: int, spec: IdleSpec, signals: Path
) -> dict[str, Any]:
    from kvpeer.lab.engines import scenario as sc

    def until(label: str, file: Path) -> dict[str, Any]:
        return sc.hold_until(label, file, SIGNAL_TIMEOUT_S)

    steps = [
        sc.generate("prompt", PROMPT, max_tokens=8),
        sc.signal(signals / f"ready-{name}"),
        until("waiting", signals / "go"),
        {"op": "hold", "label": "settling", "seconds": spec.settle_s},
        {"op": "hold", "label": "idle", "seconds": spec.idle_s},
        sc.signal(signals / f"idle-{name}"),
    ]
    if name in LOOKUP_TARGETS:  # its turn to be asked, then the lookups
        steps += [
            until("queued", signals / f"turn-{name}"),
            until("serving", signals / f"release-{name}"),
        ]
    return sc.engine_scenario(
        launcher.model,
        launcher.new_engine_id(f"kvpeer-idle-{name}"),
        _tiers(name, port),
        steps,
        cpu_bytes=CPU_BYTES,
    )


def _wait_for(path: Path, engines: Future[list[EngineOutcome]], what: str) -> None:
    """Wait until ``path`` exists; fail at once if the engines' run ended."""
    deadline = time.monotonic() + SIGNAL_TIMEOUT_S
    while not path.exists():
        if engines.done():
            engines.result()  # raises the engine failure with its log tails
            raise RuntimeError(f"the engines exited before {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: {path} did not appear in {SIGNAL_TIMEOUT_S:.0f} s")
        time.sleep(0.05)


def _wait_for_text(path: Path, text: str | re.Pattern[str],
                   engines: Future[list[EngineOutcome]], what: str) -> str:
    """The first whole line of ``path`` containing ``text`` (or matching it), once it is
    there: a line still being written does not count (CI once read the ready line's
    first half and failed to parse it)."""
    deadline = time.monotonic() + SIGNAL_TIMEOUT_S
    while True:
        with contextlib.suppress(OSError):
            for line in path.read_text(encoding="utf-8", errors="replace").splitlines(True):
                whole = line.endswith("\n")
                found = text.search(line) if isinstance(text, re.Pattern) else text in line
                if whole and found:
                    return line.rstrip("\n")
        if engines.done():
            engines.result()
            raise RuntimeError(f"the engines exited before {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: no {text!r} in {path}")
        time.sleep(0.05)


def _block_len(ready_line: str) -> int:
    """``B`` of KVPeerTier's "... ready: N blocks x B bytes, ..." log line."""
    found = READY_LINE.search(ready_line)
    if found is None:
        raise ValueError(f"not the kvpeer tier's ready line: {ready_line!r}")
    return int(found.group(1))


# -- the consumer ------------------------------------------------------------------------


@dataclass(frozen=True)
class LookupTiming:
    seconds: float | None  # None: no answer within LOOKUP_TIMEOUT_S
    hits: int


@contextlib.contextmanager
def consumer(plane: str, block_len: int, hash_seed: str, blocks: int) -> Iterator[Any]:
    """A kvpeer node with no engine, on ``plane``, its region sized like the engines'."""
    from kvpeer.config import TierConfig
    from kvpeer.host import BlockPool
    from kvpeer.node.build import open_node
    from kvpeer.transport.data.base import PrimaryRegion

    pool = BlockPool(blocks, block_len)
    config = TierConfig.from_dict(
        {
            "host": HOST,
            "port": 0,
            "data_transports": [plane],
            "hash_seed": hash_seed,
            "nixl_peers": ["127.0.0.0/8"],  # the engines it asks run on this machine
            # Longer than ours: an unanswered lookup is timed out here, not made a MISS.
            "lookup_timeout_s": 2 * LOOKUP_TIMEOUT_S,
            "handshake_timeout_s": LOOKUP_TIMEOUT_S,
        }
    )
    node = open_node(config, PrimaryRegion(pool.view, blocks, block_len, None))
    try:
        yield node
    finally:
        node.shutdown()
        pool.close()


def lookup_once(node: Any, port: int, keys: Sequence[bytes]) -> LookupTiming:
    """Ask the producer at ``port`` about ``keys`` as a new symmetric request; the
    time from sending the lookup (``on_schedule_end``) until every key is answered."""
    from kvpeer.types import LookupResult, RequestContext

    kv_request_id = f"idle-{uuid.uuid4().hex[:12]}"
    source = {"kv_request_id": kv_request_id, "remote_host": HOST, "remote_port": port}
    context = RequestContext(kv_request_id, {"remote_kv_source": source})
    node.on_new_request(context)
    try:
        answers = [node.lookup(key, context) for key in keys]
        started = time.perf_counter()
        node.on_schedule_end()
        while LookupResult.RETRY in answers:
            if time.perf_counter() - started > LOOKUP_TIMEOUT_S:
                return LookupTiming(None, 0)
            time.sleep(POLL_S)
            answers = [node.lookup(key, context) for key in keys]
            node.on_schedule_end()
        seconds = time.perf_counter() - started
    finally:
        node.on_request_finished(context)  # the producer unpins what it held for us
    hits = 0
    for answer in answers:
        if answer is not LookupResult.HIT:
            break
        hits += 1
    return LookupTiming(seconds, hits)


def measure_lookups(
    node: Any, port: int, keys: Sequence[bytes], spec: IdleSpec, progress: Progress, name: str
) -> dict[str, Any]:
    """One unmeasured lookup (it opens the session), then ``spec.lookups`` timed ones."""
    first = lookup_once(node, port, keys)
    timings: list[LookupTiming] = []
    for index in range(spec.lookups):
        time.sleep(spec.spacing_s)  # the producer finishes serving and goes idle again
        timings.append(lookup_once(node, port, keys))
        progress(f"lookups to idle {name}: {index + 1}/{spec.lookups}")
    return lookup_row(name, len(keys), first, timings, spec.spacing_s)


def lookup_row(
    name: str, keys: int, first: LookupTiming, timings: Sequence[LookupTiming], spacing_s: float
) -> dict[str, Any]:
    """The JSON row of one producer's timed lookups."""
    answered = [t.seconds for t in timings if t.seconds is not None]
    return {
        "producer": name,
        "consumer_plane": CONSUMER_PLANE[name],
        "keys": keys,
        "lookups": len(timings),
        "answered": len(answered),
        "timeouts": len(timings) - len(answered),
        "hits": [t.hits for t in timings],
        "latencies_ms": [None if t.seconds is None else round(t.seconds * 1e3, 3) for t in timings],
        "median_ms": round(statistics.median(answered) * 1e3, 3) if answered else None,
        "max_ms": round(max(answered) * 1e3, 3) if answered else None,
        "first_ms": None if first.seconds is None else round(first.seconds * 1e3, 3),
        "spacing_s": spacing_s,
    }


# -- the run -----------------------------------------------------------------------------


def idle_row(name: str, outcome: EngineOutcome) -> dict[str, Any]:
    """The JSON row of one engine's idle hold: cores in all and by role."""
    hold = outcome.holds["idle"]
    parts = {"main": 0.0, "engine_core": 0.0, "worker": 0.0}
    for process, seconds in hold.cpu_seconds_by_process.items():
        if process == ENGINE_CORE:
            parts["engine_core"] += seconds
        elif process.startswith("VLLM::"):
            parts["worker"] += seconds
        else:
            parts["main"] += seconds
    row: dict[str, Any] = {
        "engine": name,
        "seconds": round(hold.seconds, 3),
        "cpu_seconds": round(hold.cpu_seconds, 3),
        "cores": round(hold.cpu_seconds / hold.seconds, 4),
        "cores_by_role": {k: round(v / hold.seconds, 4) for k, v in parts.items()},
        "cpu_seconds_by_process": {
            k: round(v, 3) for k, v in sorted(hold.cpu_seconds_by_process.items())
        },
    }
    # vLLM's worker busy-loops for a second after each step it runs, so each serve
    # window kvpeer wakes the engine for costs up to a core-second in the worker.
    serving = outcome.holds.get("serving")
    if serving is not None:
        row["serving_cores"] = round(serving.cpu_seconds / serving.seconds, 4)
    return row


def _ratio(value: float | None, base: float | None) -> float | None:
    if value is None or not base:
        return None
    return round(value / base, 4)


def compare(idle: list[dict[str, Any]], lookups: list[dict[str, Any]]) -> dict[str, Any]:
    """Ratios and differences of kvpeer's rows against the baselines'."""
    cores = {row["engine"]: row["cores"] for row in idle}
    core_of = {row["engine"]: row["cores_by_role"]["engine_core"] for row in idle}
    medians = {row["producer"]: row["median_ms"] for row in lookups}
    base, p2p = cores.get(BASELINE), cores.get(VLLM_P2P)
    kvpeer = [name for name in (KVPEER_TCP, KVPEER_NIXL) if name in cores]
    return {
        "idle_cores_over_baseline": {
            name: round(cores[name] - base, 4) for name in cores if base is not None
        },
        "idle_cores_vs_vllm_p2p": {name: _ratio(cores[name], p2p) for name in kvpeer},
        "idle_engine_core_vs_vllm_p2p": {
            name: _ratio(core_of[name], core_of.get(VLLM_P2P)) for name in kvpeer
        },
        "lookup_median_vs_vllm_p2p": {
            name: _ratio(medians.get(name), medians.get(VLLM_P2P))
            for name in medians
            if name != VLLM_P2P
        },
    }


def run(
    spec: IdleSpec,
    *,
    model_dir: Path,
    log_dir: Path | None = None,
    progress: Progress = lambda _: None,
) -> dict[str, Any]:
    """Start the engines together, measure, stop them; the result as one dict."""
    from kvpeer.lab.engines.launcher import EngineLauncher, free_port
    from kvpeer.lab.engines.model import ensure_tiny_llama
    from kvpeer.lab.engines.runner import RESULT_MARKER

    started = time.monotonic()
    model = ensure_tiny_llama(model_dir)
    logs = log_dir or Path(tempfile.mkdtemp(prefix="kvpeer-bench-idle-"))
    logs.mkdir(parents=True, exist_ok=True)
    signals = Path(tempfile.mkdtemp(prefix="kvpeer-bench-idle-signals-"))
    launcher = EngineLauncher(model, logs, jobs=1)
    ok = False
    try:
        ports = {name: free_port() for name in spec.engines}
        scenarios = [_scenario(launcher, n, ports[n], spec, signals) for n in spec.engines]
        log_of = {
            n: logs / f"{s['engine_id']}.log" for n, s in zip(spec.engines, scenarios, strict=True)
        }
        progress(f"starting {len(spec.engines)} engines together: {', '.join(spec.engines)}")
        engines = launcher.submit(
            lambda: launcher.run_together(
                [(scenario, True) for scenario in scenarios], progress, spec.engines
            )
        )
        keys, hash_seed = block_keys(PROMPT)
        block_len = _block_len(
            _wait_for_text(log_of[KVPEER_TCP], READY_LINE, engines, "the kvpeer tier started")
        )
        for name in spec.engines:
            _wait_for(signals / f"ready-{name}", engines, f"{name} computed the prompt")
        progress(f"every engine computed the prompt; idle for {spec.settle_s + spec.idle_s:.0f} s")
        (signals / "go").write_text("")
        lookups: list[dict[str, Any]] = []
        for name in spec.engines:
            _wait_for(signals / f"idle-{name}", engines, f"{name} idled")
        for name in spec.engines:  # the others exit: let them finish before timing
            if name not in LOOKUP_TARGETS:
                _wait_for_text(log_of[name], RESULT_MARKER, engines, f"{name} exited")
        for name in LOOKUP_TARGETS:
            plane = CONSUMER_PLANE[name]
            progress(f"lookups to idle {name} from a kvpeer node on {plane}")
            (signals / f"turn-{name}").write_text("")
            with consumer(plane, block_len, hash_seed, len(keys)) as node:
                lookups.append(measure_lookups(node, ports[name], keys, spec, progress, name))
            (signals / f"release-{name}").write_text("")
            _wait_for_text(log_of[name], RESULT_MARKER, engines, f"{name} exited")
        outcomes = dict(zip(spec.engines, engines.result(), strict=True))
        ok = True
    finally:
        for name in spec.engines:  # whatever happened, let the engines go
            for step in ("turn", "release"):
                with contextlib.suppress(OSError):
                    (signals / f"{step}-{name}").write_text("")
        (signals / "go").touch()
        launcher.close()
        shutil.rmtree(signals, ignore_errors=True)
        if ok and log_dir is None:
            shutil.rmtree(logs, ignore_errors=True)
    result = summarize(spec, [idle_row(name, outcomes[name]) for name in spec.engines], lookups)
    result.update(
        model=str(model), block_len=block_len, seconds=round(time.monotonic() - started, 1)
    )
    return result


def summarize(
    spec: IdleSpec, idle: list[dict[str, Any]], lookups: list[dict[str, Any]]
) -> dict[str, Any]:
    """The result object (``run`` adds the model, block size and wall seconds)."""
    return {
        "spec": spec.name,
        "idle_s": spec.idle_s,
        "settle_s": spec.settle_s,
        "prompt_tokens": PROMPT_TOKENS,
        "idle": idle,
        "lookups": lookups,
        "compare": compare(idle, lookups),
    }


# -- output ------------------------------------------------------------------------------


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def render(result: dict[str, Any]) -> str:
    compare = result["compare"]
    over = compare["idle_cores_over_baseline"]
    vs_p2p = compare["idle_cores_vs_vllm_p2p"]
    lines = [
        f"idle vLLM engines (multiprocessing mode), CPU cores used over {result['idle_s']:g} s "
        f"after a request and {result['settle_s']:g} s settling",
        f"  {'engine':12} {'total':>6} {'main':>6} {'EngineCore':>10} {'worker':>6}  "
        f"{'vs none':>8} {'vs vllm-p2p':>11}",
    ]
    for row in result["idle"]:
        roles = row["cores_by_role"]
        name = row["engine"]
        extra = f"{over[name]:+8.2f}" if name in over and name != BASELINE else f"{'':8}"
        ratio = f"{vs_p2p[name]:10.3f}x" if vs_p2p.get(name) is not None else ""
        lines.append(
            f"  {name:12} {row['cores']:6.3f} {roles['main']:6.3f} {roles['engine_core']:10.3f} "
            f"{roles['worker']:6.3f}  {extra} {ratio:>11}"
        )
    nixl = next((row for row in result["idle"] if row["engine"] == KVPEER_NIXL), None)
    if nixl is not None and nixl["cores"] > SPINNING_CORES:
        lines.append("  (kvpeer-nixl: NIXL's progress thread busy-polls; the tier itself sleeps)")
    if result["lookups"]:
        lookup = result["lookups"][0]
        lines.append(
            f"lookup -> answer of an idle producer ({lookup['keys']} keys it holds, "
            f"{lookup['lookups']} lookups {lookup['spacing_s']:g} s apart; consumer: a kvpeer node)"
        )
        lines.append(
            f"  {'producer':12} {'plane':>5} {'median ms':>9} {'max ms':>8} {'answered':>9} "
            f"{'hits':>5} {'first ms':>8} {'serving cores':>13} {'vs vllm-p2p':>11}"
        )
        serving = {row["engine"]: row.get("serving_cores") for row in result["idle"]}
        ratios = compare["lookup_median_vs_vllm_p2p"]
        for row in result["lookups"]:
            name = row["producer"]
            hits = f"{min(row['hits'], default=0)}/{row['keys']}"
            answered = f"{row['answered']}/{row['lookups']}"
            ratio = f"{ratios[name]:10.3f}x" if ratios.get(name) is not None else ""
            lines.append(
                f"  {name:12} {row['consumer_plane']:>5} {_num(row['median_ms'], '9.2f'):>9} "
                f"{_num(row['max_ms'], '8.2f'):>8} "
                f"{answered:>9} {hits:>5} "
                f"{_num(row['first_ms'], '8.1f'):>8} {_num(serving.get(name), '13.3f'):>13} "
                f"{ratio:>11}"
            )
        lines.append(
            "  (first ms: the lookup that opens the session; serving cores: the producer's"
        )
        lines.append("   CPU while asked, with vLLM's worker busy-looping 1 s after every step)")
    took = f"{result['seconds']:.0f} s; " if "seconds" in result else ""
    lines.append(f"({took}shared machine: compare the rows of one run, not runs)")
    return "\n".join(lines)
