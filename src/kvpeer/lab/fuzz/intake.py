"""A coverage-guided fuzz target for the router's intake of engine bytes (atheris, libFuzzer).

An engine's KV event batch is the one input the router parses that someone else wrote,
and the C extension ``kvpeer.router._intake`` parses it. Each input's first byte picks
the door it comes in by; the rest are the engine's bytes:

- ``TOKENS`` (first byte even): one store's ``token_ids`` msgpack. ``msgpack_tokens``
  packs exactly what the Python path (msgspec) packs, or refuses with the same words
  (``events._token_fault``), at the decoder's limit and at a small one.
- ``BATCH`` (first byte odd): a published batch. ``decode_batch`` with the C intake
  (translation, runs of stores, token ids) decides as with the Python loops, never
  raising; what it decoded, applied to a ``PrefixIndex`` with the C loops and to one with
  the Python loops, leaves the same statistics and the same prefixes.

A disagreement raises ``IntakeMismatch``, which libFuzzer counts as a crash, as it does a
sanitizer's report when the extension is built with ``-fsanitize=address,undefined``
(scripts/fuzz-intake builds it so, with clang's ``-fsanitize=fuzzer-no-link`` for the
coverage of the C). :func:`check` is the target without atheris: the regression tests call
it with the seeds and every input a run has found (tests/test_fuzz_intake.py).

    python -m kvpeer.lab.fuzz.intake --seeds DIR    # write the seed corpus
    python -m kvpeer.lab.fuzz.intake [libFuzzer flags] [CORPUS_DIR ... | CRASH_FILE ...]
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from kvpeer.router import events as events_module
from kvpeer.router.events import BatchDecoded, decode_batch
from kvpeer.router.feed import StreamSynced
from kvpeer.router.index import MEDIUM_CPU, MEDIUM_GPU, PrefixIndex
from kvpeer.router.kvevents import BlocksStored

TOKENS, BATCH = 0, 1
R = TypeVar("R")
SMALL_LIMIT = 3  # a count limit the fuzzer reaches in a few bytes
#: A real vLLM 0.32 KV event stream (tests/router/data/record_vllm_stream.py): its batches
#: and their token arrays seed the corpus.
RECORDING = Path(__file__).resolve().parents[4] / "tests" / "router" / "data" / (
    "vllm-0.32-stream.msgpack"
)


class IntakeMismatch(AssertionError):
    """The C intake and its Python reference decided differently on the same bytes."""


def check(data: bytes) -> None:
    """The fuzz target: one input, checked; raises IntakeMismatch on a disagreement."""
    native = events_module._native_intake
    if native is None:
        raise RuntimeError("kvpeer.router._intake is not built: nothing to fuzz")
    if not data:
        return
    door, body = data[0], data[1:]
    if door % 2 == TOKENS:
        _check_tokens(body)
    else:
        _check_batch(body)


def _outcome_in_c(raw: bytes, limit: int) -> bytes | str:
    native = events_module._native_intake
    assert native is not None
    try:
        packed: bytes = native.msgpack_tokens(raw, limit)
    except ValueError as exc:
        return str(exc)
    return packed


def _check_tokens(raw: bytes) -> None:
    in_c = _outcome_in_c(raw, events_module.MAX_TOKENS_PER_EVENT)
    in_python = _python_loops(_packed_or_words, raw)
    compared: tuple[object, object] = (in_c, in_python)
    if len(raw) > events_module.FAULT_NAMED_BYTES:  # msgspec's words past it, by design
        compared = (isinstance(in_c, str), isinstance(in_python, str))
    if compared[0] != compared[1]:
        raise IntakeMismatch(f"token ids {raw[:64].hex()}: C {in_c!r}, Python {in_python!r}")
    small_c = _outcome_in_c(raw, SMALL_LIMIT)
    fault = events_module._token_fault(raw, SMALL_LIMIT)
    if fault is not None and small_c != fault:
        raise IntakeMismatch(f"token ids {raw[:64].hex()} at most {SMALL_LIMIT}: C {small_c!r}, "
                             f"Python {fault!r}")
    if fault is None and small_c != in_c:
        raise IntakeMismatch(f"token ids {raw[:64].hex()}: C at most {SMALL_LIMIT} {small_c!r}, "
                             f"without {in_c!r}")


def _packed_or_words(raw: bytes) -> bytes | str:
    try:
        return events_module._packed_tokens(msgspec.Raw(raw))
    except ValueError as exc:
        return str(exc)


def _python_loops(run: Callable[[bytes], R], raw: bytes) -> R:
    """``run(raw)`` with the module's C intake switched off (the Python reference)."""
    saved = events_module._native_intake
    events_module._native_intake = None
    try:
        return run(raw)
    finally:
        events_module._native_intake = saved


