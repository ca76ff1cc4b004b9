"""Drive ``kvpeer bench faults`` in real engines: one producer/consumer ``vllm serve`` pair
per tier, faults injected into the producer's process group.

Order per tier (each step keeps what the next needs, so one pair serves every fault and
the producer is restarted only after a fault killed it):

1. ``healthy`` (also proves pulling works), 2. ``frozen-in-session``,
3. per run: ``killed-during-lookup``, ``restarted`` (its prefill leg ran on the killed
   process; the request meets the new one), ``killed-mid-transfer``, restart,
4. ``killed-before-contact`` then at once ``backed-off`` (the producer stays dead; each
   run waits out the consumer's back-off first, so every run dials the dead port),
5. ``frozen-first-contact``: the producer is restarted, so the consumer has never
   talked to this process; each run waits out the back-off the last one left. Last:
   after it vLLM's p2p pair never pulled again.

Before each fault but the first-contact ones the consumer pulls until a pull works again
(back-off over, session up): a fault is measured against a working pair. For
``killed-during-lookup`` the producer is stopped (SIGSTOP) before the request is sent
and killed 20-60 ms after, so the request is certainly waiting on it; for
``killed-mid-transfer`` the kill comes 10-50 ms after the send, and each run records
what the consumer's kvpeer counters say it reached (a real engine cannot be stopped at
an exact protocol step: on a small model the pull may finish first).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvpeer.lab.bench.faults import FaultsSpec, Renewal, Sample, render, to_json
from kvpeer.lab.engines.serving import (
    EngineFailed,
    ServeFleet,
    ServeSpec,
    TierKind,
    kvpeer_samples,
)

__all__ = ["Pair", "Workload", "main", "measure_tier", "run"]

MODEL = "kvpeer-demo"
HOST = "127.0.0.1"
REQUEST_TIMEOUT_S = 90.0
# kvpeer's counters reach /metrics with the request's last step; kept well under the first
# 1 s back-off, which backed-off must measure right after killed-before-contact.
COUNTER_SETTLE_S = 0.3
RECOVER_TIMEOUT_S = 60.0
RESTART_TIMEOUT_S = 180.0  # engines start in ~60 s here
GONE_TIMEOUT_S = 10.0
Progress = Callable[[str], None]


@dataclass(frozen=True)
class Workload:
    model: Path
    prompt_tokens: int
    max_model_len: int
    out_tokens: int = 4


class Pair:
    """A producer ``p`` and a consumer ``c`` on one tier, and the requests between them."""

    def __init__(self, tier: TierKind, work: Workload, log_dir: Path, progress: Progress) -> None:
        self.tier = tier
        self.work = work
        self.progress = progress
        self.fleet = ServeFleet(log_dir / tier, progress)
        self.rng = random.Random(11)
        self.samples: list[Sample] = []
        self.healthy_latency_s = 0.0
        self.producer_gone_s: float | None = None
        self.log_dir = log_dir
        self.last = "start"  # the last fault measured (what a renewal follows)
        self.renewals: list[Renewal] = []

    def start(self) -> None:
        self.fleet.start(
            [
                ServeSpec(
                    name, self.work.model, tier=self.tier, max_model_len=self.work.max_model_len
                )
                for name in ("p", "c")
            ]
        )
        for name in ("p", "c"):  # warm-up: first requests are slow; no contact between them
            self.post(name, self.body(self.prompt(), cache_salt=uuid.uuid4().hex))

    def url(self, name: str) -> str:
        return self.fleet.engines[name].spec.url

    def prompt(self) -> list[int]:
        return [self.rng.randrange(3, 512) for _ in range(self.work.prompt_tokens)]

    def body(self, prompt: list[int], **extra: Any) -> dict[str, Any]:
        return {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": self.work.out_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
            **extra,
        }

    def post(self, name: str, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
        request = urllib.request.Request(
            self.url(name) + "/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        started = time.monotonic()
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
            answer: dict[str, Any] = json.loads(reply.read())
        return answer, time.monotonic() - started

    def prefill(self, prompt: list[int]) -> str:
        kv_id = f"faults-{uuid.uuid4().hex[:12]}"
        body = self.body(prompt, kv_transfer_params={"remote_decoder": {"kv_request_id": kv_id}})
        self.post("p", {**body, "max_tokens": 1})
        return kv_id

    def pull_body(self, prompt: list[int], kv_id: str) -> dict[str, Any]:
        """The consumer leg of an id whose prefill leg already answered (every pull
        here follows :meth:`prefill`), saying so like ``kvpeer router`` does."""
        source = {
            "kv_request_id": kv_id,
            "remote_host": HOST,
            "remote_port": self.fleet.engines["p"].spec.tier_port,
            "prefill_done": True,
        }
        return self.body(prompt, kv_transfer_params={"remote_prefiller": source})

    def counters(self) -> dict[str, float]:
        if self.tier != "kvpeer":
            return {}
        samples = kvpeer_samples(self.url("c"))
        return {k: v for k, v in samples.items() if not k.endswith("_sum")}

    def local(self, prompt: list[int]) -> tuple[dict[str, Any], float]:
        """``prompt`` computed by the consumer alone (salted: it shares no block)."""
        return self.post("c", self.body(prompt, cache_salt=uuid.uuid4().hex))

    def measure(
        self,
        fault: str,
        run: int,
        kv_id: str,
        prompt: list[int],
        inject: Callable[[], None] | None = None,
        delay_s: float = 0.0,
        local: tuple[dict[str, Any], float] | None = None,
        local_after: bool = True,
    ) -> Sample:
        """The local run (unless given), then the pull naming ``kv_id`` with ``inject``
        called ``delay_s`` after it was sent, then the local run again."""
        try:
            reference, local_s = local if local is not None else self.local(prompt)
            before = self.counters()
            self.producer_gone_s = None
            with ThreadPoolExecutor(1) as pool:
                pending = pool.submit(self.post, "c", self.pull_body(prompt, kv_id))
                if inject is not None:
                    time.sleep(delay_s)
                    inject()
                answer, latency_s = pending.result()
            time.sleep(COUNTER_SETTLE_S)
            after = self.counters()
            # A second local run: the machine is shared and a single local run is noisy;
            # the faster of the two is the baseline (a conservative, larger fallback).
            if local_after:
                local_s = min(local_s, self.local(prompt)[1])
        except (urllib.error.URLError, OSError, ValueError) as exc:
            sample = Sample(
                self.tier, fault, run, 0.0, 0.0, False, error=f"{type(exc).__name__}: {exc}"
            )
        else:
            delta = {
                k: v - before.get(k, 0.0)
                for k, v in after.items()
                if v != before.get(k, 0.0) and not k.startswith(("idle_", "thread_"))
            }
            sample = Sample(
                self.tier,
                fault,
                run,
                latency_s,
                local_s,
                outputs_equal=answer["choices"][0]["token_ids"]
                == reference["choices"][0]["token_ids"],
                cached_tokens=int(
                    (answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                ),
                phase=phase(delta) if self.tier == "kvpeer" else "",
                producer_gone_s=self.producer_gone_s,
                counters=delta,
            )
        self.samples.append(sample)
        self.last = f"{fault} run {run}"
        self.progress(
            f"{self.tier} {fault} run {run}: "
            + (
                sample.error
                or f"fallback {sample.fallback_s * 1000:.0f} ms (request "
                f"{sample.latency_s * 1000:.0f} ms, local {sample.local_s * 1000:.0f} ms), "
                f"cached {sample.cached_tokens}, "
                f"outputs {'equal' if sample.outputs_equal else 'DIFFER'}"
                f"{', ' + sample.phase if sample.phase else ''}"
                + (
                    f", producer gone {sample.producer_gone_s * 1000:.0f} ms after its SIGKILL"
                    if sample.producer_gone_s is not None
                    else ""
                )
            )
        )
        return sample

    def signal_producer(self, signum: int) -> Callable[[], None]:
        return lambda: self.fleet.engines["p"].signal(signum)

    def measure_frozen(self, fault: str, run: int) -> Sample:
        """A prefill leg, then the request with the producer stopped (SIGSTOP) until
        the measurement is over."""
        prompt = self.prompt()
        kv_id = self.prefill(prompt)
        producer = self.fleet.engines["p"]
        producer.signal(signal.SIGSTOP)
        try:
            return self.measure(fault, run, kv_id, prompt)
        finally:
            producer.signal(signal.SIGCONT)

    def kill_producer(self) -> None:
        """SIGKILL the producer's group; note when the last process of it was gone (the
        kernel closes a process's sockets only after it has torn down its memory)."""
        engine = self.fleet.engines["p"]
        killed = time.monotonic()
        engine.signal(signal.SIGKILL)
        with contextlib.suppress(Exception):
            engine.process.wait(timeout=30)
        while time.monotonic() - killed < GONE_TIMEOUT_S:
            try:
                os.killpg(engine.process.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.002)
        self.producer_gone_s = time.monotonic() - killed

    def recover(self) -> bool:
        """Pull until a pull works: the consumer's back-off is over and a session is up.
        False if none did within :data:`RECOVER_TIMEOUT_S`."""
        deadline = time.monotonic() + RECOVER_TIMEOUT_S
        while time.monotonic() < deadline:
            prompt = self.prompt()
            kv_id = self.prefill(prompt)
            answer, _ = self.post("c", self.pull_body(prompt, kv_id))
            if (answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens"):
                return True
            time.sleep(1.0)
        return False

    def ready(self) -> None:
        """A working pair for the next fault: recovered, or else both engines started
        afresh (a renewal, recorded: the faults before it broke the pair for good)."""
        if self.recover():
            return
        self.renew(f"no pull worked for {RECOVER_TIMEOUT_S:.0f} s")
        if not self.recover():
            self.progress(f"{self.tier}: no pull works even on a fresh pair; measuring anyway")

    def renew(self, why: str) -> None:
        """Stop both engines and start a fresh pair (new log directory)."""
        self.renewals.append(Renewal(self.tier, self.last, why))
        self.progress(f"{self.tier}: the pair broke after {self.last} ({why}); a fresh pair")
        self.fleet.close()
        self.fleet = ServeFleet(self.log_dir / f"{self.tier}.{len(self.renewals)}", self.progress)
        self.start()

    def close(self) -> None:
        """Stop both engines; a stopped producer is resumed first (it could not act on
        SIGTERM otherwise)."""
        if "p" in self.fleet.engines:
            self.fleet.engines["p"].signal(signal.SIGCONT)
        self.fleet.close()

    def restart_producer(self) -> None:
        try:
            self.fleet.restart("p", timeout_s=RESTART_TIMEOUT_S)
        except EngineFailed as exc:  # vLLM's tier: a producer restart once took 466 s
            self.renew(f"the producer did not restart: {str(exc).splitlines()[0]}")
            return
        self.post("p", self.body(self.prompt(), cache_salt=uuid.uuid4().hex))  # warm-up


def phase(delta: dict[str, float]) -> str:
    """What one request's counter deltas say the consumer reached, shortest first."""
    parts: list[str] = []
    for key in sorted(delta):
        name, _, label = key.partition("[")
        label = label.rstrip("]")
        if name == "session_events_total" and label in ("opened", "refused"):
            parts.append(f"session {label}")
        elif name == "lookups_total":
            parts.append(f"lookup {label}")
        elif name == "fetches_total":
            parts.append(f"fetch {label}")
        elif name == "sessions_closed_total":
            parts.append(f"closed {label}")
        elif name == "timeouts_total":
            parts.append(f"timeout {label}")
    blocks = delta.get("pulled_blocks_total", 0.0)
    if blocks:
        parts.append(f"{blocks:g} blocks")
    return "; ".join(parts) or "no contact"


def measure_tier(pair: Pair, spec: FaultsSpec) -> None:
    want, runs = set(spec.faults), spec.runs
    if want - {"frozen-first-contact"}:
        pair.ready()
    latencies = []
    for run in range(runs if "healthy" in want or "killed-mid-transfer" in want else 0):
        prompt = pair.prompt()
        sample = pair.measure("healthy", run, pair.prefill(prompt), prompt)
        latencies.append(sample.latency_s)
    pair.healthy_latency_s = sorted(latencies)[len(latencies) // 2] if latencies else 0.1
    if "frozen-in-session" in want:
        for run in range(runs):
            pair.ready()
            pair.measure_frozen("frozen-in-session", run)
    cycle = want & {"killed-during-lookup", "restarted", "killed-mid-transfer"}
    for run in range(runs if cycle else 0):
        pair.ready()
        lookup_prompt, restart_prompt = pair.prompt(), pair.prompt()
        lookup_id, restart_id = pair.prefill(lookup_prompt), pair.prefill(restart_prompt)
        if "killed-during-lookup" in want:
            # Stopped first, so the consumer's request is certainly waiting on it when
            # it dies (a live producer answers the whole pull in a few ms here: a kill
            # timed after the send mostly came after it).
            pair.fleet.engines["p"].signal(signal.SIGSTOP)
            pair.measure(
                "killed-during-lookup",
                run,
                lookup_id,
                lookup_prompt,
                pair.kill_producer,
                delay_s=0.02 + 0.01 * (run % 5),
            )
        if want & {"killed-during-lookup", "restarted"}:
            pair.restart_producer()
        if "restarted" in want:
            pair.measure("restarted", run, restart_id, restart_prompt)
        if "killed-mid-transfer" in want:
            pair.ready()
            prompt = pair.prompt()
            kv_id = pair.prefill(prompt)
            delay = 0.010 * (1 + run % 5)  # 36 MiB over shm take ~20 ms here
            pair.measure("killed-mid-transfer", run, kv_id, prompt, pair.kill_producer, delay)
            pair.restart_producer()
    if want & {"killed-before-contact", "backed-off"}:
        prompt = pair.prompt()
        kv_id = pair.prefill(prompt)
        pair.kill_producer()
        for run in range(runs):
            if run:  # wait out the back-off (1 s, doubling per failed attempt)
                time.sleep(min(2.0 ** (run - 1), 30.0) + 0.5)
                # A fresh prompt naming the dead producer: the consumer computed the last
                # one itself and would find it in its own cache.
                prompt, kv_id = pair.prompt(), f"faults-{uuid.uuid4().hex[:12]}"
            again = pair.prompt()
            again_local = pair.local(again)  # before: the back-off lasts only 1 s at first
            if "killed-before-contact" in want:  # no second local run: the back-off is short
                pair.measure("killed-before-contact", run, kv_id, prompt, local_after=False)
            if "backed-off" in want:
                pair.measure(
                    "backed-off", run, f"faults-{uuid.uuid4().hex[:12]}", again, local=again_local
                )
    if "frozen-first-contact" in want:
        # Last, against a producer process the consumer never talked to: vLLM's p2p pair
        # never pulled again after this fault (its consumer keeps waiting on the session
        # it could not finish), which cost every later fault its measurement.
        if want - {"frozen-first-contact"}:
            pair.restart_producer()
        for run in range(runs):
            if run:  # each frozen run is a failed first contact: wait out its back-off
                time.sleep(min(2.0 ** (run - 1), 30.0) + 0.5)
            pair.measure_frozen("frozen-first-contact", run)


def run(
    spec: FaultsSpec, work: Workload, log_dir: Path, progress: Progress
) -> tuple[list[Sample], list[Renewal]]:
    """Every tier of ``spec``, one pair after another; engines are stopped whatever happens."""
    samples: list[Sample] = []
    renewals: list[Renewal] = []
    for tier in spec.tiers:
        pair = Pair("kvpeer" if tier == "kvpeer" else "p2p", work, log_dir, progress)
        try:
            pair.start()
            measure_tier(pair, spec)
        except (OSError, EngineFailed) as exc:  # URLError and timeouts are OSErrors
            # An engine that stops answering (vLLM's p2p producer once sat on a prefill
            # leg for 90 s): what was measured stands, the rest of this tier is left out.
            why = f"measurement stopped: {type(exc).__name__}: {str(exc).splitlines()[0]}"
            progress(f"{tier}: {why} (after {pair.last})")
            pair.renewals.append(Renewal(pair.tier, pair.last, why))
        except KeyboardInterrupt:  # Ctrl-C: stop here, but print what was measured
            progress(f"{tier}: interrupted after {pair.last}; the table has what was measured")
            pair.renewals.append(Renewal(pair.tier, pair.last, "measurement stopped: interrupted"))
            break
        finally:
            pair.close()
            samples += pair.samples
            renewals += pair.renewals
    return samples, renewals


def main(args: argparse.Namespace) -> int:
    """``kvpeer bench faults``: run, print the table (or JSON); 1 if a cell failed."""
    from kvpeer.lab.demo_run import default_model_dir
    from kvpeer.lab.engines.model import SERVE_LLAMA_CONFIG, ensure_llama, ensure_tiny_llama
    from kvpeer.transport.data.nixl import NixlBackend

    def progress(message: str) -> None:
        print(f"kvpeer bench faults: {message}", file=sys.stderr, flush=True)

    spec = FaultsSpec.from_args(args)
    if "p2p" in spec.tiers and not NixlBackend.available():
        progress("nixl is not installed: vLLM's p2p tier is left out")
        spec = replace(spec, tiers=tuple(t for t in spec.tiers if t != "p2p") or ("kvpeer",))
    cache = os.environ.get("XDG_CACHE_HOME")
    if spec.quick:
        model = ensure_tiny_llama(args.model or default_model_dir(cache, "tiny-llama"))
        work = Workload(model, prompt_tokens=384, max_model_len=512)
    else:
        model = ensure_llama(args.model or default_model_dir(cache), SERVE_LLAMA_CONFIG)
        work = Workload(model, prompt_tokens=1536, max_model_len=2048)
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        log_dir = (
            Path(args.log_dir)
            if args.log_dir
            else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvpeer-faults-")))
        )
        samples, renewals = run(spec, work, log_dir, progress)
    result = to_json(
        spec,
        samples,
        renewals=renewals,
        model=model.name,
        prompt_tokens=work.prompt_tokens,
        seconds=time.monotonic() - started,
    )
    print(json.dumps(result) if args.json else render(result))
    return 0 if result["ok"] else 1
