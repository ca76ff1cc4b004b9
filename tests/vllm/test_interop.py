"""kvpeer and vLLM 0.32's own ``p2p`` tier share KV both ways, in real engines, over NIXL.

Two pairs of engines run one after the other, one per direction (the first with a
third engine, see 3.):

- ``vllm-to-kvpeer``: producer A runs vLLM's ``p2p`` tier, consumer B kvpeer's
  ``KVPeerTier`` with ``data_transports: ["tcp", "nixl"]`` (kvpeer peers would get
  tcp; vLLM speaks only NIXL, so this pair uses nixl).
- ``kvpeer-to-vllm``: producer A runs ``KVPeerTier`` with ``["shm", "nixl"]`` and
  ``held_bytes`` (it keeps held copies, ``kvpeer.node.held``, which only shm reads: a
  vLLM peer is still served from the primary, through serve windows), consumer B
  vLLM's ``p2p`` tier.

Producers run in vLLM's multiprocessing mode: vLLM's tier answers peers only in serve
windows (its EngineCore steps nonstop), and kvpeer's symmetric producer needs a
serve window too (kvpeer wakes its idle EngineCore). Consumers run in-process.
On each pair, one after the other:

1. PD: A prefills a prompt for a ``remote_decoder`` id and computes a second
   prompt as an ordinary request; B, which never saw either, decodes the first
   with ``remote_prefiller`` and then runs the second with ``remote_kv_source``
   (symmetric: it probes A, which answers from its primary tier). Each pulled run
   must equal A's local one (tokens; logprobs within ``LOGPROB_TOLERANCE``) while B
   computed at most one block of the 256 prompt tokens.
2. Negative control: A prefills a third prompt for another ``remote_decoder`` id,
   then negates every float of its primary region (``corrupt_primary``); B's pull
   of it must differ from A's local run, so the equality above compares the very
   bytes that crossed between the two implementations.
3. Refusal (vLLM producer only): a third engine, a kvpeer consumer configured with
   another ``config_fingerprint``, asks A for a PD prompt. vLLM refuses its connect
   without telling it; kvpeer refuses vLLM's connect as well, so it computes locally
   at once (not after its timeouts). Each side refuses once: vLLM's next, identical
   connect is refused without a session (no refusal loop).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvpeer.lab.engines.launcher import EngineLauncher, EngineOutcome, free_port
from kvpeer.transport.data.nixl import INSTALL_HINT, NixlBackend
from tests.vllm.scenario import (
    BLOCK_TOKENS,
    CORRUPT_PRIMARY,
    FREEZE_S,
    HOST,
    MIN_PEER_TOKENS,
    WARMUP,
    FreezeWatch,
    Pair,
    RecordProperty,
    assert_computed_locally,
    assert_output_differs,
    assert_pulled_from_peer,
    assert_same_output,
    engine,
    generate,
    hold_until,
    kvpeer_tier,
    prompt,
    remote_decoder,
    remote_source,
    report,
    request_id,
    signal,
    vllm_p2p_tier,
)

pytestmark = pytest.mark.slow  # real vLLM engines

needs_nixl = pytest.mark.skipif(not NixlBackend.available(), reason=INSTALL_HINT)

PD_PROMPT = prompt(21)
SYMMETRIC_PROMPT = prompt(22)  # the prompts share no block
CORRUPT_PROMPT = prompt(23)
# What vLLM logs when it refuses a connect (p2p/session/session.py), what kvpeer logs
# when a session ends on a refusal, a broken rule or a handshake that never finished,
# and what it logs when it cannot compute vLLM's fingerprint and sends none (then
# neither side would check it).
REFUSALS = (
    "rejecting peer connect",
    "ended (rejected)",
    "ended (protocol_error)",
    "ended (timeout)",
    "no config fingerprint",
)
# vLLM's consumer gives up on a load after 30 s (not configurable); ours waits as long.
KVPEER_TIMEOUT_S = 30.0
# The refused consumer's timeouts: it must fall back long before them (at the refusal).
REFUSED_TIMEOUT_S = 60.0
# Each side refuses the other's connect, once: vLLM answers kvpeer's goodbye with a
# new session and the same connect, which kvpeer refuses without a session (tier
# invariant 9). Before that, the two went on refusing each other many times a second.
MAX_REFUSALS = 1

Tier = Callable[[int], dict[str, Any]]

DIRECTIONS = ("vllm-to-kvpeer", "kvpeer-to-vllm")


def kvpeer_nixl(port: int) -> dict[str, Any]:
    return kvpeer_tier(port, "nixl", timeout_s=KVPEER_TIMEOUT_S)  # and peer_wait_s


def kvpeer_tcp_then_nixl(port: int) -> dict[str, Any]:
    """A fleet's usual list: kvpeer peers use tcp, a vLLM peer gets nixl."""
    return {**kvpeer_nixl(port), "data_transports": ["tcp", "nixl"]}


def kvpeer_holding(port: int) -> dict[str, Any]:
    """A producer keeping held copies: a vLLM peer must not notice them."""
    return {**kvpeer_nixl(port), "data_transports": ["shm", "nixl"], "held_bytes": 32 << 20}