def _check_batch(payload: bytes) -> None:
    in_c = decode_batch(payload)
    in_python = _python_loops(decode_batch, payload)
    # A batch's time may be NaN (an engine's float), and NaN != NaN: the reprs decide then
    # (exact for floats, bytes and the tuples the decoder returns).
    if in_c != in_python and repr(in_c) != repr(in_python):
        raise IntakeMismatch(f"batch {payload[:64].hex()}: C {in_c!r}, Python {in_python!r}")
    if isinstance(in_c, BatchDecoded):
        _check_index(in_c)


def _check_index(batch: BatchDecoded) -> None:
    indexes = (PrefixIndex(native=True, max_blocks=8, max_retired=4),
               PrefixIndex(native=False, max_blocks=8, max_retired=4))
    for index in indexes:
        index.apply("e0", StreamSynced())
        for event in batch.events:
            index.apply("e0", event)
    c, python = indexes
    if c.statistics(0.0) != python.statistics(0.0):
        raise IntakeMismatch(f"index: C {c.statistics(0.0)}, Python {python.statistics(0.0)}")
    for event in batch.events:
        if not isinstance(event, BlocksStored):
            continue
        prompt = array("I")
        prompt.frombytes(event.tokens)
        for medium in (MEDIUM_GPU, MEDIUM_CPU):
            answers = [i.prefixes(i.keys(prompt.tolist()), medium, 0.0) for i in indexes]
            if answers[0] != answers[1]:
                raise IntakeMismatch(f"prefixes on {medium}: C {answers[0]}, "
                                     f"Python {answers[1]}")


def seeds() -> Iterator[tuple[str, bytes]]:
    """The seed corpus: every batch of the recorded vLLM stream (door BATCH) and every
    store's token ids in it (door TOKENS), then a few shapes a recording lacks."""
    recording = msgspec.msgpack.decode(RECORDING.read_bytes())
    for n, (_, payload) in enumerate(recording["frames"]):
        yield f"batch-{n}", bytes([BATCH]) + bytes(payload)
        events = msgspec.msgpack.decode(bytes(payload))[1]
        for m, event in enumerate(events):
            if event.get("type") == "BlockStored":
                tokens = msgspec.msgpack.encode(event["token_ids"])
                yield f"tokens-{n}-{m}", bytes([TOKENS]) + tokens
    widths = [0, 127, 128, 255, 256, 65_535, 65_536, 2**32 - 1]
    yield "tokens-widths", bytes([TOKENS]) + msgspec.msgpack.encode(widths)
    yield "tokens-array16", bytes([TOKENS]) + b"\xdc\x00\x02\x01\x02"
    yield "tokens-array32", bytes([TOKENS]) + b"\xdd\x00\x00\x00\x01\xd3" + bytes(8)
    # The shapes the differential tests build (tests/router/test_index_native.py):
    # a run stored child first, removals, a clear, salted, LoRA, other-group and empty
    # stores, an int8 -1 among the ids.
    gone = {"type": "BlockRemoved", "block_hashes": [b"a" * 32], "medium": "GPU"}
    batches: dict[str, list[dict[str, Any]]] = {
        "run": [_store([b"b" * 32], b"a" * 32, [3, 4]), _store([b"a" * 32], None, [1, 2]),
                gone, gone, {"type": "AllBlocksCleared"}],
        "skipped": [_store([7, 8], None, [1, 2, 3, 70_000], extra_keys=[None, ["salt"]]),
                    _store([9], None, [1, 2], lora_id=1, lora_name="a"),
                    _store([9], None, [], block_size=0), {**gone, "group_idx": 1}],
        "negative": [gone, _store([1], None, [1, -2])],
        "empty": [],
    }
    for name, events in batches.items():
        yield f"batch-{name}", bytes([BATCH]) + msgspec.msgpack.encode([1.0, events])


def _store(hashes: list[Any], parent: Any, tokens: list[int], **extra: Any) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": 2, "lora_id": None, "medium": "CPU",
            "lora_name": None, **extra}


def write_seeds(directory: Path) -> int:
    directory.mkdir(parents=True, exist_ok=True)
    count = 0
    for name, data in seeds():
        (directory / name).write_bytes(data)
        count += 1
    return count


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[1] == "--seeds":
        print(f"{write_seeds(Path(argv[2]))} seeds in {argv[2]}")
        return 0
    import atheris  # type: ignore[import-untyped]  # only here: the lab's one user of it

    atheris.Setup(argv, check)
    atheris.Fuzz()
    return 0  # not reached: libFuzzer exits


if __name__ == "__main__":
    sys.exit(main(sys.argv))