TIERS: dict[str, tuple[Tier, Tier]] = {  # direction -> (producer's tier, consumer's tier)
    "vllm-to-kvpeer": (vllm_p2p_tier, kvpeer_tcp_then_nixl),
    "kvpeer-to-vllm": (kvpeer_holding, vllm_p2p_tier),
}


@dataclass(frozen=True)
class Interop:
    pair: Pair
    consumer_peer: str  # the consumer's peer id, as the producer's log names it
    refused: EngineOutcome | None  # a kvpeer consumer with another fingerprint


def refused_consumer(
    launcher: EngineLauncher, producer_port: int, ready: Path, finished: Path
) -> dict[str, Any]:
    """A kvpeer consumer whose ``config_fingerprint`` is not the producer's."""
    tier = {
        **kvpeer_tier(free_port(), "nixl", timeout_s=REFUSED_TIMEOUT_S),
        "config_fingerprint": "not-this-model",
    }
    source = remote_source("remote_prefiller", request_id("refused"), producer_port)
    return engine(
        launcher,
        tier,
        [
            WARMUP,
            hold_until("waiting", ready),
            generate("refused", PD_PROMPT, source),
            signal(finished),
        ],
    )


def every_pull_loaded(interop: Interop) -> bool:
    """The consumer computed at most one block of each prompt it pulled."""
    runs = interop.pair.consumer.runs.items()
    return all(r.num_cached_tokens >= MIN_PEER_TOKENS for k, r in runs if k.endswith("-pulled"))


def run_pair(launcher: EngineLauncher, direction: str, signals: Path) -> Interop:
    """The PD, symmetric and corrupted pulls; with a vLLM producer also the refusal."""
    producer_tier, consumer_tier = TIERS[direction]
    with_refusal = direction == "vllm-to-kvpeer"
    refused_done = signals / "refused"
    producer_port, consumer_port = free_port(), free_port()
    pd_id, symmetric_id = request_id(f"{direction}-pd"), request_id(f"{direction}-symmetric")
    corrupt_id = request_id(f"{direction}-corrupt")
    ready, pulled, corrupted, done = (signals / n for n in ("ready", "pulled", "corrupt", "done"))
    producer = engine(
        launcher,
        producer_tier(producer_port),
        [
            WARMUP,
            generate("pd-local", PD_PROMPT, remote_decoder(pd_id)),
            generate("symmetric-local", SYMMETRIC_PROMPT),
            signal(ready),
            hold_until("serving", pulled),
            generate("corrupt-local", CORRUPT_PROMPT, remote_decoder(corrupt_id)),
            CORRUPT_PRIMARY,
            signal(corrupted),
            hold_until("serving-corrupt", done),
            *([hold_until("refusing", refused_done)] if with_refusal else []),
        ],
    )
    consumer = engine(
        launcher,
        consumer_tier(consumer_port),
        [
            WARMUP,
            hold_until("waiting", ready),
            generate(
                "pd-pulled", PD_PROMPT, remote_source("remote_prefiller", pd_id, producer_port)
            ),
            generate(
                "symmetric-pulled",
                SYMMETRIC_PROMPT,
                remote_source("remote_kv_source", symmetric_id, producer_port),
            ),
            signal(pulled),
            hold_until("waiting-corrupt", corrupted),
            generate(
                "corrupt-pulled",
                CORRUPT_PROMPT,
                remote_source("remote_prefiller", corrupt_id, producer_port),
            ),
            signal(done),
        ],
    )
    engines = [(producer, True), (consumer, False)]
    if with_refusal:
        engines.append((refused_consumer(launcher, producer_port, ready, refused_done), False))
    a, b, *refused = launcher.run_together(engines)
    return Interop(Pair(a, b), f"{HOST}:{consumer_port}", refused[0] if refused else None)


@pytest.fixture(scope="module")
def pairs(
    launcher: EngineLauncher, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Future[Interop]]:
    """Both directions, one after the other, awaited by the tests.

    Not at once: vLLM's producer steps nonstop (its tier is polled by engine steps only);
    with the other pair's engines starting next to it, two cores ran 15-20 threads and a
    pull took seconds. A pair in which a pull failed while this process or one of the
    engines did not run at all for ``FREEZE_S`` or more runs once more: this VM stalls
    processes for up to 14 s (every one at times, a bystander sampler too), and ZMQ's 10 s
    heartbeats then expire between healthy engines."""

    def chain(direction: str, after: Future[Interop] | None) -> Callable[[], Interop]:
        def attempt() -> tuple[Interop, float]:
            signals = tmp_path_factory.mktemp(f"signals-{direction}")
            with FreezeWatch() as watch:
                interop = run_pair(launcher, direction, signals)
            pair = interop.pair
            stalls = (watch.longest_s, pair.producer.longest_stall_s, pair.consumer.longest_stall_s)
            return interop, max(stalls)

        def run() -> Interop:
            if after is not None:
                after.exception()  # waits; its own tests report how it went
            interop, stall_s = attempt()
            if stall_s < FREEZE_S or every_pull_loaded(interop):
                return interop
            # A process (or the whole machine) did not run at all for long enough that
            # ZMQ's heartbeats could expire: that run says nothing about either tier. Once
            # more; the tests then judge the second run, whatever happens in it.
            print(f"{direction}: a process stalled {stall_s:.1f}s and a pull failed: run again")
            return attempt()[0]

        return run

    pairs: dict[str, Future[Interop]] = {}
    previous: Future[Interop] | None = None
    for direction in DIRECTIONS:
        previous = pairs[direction] = launcher.submit(chain(direction, previous))
    return pairs


@needs_nixl
@pytest.mark.parametrize("mode", ["pd", "symmetric"])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_consumer_output_equals_the_producers_local_run(
    pairs: dict[str, Future[Interop]], direction: str, mode: str, record_property: RecordProperty
) -> None:
    pair = pairs[direction].result().pair
    local, pulled = pair.producer.runs[f"{mode}-local"], pair.consumer.runs[f"{mode}-pulled"]

    assert_computed_locally(local)
    assert_pulled_from_peer(pulled)
    assert_same_output(pulled, local)
    if pulled.blocks_from_peer is not None:  # a kvpeer consumer counts what it loaded
        assert pulled.blocks_from_peer * BLOCK_TOKENS >= pulled.num_cached_tokens
    report(record_property, f"{direction}_{mode}_pulled_generate_s", pulled.seconds)


@needs_nixl
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_pull_of_corrupted_producer_kv_changes_the_output(
    pairs: dict[str, Future[Interop]], direction: str
) -> None:
    pair = pairs[direction].result().pair
    local, pulled = pair.producer.runs["corrupt-local"], pair.consumer.runs["corrupt-pulled"]

    assert_computed_locally(local)
    assert_pulled_from_peer(pulled)  # still loaded from the peer
    assert_output_differs(pulled, local)


@needs_nixl
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_neither_side_refused_the_others_connect(
    pairs: dict[str, Future[Interop]], direction: str
) -> None:
    """Both sides check block length, hash seed and config fingerprint (each refuses a
    non-empty fingerprint that differs from its own), and kvpeer sent one. (vLLM's
    producer does refuse the refused consumer: its lines name that peer, not ours.)"""
    interop = pairs[direction].result()
    for outcome in (interop.pair.producer, interop.pair.consumer):
        assert outcome.log_path is not None
        lines = outcome.log_path.read_text(encoding="utf-8", errors="replace").splitlines()
        found = [
            line
            for line in lines
            if any(refusal in line for refusal in REFUSALS)
            and (outcome is interop.pair.consumer or interop.consumer_peer in line)
        ]
        assert not found, f"{outcome.log_path}: {found}"


@needs_nixl
def test_kvpeer_consumer_refused_by_vllm_computes_locally_at_once(
    pairs: dict[str, Future[Interop]],
) -> None:
    """vLLM refuses a connect without a word to the peer; kvpeer checks vLLM's connect
    the same way, refuses it too and falls back at once, not after its timeouts."""
    interop = pairs["vllm-to-kvpeer"].result()
    refused = interop.refused
    assert refused is not None
    assert refused.log_path is not None
    run, local = refused.runs["refused"], interop.pair.producer.runs["pd-local"]

    assert_computed_locally(run)
    assert_same_output(run, local)
    assert run.seconds < REFUSED_TIMEOUT_S, "the fallback waited for a timeout"
    log = refused.log_path.read_text(encoding="utf-8", errors="replace")
    refusals = log.count("ended (rejected): config fingerprint mismatch")
    assert refusals == MAX_REFUSALS, f"{refusals} sessions refused"


def test_kvpeer_fingerprints_a_run_config_as_vllms_p2p_tier_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same run config gives the same ``config_fingerprint`` on both sides."""
    from vllm.v1.kv_offload.file_mapper import FileMapper
    from vllm.v1.kv_offload.tiering.p2p.data.base import DataTransport

    from kvpeer.integrations.vllm.secondary_tier import _fingerprint

    run_config: dict[str, Any] = {
        "model_name": "/models/tiny-llama-\u00e9",  # not ASCII: both escape it alike
        "tokens_per_hash": 32,
        "blocks_per_file": 1,
        "tp_size": 1,
        "pp_size": 1,
        "pcp_size": 1,
        "dcp_size": 1,
        "dtype": "torch.float32",
        "kv_cache_groups": [
            {"tokens_per_block": 32, "layer_names": ["model.layers.0.self_attn.attn"]}
        ],
        "inference_engine": "vllm",
    }

    class Mapper:
        def get_run_config(self) -> dict[str, Any]:
            return run_config

    def from_offloading_spec(**kwargs: Any) -> Mapper:
        assert kwargs["parallel_agnostic"] is True  # what vLLM's p2p tier asks for
        return Mapper()

    monkeypatch.setattr(FileMapper, "from_offloading_spec", from_offloading_spec)
    spec = SimpleNamespace(blocks_per_chunk=1)

    want = DataTransport._compute_fingerprint(run_config)
    assert want
    assert _fingerprint(spec) == want
