"""The router's per-block intake in C (``kvpeer.router._intake``: the index's core and its
loops, the decoder's translation) against the Python reference (``indexloops.Core``,
``events.py``): the same event streams leave the same state, containers' order included;
hostile arguments and corrupt containers raise, never crash; nothing leaks a reference."""

from __future__ import annotations

import gc
import hashlib
import logging
import re
import struct
import subprocess
import sys
import tracemalloc
from array import array
from collections import OrderedDict
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpeer.lab.engines.fakeengine import FakeEngine
from kvpeer.router import events as events_module
from kvpeer.router import index as index_module
from kvpeer.router import indexcore, indexloops
from kvpeer.router.app import Router
from kvpeer.router.events import BatchRejected
from kvpeer.router.feed import FeedItem, StreamReset, StreamSynced
from kvpeer.router.index import MEDIUM_CPU, MEDIUM_GPU, PrefixIndex
from kvpeer.router.kvevents import (
    AllCleared,
    BlockHash,
    BlocksRemoved,
    BlocksStored,
    BlocksUnkeyable,
)
from tests.router.conftest import make_config, run

native = index_module._native_intake
needs_native = pytest.mark.skipif(
    native is None, reason="kvpeer.router._intake is not built (no C compiler at install)"
)

BS = 2
ENGINES = ("e0", "e1", "e2")
# Few hashes and few token values: the streams revisit blocks, parents and contents.
HASHES: tuple[BlockHash, ...] = (*range(1, 9), *(bytes([i]) * 4 for i in range(1, 5)))
MEDIA = (MEDIUM_GPU, MEDIUM_CPU, "disk")  # "disk": not indexed, counted as ignored

hash_st = st.sampled_from(HASHES)
medium_st = st.sampled_from(MEDIA)


@st.composite
def stored_st(draw: st.DrawFn) -> BlocksStored:
    n = draw(st.integers(1, 4))
    blocks = tuple(draw(st.lists(hash_st, min_size=n, max_size=n)))
    tokens = tuple(draw(st.lists(st.integers(0, 2), min_size=n * BS, max_size=n * BS)))
    size = draw(st.sampled_from((BS, BS, BS, 3)))  # now and then a size the index refuses
    parent = draw(st.none() | hash_st)
    return BlocksStored.of_ids(draw(medium_st), blocks, parent, tokens, size)


item_st = st.one_of(
    stored_st(),
    stored_st(),
    st.builds(BlocksRemoved, medium_st, st.lists(hash_st, min_size=1, max_size=5).map(tuple)),
    st.builds(BlocksRemoved, medium_st, st.lists(hash_st, min_size=1, max_size=5).map(tuple)),
    st.builds(BlocksUnkeyable, st.lists(hash_st, min_size=1, max_size=3).map(tuple), medium_st),
    st.just(AllCleared()),
    st.builds(StreamReset, st.just("gap"), st.booleans()),
    st.just(StreamSynced()),
)
prompt_st = st.lists(st.integers(0, 2), min_size=0, max_size=4 * BS)
step_st = st.tuples(
    st.sampled_from(ENGINES),
    item_st | st.tuples(st.just("speculate"), prompt_st, medium_st, st.floats(0.5, 3.0)),
)


def state(index: PrefixIndex) -> dict[str, Any]:
    """Everything the index holds, with every ordered container's order."""
    core = index._core
    engines = {
        name: (
            e.bit,
            e.learned,
            list(core._hashes[e.index].items()),
            list(core._retired[e.index].items()),
            {m: list(p.items()) for m, p in core._present[e.index].items()},
            list(core._speculative[e.index].items()),
        )
        for name, e in index._engines.items()
    }
    return {
        "engines": engines,
        "holders": {m: dict(h.items()) for m, h in core._holders.items()},
        "speculating": dict(core._speculating),
        "counts": dict(index._counts),
        "block_size": index.block_size,
        "learned": index._learned_bits,
    }


def both() -> tuple[PrefixIndex, PrefixIndex]:
    python = PrefixIndex(BS, native=False, max_blocks=6, max_retired=3, max_speculative=5)
    c = PrefixIndex(BS, native=True, max_blocks=6, max_retired=3, max_speculative=5)
    assert not python.native
    assert c.native
    return python, c


@needs_native
@settings(max_examples=400, deadline=None)
@given(st.lists(step_st, max_size=60), st.lists(prompt_st, min_size=1, max_size=3))
def test_any_stream_leaves_the_same_state_as_the_python_loops(
    steps: list[tuple[str, Any]], prompts: list[list[int]]
) -> None:
    python, c = both()
    now = 0.0
    for engine, item in steps:
        now += 0.25
        for index in (python, c):
            if isinstance(item, tuple):
                _, prompt, medium, ttl = item
                index.speculate(engine, index.keys(prompt), medium, now, ttl)
            else:
                index.apply(engine, item)
        assert state(c) == state(python)
    for prompt in prompts:
        for medium in MEDIA:
            keys = python.keys(prompt)
            assert c.prefixes(keys, medium, now) == python.prefixes(keys, medium, now)


def core_state(core: Any) -> dict[str, Any]:
    """Every container of a core, with every ordered container's order."""
    return {
        "hashes": [list(d.items()) for d in core._hashes],
        "retired": [list(d.items()) for d in core._retired],
        "present": [{m: list(p.items()) for m, p in d.items()} for d in core._present],
        "speculative": [list(d.items()) for d in core._speculative],
        "holders": {m: sorted(h.items()) for m, h in core._holders.items()},
        "speculating": dict(core._speculating),
    }


core_event_st = st.one_of(
    stored_st().filter(lambda e: e.block_size == BS),
    st.builds(BlocksRemoved, medium_st, st.lists(hash_st, min_size=1, max_size=5).map(tuple)),
    st.builds(BlocksUnkeyable, st.lists(hash_st, min_size=1, max_size=3).map(tuple), medium_st),
    st.just(AllCleared()),
)
core_step_st = st.tuples(
    st.integers(0, 2),
    core_event_st
    | st.tuples(st.just("speculate"), prompt_st, medium_st, st.floats(0.5, 3.0))
    | st.tuples(st.just("forget"), st.booleans()),
)


CORE_ROOT = b"r" * 16


def core_keys(prompt: list[int]) -> tuple[bytes, ...]:
    """The chain keys of a prompt's full blocks from the cores' root."""
    full = len(prompt) - len(prompt) % BS
    return indexloops.chain_keys(CORE_ROOT, array("I", prompt[:full]).tobytes(), 4 * BS)


@needs_native
def test_both_cores_find_a_stored_prefix_by_its_keys() -> None:
    """The keys the differential test below asks with are the ones its stores make."""
    prompt = [1, 2, 0, 1, 2, 2]
    for native_ in (False, True):
        core = indexcore.new_core(
            native_, refcounted=frozenset(), root=CORE_ROOT, unkeyed_prefix=UNKEYED,
            max_blocks=6, max_retired=3, max_speculative=5,
        )
        core.add_engine()
        core.add_engine()
        core.apply(1, BlocksStored.of_ids(MEDIUM_GPU, (7, 8), None, tuple(prompt[:4]), BS),
                   4 * BS)
        core.speculate(0, core_keys(prompt), MEDIUM_GPU, 0.0, 5.0)
        assert core.prefixes(core_keys(prompt), MEDIUM_GPU, 0b11, 1.0) == [(0b10, 2), (0b01, 3)]
        assert core.prefixes(core_keys(prompt), MEDIUM_GPU, 0b11, 6.0) == [(0b10, 2)]


@needs_native
@settings(max_examples=300, deadline=None)
@given(st.lists(core_step_st, max_size=50), st.lists(prompt_st, min_size=1, max_size=3),
       st.integers(0, 7))
def test_the_native_core_answers_as_its_python_reference(
    steps: list[tuple[int, Any]], prompts: list[list[int]], alive: int
) -> None:
    """The core's six methods, called directly on the C core and on its reference: the
    same counts, the same answers, the same containers after every step."""
    cores = [
        indexcore.new_core(
            native_, refcounted=frozenset({MEDIUM_CPU}), root=CORE_ROOT,
            unkeyed_prefix=UNKEYED, max_blocks=6, max_retired=3, max_speculative=5,
        )
        for native_ in (False, True)
    ]
    for core in cores:
        assert [core.add_engine() for _ in range(3)] == [0, 1, 2]
    now = 0.0
    for engine, step in steps:
        now += 0.25
        answers: list[object] = []
        for core in cores:
            if isinstance(step, tuple) and step[0] == "speculate":
                _, prompt, medium, ttl = step
                answers.append(core.speculate(engine, core_keys(prompt), medium, now, now + ttl))
            elif isinstance(step, tuple):
                core.forget(engine, restarted=step[1])
                answers.append(None)
            else:
                answers.append(core.apply(engine, step, 4 * BS))
        assert answers[0] == answers[1]
        assert core_state(cores[1]) == core_state(cores[0])
    for prompt in prompts:
        keys = core_keys(prompt)
        for medium in MEDIA:
            assert cores[1].prefixes(keys, medium, alive, now) == cores[0].prefixes(
                keys, medium, alive, now)
        for engine in range(3):
            assert cores[1].statistics(engine, now) == cores[0].statistics(engine, now)


@needs_native
def test_a_recorded_kind_of_stream_leaves_the_same_state() -> None:
    """A larger stream with vLLM's shapes: chained stores on both media, re-stores, the
    CPU tier's repeated announcements, evictions past the bounds, salted blocks."""
    python, c = both()
    items: list[tuple[str, FeedItem]] = []
    for engine in ENGINES:
        items.append((engine, StreamSynced()))
    for round_ in range(40):
        engine = ENGINES[round_ % 3]
        base = round_ % 5
        chain = tuple(100 * base + i for i in range(4))
        tokens = tuple((base * 7 + i) % 3 for i in range(4 * BS))
        items.append((engine, BlocksStored.of_ids(MEDIUM_GPU, chain, None, tokens, BS)))
        items.append(
            (engine, BlocksStored.of_ids(MEDIUM_CPU, chain[:2], None, tokens[: 2 * BS], BS))
        )
        items.append((engine, BlocksStored.of_ids(MEDIUM_CPU, chain[1:3], chain[0],
                                           tokens[BS : 3 * BS], BS)))
        if round_ % 4 == 3:
            items.append((engine, BlocksUnkeyable((chain[0],), MEDIUM_GPU)))
        items.append((engine, BlocksRemoved(MEDIUM_GPU, chain[2:])))
        items.append((engine, BlocksRemoved(MEDIUM_CPU, chain[:2])))
    for engine, item in items:
        python.apply(engine, item)
        c.apply(engine, item)
        assert state(c) == state(python)


def test_native_true_without_the_extension_names_the_cause(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(index_module, "_native_intake", None)
    with pytest.raises(RuntimeError, match="_intake is not built"):
        PrefixIndex(BS, native=True)
    assert not PrefixIndex(BS).native  # None: the Python loops, quietly


def _core() -> Any:
    """A C core with engine 0 stored in on the GPU."""
    core = indexcore.new_core(
        True, refcounted=frozenset({MEDIUM_CPU}), root=b"r" * 16, unkeyed_prefix=UNKEYED,
        max_blocks=8, max_retired=3, max_speculative=5,
    )
    assert core.add_engine() == 0
    core._medium(0, MEDIUM_GPU)
    return core


UNKEYED = b"kvpeer-unkeyed:"
TOKENS = array("I", (1, 2)).tobytes()


def _args_stored() -> list[Any]:
    return [0, MEDIUM_GPU, b"root", (5,), TOKENS, 4 * BS]


@needs_native
@pytest.mark.parametrize(
    ("position", "value", "error"),
    [
        (0, "0", TypeError),  # an engine is its bit position
        (0, True, TypeError),
        (0, -1, ValueError),
        (0, 1 << 40, ValueError),
        (0, 1, IndexError),  # no such engine
        (1, b"GPU", TypeError),
        (1, MEDIUM_CPU, KeyError),  # never stored in
        (2, "root", TypeError),  # a parent key that is not bytes
        (3, [5], TypeError),
        (4, (1, 2), TypeError),  # tokens come packed (kvevents.BlocksStored.tokens)
        (4, bytearray(TOKENS), TypeError),
        (5, -4, TypeError),
        (5, 1.5, TypeError),
    ],
)
def test_stored_refuses_wrong_types_and_token_ids(position: int, value: Any,
                                                  error: type[Exception]) -> None:
    core = _core()
    args = _args_stored()
    args[position] = value
    with pytest.raises(error):
        core._stored(*args)
    with pytest.raises(TypeError):
        core._stored(*args[:-1])  # too few
    assert not core._holders[MEDIUM_GPU].items()
    core._stored(*_args_stored())  # the core still works
    assert len(core._holders[MEDIUM_GPU].items()) == 1


@needs_native
@pytest.mark.parametrize(
    ("position", "value", "error"),
    [
        (0, "0", TypeError),
        (0, -1, ValueError),
        (0, 3, IndexError),
        (1, None, TypeError),
        (1, "disk", KeyError),
        (2, [1, 2], TypeError),  # block hashes: a list, not a tuple
    ],
)
def test_removed_refuses_wrong_types(position: int, value: Any, error: type[Exception]) -> None:
    core = _core()
    args: list[Any] = [0, MEDIUM_GPU, (1, 2)]
    assert core._removed(*args) == 2  # unknown, both
    args[position] = value
    with pytest.raises(error):
        core._removed(*args)
    with pytest.raises(TypeError):
        core._removed(*args[:-1])


@needs_native
@pytest.mark.parametrize(
    ("corrupt", "loops"),
    [
        (lambda core: core._hashes.__setitem__(0, OrderedDict()), "stored removed"),
        (lambda core: core._retired.__setitem__(0, None), "stored removed"),
        (lambda core: core._present[0].__setitem__(MEDIUM_GPU, [1]), "stored removed"),
        (lambda core: core._present.__setitem__(0, []), "stored removed"),
        (lambda core: core._speculative.__setitem__(0, OrderedDict()), "stored removed"),
        (lambda core: core._speculative.clear(), "stored removed"),  # engine 0 gone there
        (lambda core: core._holders.__setitem__(MEDIUM_GPU, {}), "stored removed"),
        (lambda core: core._present[0].__setitem__(MEDIUM_CPU, [1]), "removed"),  # others
        (lambda core: core._present[0].__setitem__(1, {}), "removed"),  # a medium not a str
    ],
)
def test_corrupt_containers_raise_in_the_loops(corrupt: Any, loops: str) -> None:
    """The loops check every container they fetch from the core before trusting it (a
    dict subclass could run code inside them); the containers cannot be replaced."""
    core = _core()
    core._stored(*_args_stored())
    corrupt(core)
    if "stored" in loops:
        with pytest.raises((TypeError, IndexError)):
            core._stored(*_args_stored())
    with pytest.raises((TypeError, IndexError)):
        core._removed(0, MEDIUM_GPU, (5,))
    with pytest.raises(AttributeError):
        core._hashes = []


@needs_native
def test_the_core_refuses_bad_settings_and_frees_its_containers() -> None:
    assert native is not None
    for args in [(set(), 3, UNKEYED), (frozenset(), "3", UNKEYED), (frozenset(), 3, "x"),
                 (frozenset(), 3)]:
        with pytest.raises(TypeError):
            native.Core(*args)
    for args in [(frozenset(), 0, UNKEYED), (frozenset(), 3, b"")]:
        with pytest.raises(ValueError, match="max_retired >= 1"):
            native.Core(*args)
    core = _core()
    core._stored(*_args_stored())
    hashes, holders = core._hashes, core._holders
    assert sys.getrefcount(hashes) == 3  # the core's, ours, getrefcount's
    del core
    gc.collect()
    assert sys.getrefcount(hashes) == 2
    assert sys.getrefcount(holders) == 2


@needs_native
def test_a_corrupt_mapping_or_speculation_raises_without_leaving_a_holder() -> None:
    """The loop calls no Python code and trusts none of the state it is given: a mapping
    that is not a chain key, or a fulfilled speculation the index has no mask for, is
    an exception, and the block is not marked held."""
    for lie, said in [(42, "not int"), (b"short", "not bytes of another size")]:
        core = _core()
        core._retired[0][5] = lie  # a retired mapping that is not a 16-byte chain key
        with pytest.raises(TypeError, match=f"16-byte chain keys, {said}|chain keys are bytes"):
            core._stored(*_args_stored())
        assert not core._holders[MEDIUM_GPU].items()  # no engine holds the lie
    core = _core()
    key = index_module._chain(b"root", TOKENS)
    core._speculative[0][(MEDIUM_GPU, key)] = 9.0  # speculated by the engine, unknown to the index
    with pytest.raises(KeyError):
        core._stored(*_args_stored())
    for bad_hash in (1.5, "5", None):
        core = _core()
        args = _args_stored()
        args[2] = UNKEYED + b"x"  # an unkeyed parent: the child's key is its hash's
        args[3] = (bad_hash,)
        with pytest.raises(TypeError):
            core._stored(*args)
    core = _core()
    args = _args_stored()
    args[2], args[3] = UNKEYED + b"x", (True, 7, b"h")
    core._stored(*args)
    assert list(core._hashes[0].values()) == [UNKEYED + b"1", UNKEYED + b"7",
                                              UNKEYED + b"h"]  # as b"%d" % True gives 1


@needs_native
def test_tokens_past_the_event_are_sliced_as_python_slices_them() -> None:
    """A store with fewer tokens than its blocks (the decoder refuses such events; the
    loops must still not read past the tokens): each block hashes what is there."""
    python, c = both()
    short = BlocksStored.of_ids(MEDIUM_GPU, (1, 2, 3), None, (1, 2, 0), BS)
    for index in (python, c):
        index.apply("e0", StreamSynced())
        index.apply("e0", short)
    assert state(c) == state(python)


@needs_native
def test_no_reference_is_leaked() -> None:
    """Store, re-store, speculate and remove the same blocks many times: the objects the
    loops handle end with the references they started with."""
    index = PrefixIndex(BS, native=True)
    index.apply("e0", StreamSynced())
    blocks = (1 << 70, 2 << 70, 3 << 70)  # ints outside the small-int cache
    medium = "GPU-" + "x" * 8  # a str of its own, indexed below
    index._media = frozenset({medium})
    tokens = tuple(range(1000, 1000 + 3 * BS))
    event = BlocksStored.of_ids(medium, blocks, None, tokens, BS)
    gone = BlocksRemoved(medium, blocks)
    prompt = index.keys(list(tokens))

    def cycle() -> None:
        index.apply("e0", event)
        index.apply("e0", event)
        index.apply("e0", gone)
        index.speculate("e0", prompt, medium, 0.0, 10.0)
        index.apply("e0", event)  # confirms the speculative entries
        index.apply("e0", gone)

    cycle()
    keys = list(index._core._retired[0].values())  # the index's own chain keys
    assert len(keys) == 3
    watched = (*blocks, medium, event, gone, *prompt.keys, *keys)
    before = [sys.getrefcount(o) for o in watched]
    for _ in range(500):
        cycle()
    assert [sys.getrefcount(o) for o in watched] == before


@pytest.mark.parametrize("built", [True, False])
def test_the_router_says_which_intake_it_runs(
    built: bool, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    if built and native is None:
        pytest.skip("kvpeer.router._intake is not built")
    if not built:
        monkeypatch.setattr(index_module, "_native_intake", None)

    async def scenario() -> None:
        fake = FakeEngine("a")
        await fake.start()
        router = Router(make_config("shared", {"a": (fake, "both")}))
        try:
            await router.start()
        finally:
            await router.stop()
            await fake.stop()

    with caplog.at_level(logging.INFO, logger="kvpeer.router.app"):
        run(scenario())
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "intake" in r.getMessage()]
    if built:
        assert said == [(logging.INFO, "KV event intake: C loops (kvpeer.router._intake)")]
    else:
        assert len(said) == 1
        assert said[0][0] == logging.WARNING
        assert "Python loops" in said[0][1]
        assert "was not built" in said[0][1]


wire_store_st = st.builds(
    events_module._WireStored,
    block_hashes=st.lists(hash_st, min_size=1, max_size=3),
    parent_block_hash=st.none() | hash_st,
    token_ids=st.just(msgspec.Raw(b"\x90")),  # filled to the right length below
    block_size=st.sampled_from((2, 3)),
    lora_id=st.none(),
    medium=st.sampled_from((None, "GPU", "CPU")),
    lora_name=st.none(),
)


def _with_tokens(item: Any, seed: int) -> Any:
    count = len(item.block_hashes) * item.block_size
    ids = [(seed + i) % 7 for i in range(count)]
    return msgspec.structs.replace(item, token_ids=msgspec.Raw(msgspec.msgpack.encode(ids)))


@needs_native
@settings(max_examples=500, deadline=None)
@given(st.lists(wire_store_st, min_size=1, max_size=12))
def test_a_run_of_stores_orders_and_joins_as_the_python_does(items: list[Any]) -> None:
    """Parents first (hostile cycles and hashes named twice included), then joined."""
    run = [_with_tokens(item, i) for i, item in enumerate(items)]
    tokens = [events_module._packed_tokens(item.token_ids) for item in run]
    native_out = events_module._stores_of(list(run), list(tokens))
    saved = events_module._native_intake
    events_module._native_intake = None
    try:
        assert tokens == [events_module._packed_tokens(item.token_ids) for item in run]
        python_out = events_module._stores_of(list(run), list(tokens))
    finally:
        events_module._native_intake = saved
    assert native_out == python_out


@needs_native
def test_stores_of_refuses_what_is_not_a_run() -> None:
    assert native is not None
    with pytest.raises(TypeError):
        native.stores_of([], [])
    with pytest.raises(TypeError):
        native.stores_of((1,), [b""])
    with pytest.raises(TypeError):
        native.stores_of([1], [])  # not as long
    with pytest.raises(TypeError):
        native.stores_of([1], ["tokens"])
    with pytest.raises(AttributeError):
        native.stores_of([object()], [b""])


def _msgpack_int(kind: str, value: int) -> bytes:
    """``value`` in one of msgpack's integer encodings (or a tag that is no integer)."""
    widths = {"u8": (0xCC, 1), "u16": (0xCD, 2), "u32": (0xCE, 4), "u64": (0xCF, 8),
              "i8": (0xD0, 1), "i16": (0xD1, 2), "i32": (0xD2, 4), "i64": (0xD3, 8)}
    if kind == "fixint":
        return bytes([value & 0xFF])  # 0x80-0xdf are no integers, 0xe0-0xff negative
    if kind == "float":
        return b"\xcb" + struct.pack(">d", value)
    tag, width = widths[kind]
    return bytes([tag]) + (value % (1 << 8 * width)).to_bytes(width, "big")


_token_item_st = st.tuples(
    st.sampled_from(("fixint", "u8", "u16", "u32", "u64", "i8", "i16", "i32", "i64", "float")),
    st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1)
    | st.integers(min_value=0, max_value=300),
)


@needs_native
@settings(max_examples=1000, deadline=None)
@given(
    items=st.lists(_token_item_st, max_size=20),
    header=st.sampled_from(("fix", "16", "32", "map")),
    count_off=st.sampled_from((0, 0, 0, -1, 1, 1 << 20)),
    tail=st.sampled_from((b"", b"", b"\x00", b"\xc0")),
    cut=st.integers(min_value=0, max_value=3),
)
def test_token_ids_are_checked_and_packed_as_msgspec_does(
    items: list[tuple[str, int]], header: str, count_off: int, tail: bytes, cut: int
) -> None:
    """A peer's token ids, however encoded (any integer width, signed or not, negative,
    too large, not integers, a count that lies, bytes after, cut short): the C parser
    packs exactly what msgspec accepts and refuses the rest with a ValueError, which
    names the fault as the Python path names it (events._token_fault)."""
    count = max(0, len(items) + count_off)
    head = {"fix": bytes([0x90 | min(count, 15)]),
            "16": b"\xdc" + (count & 0xFFFF).to_bytes(2, "big"),
            "32": b"\xdd" + count.to_bytes(4, "big"),
            "map": bytes([0x80 | min(count, 15)])}[header]
    raw = head + b"".join(_msgpack_int(kind, value) for kind, value in items) + tail
    raw = raw[: len(raw) - cut] if cut < len(raw) else raw
    outcomes: list[bytes | str] = []
    for loops in (native, None):
        saved = events_module._native_intake
        events_module._native_intake = loops
        try:
            outcomes.append(events_module._packed_tokens(msgspec.Raw(raw)))
        except ValueError as exc:
            outcomes.append(str(exc))
        finally:
            events_module._native_intake = saved
    assert outcomes[0] == outcomes[1], raw.hex()


@needs_native
def test_token_id_errors_name_what_is_wrong() -> None:
    assert native is not None
    enc = msgspec.msgpack.encode
    assert native.msgpack_tokens(enc([0, 127, 255, 65_536, (1 << 32) - 1]), 5) == array(
        "I", (0, 127, 255, 65_536, (1 << 32) - 1)).tobytes()
    for raw, said in [
        (enc([1, -1]), "token id 1 is negative"),
        (b"\x92\x01\xd0\xff", "token id 1 is negative"),  # int8 -1
        (enc([1 << 32]), "token id 0 is above 2\\*\\*32 - 1"),
        (enc([1.0]), "token id 0 is not an integer"),
        (enc(["1"]), "token id 0 is not an integer"),
        (enc({"a": 1}), "expected an array"),
        (b"", "expected an array"),
        (enc([1, 2, 3]), "3 token ids: more than allowed"),
        (b"\xdc\x00\x05\x01", "more than the payload holds"),
        (b"\x91\xce\x00\x01", "token id 0 is cut short"),
        (enc([1]) + b"\x01", "bytes after the token ids"),
    ]:
        limit = 2 if said.startswith("3 token") else 10
        with pytest.raises(ValueError, match=said):
            native.msgpack_tokens(raw, limit)
        assert re.search(said, events_module._token_fault(raw, limit) or "")
    with pytest.raises(TypeError):
        native.msgpack_tokens("not a buffer", 10)
    with pytest.raises(TypeError):
        native.msgpack_tokens(enc([1]))


_holder_op_st = st.tuples(
    st.sampled_from(("set", "set", "clear", "get")),
    st.integers(0, 60),  # which of 61 keys: small tables, long probe runs, shifts
    st.sampled_from((0, 1, 2, 63, 64, 65, 130, 300)),  # engine bits past one mask word
)


@needs_native
@settings(max_examples=300, deadline=None)
@given(st.lists(_holder_op_st, max_size=400))
def test_the_holders_table_answers_as_a_dict_of_masks(ops: list[tuple[str, int, int]]) -> None:
    """The C table (open addressing, backward-shift deletion, growing and shrinking,
    masks wider than a word) against the Python reference, op by op."""
    assert native is not None
    keys = [index_module._chain(b"k", bytes([i])) for i in range(61)]
    table, reference = native.Holders(), indexloops.Holders()
    for op, at, bit in ops:
        key = keys[at]
        if op == "set":
            table.set_bit(key, bit)
            reference.set_bit(key, bit)
        elif op == "clear":
            outcomes = []
            for masks in (table, reference):
                try:
                    masks.clear_bit(key, bit)
                    outcomes.append("cleared")
                except KeyError:
                    outcomes.append("KeyError")
            assert outcomes[0] == outcomes[1]
        assert table.get(key) == reference.get(key)
        assert len(table) == len(reference)
    assert dict(table.items()) == dict(reference.items())
    assert all(table.get(key, -1) == reference.get(key, -1) for key in keys)


@needs_native
def test_the_holders_table_refuses_what_is_not_a_chain_key_or_a_bit() -> None:
    assert native is not None
    table = native.Holders()
    key = index_module._chain(b"k", b"v")
    for bad in (b"short", "a" * 16, 16, b"x" * 17):
        with pytest.raises(TypeError, match="16-byte chain keys"):
            table.set_bit(bad, 0)
        with pytest.raises(TypeError, match="16-byte chain keys"):
            table.get(bad)
    for bad_bit in (-1, 1 << 20, 1 << 70):
        with pytest.raises((ValueError, OverflowError)):
            table.set_bit(key, bad_bit)
    with pytest.raises(TypeError):
        table.set_bit(key, "0")
    with pytest.raises(KeyError):
        table.clear_bit(key, 0)  # never set
    table.set_bit(key, 3)
    with pytest.raises(KeyError):
        table.clear_bit(key, 4)  # held, but not by this engine
    with pytest.raises(TypeError):
        native.Holders(1)
    empty = sys.getsizeof(native.Holders())
    for i in range(1000):
        table.set_bit(index_module._chain(b"k", i.to_bytes(2, "big")), 300)
    assert sys.getsizeof(table) > empty + 1000 * 16  # the table is counted (router-scale)
    for i in range(1000):
        table.clear_bit(index_module._chain(b"k", i.to_bytes(2, "big")), 300)
    assert len(table) == 1
    assert sys.getsizeof(table) < empty + 4096  # and shrinks as keys leave


@needs_native
@settings(max_examples=500, deadline=None)
@given(parent=st.binary(max_size=40), tokens=st.binary(max_size=400),
       width=st.integers(1, 300))
def test_chain_keys_in_c_are_hashlibs_sha256(parent: bytes, tokens: bytes, width: int) -> None:
    """OpenSSL's SHA-256 through the extension against hashlib's, truncated to 16 bytes,
    across SHA-256's block boundaries (64 bytes) and widths that leave a short last key."""
    assert native is not None
    assert native.chain(parent, tokens) == hashlib.sha256(parent + tokens).digest()[:16]
    assert native.chain(parent, tokens) == indexloops.chain(parent, tokens)
    assert native.chain_keys(parent, tokens, width) == indexloops.chain_keys(
        parent, tokens, width)


@needs_native
def test_the_holders_table_spreads_keys_that_are_not_chain_keys() -> None:
    """Keys placed by their own bits: counters that differ only in their last word, or
    only in their first, still answer as the reference does (the mix spreads both)."""
    assert native is not None
    table, reference = native.Holders(), indexloops.Holders()
    keys = [i.to_bytes(16, "big") for i in range(3000)]
    keys += [(i << 64).to_bytes(16, "big") for i in range(1, 3000)]
    for i, key in enumerate(keys):
        table.set_bit(key, i % 70)
        reference.set_bit(key, i % 70)
    assert len(table) == len(reference) == len(keys)
    assert all(table.get(key) == reference.get(key) for key in keys)
    for i, key in enumerate(keys[::2]):
        table.clear_bit(key, (2 * i) % 70)
        reference.clear_bit(key, (2 * i) % 70)
    assert dict(table.items()) == dict(reference.items())


def test_chain_keys_are_each_router_processs_own() -> None:
    """The attacker's view: the same prompt keys differently in two router processes, and
    neither key is one anybody can compute from public constants (no root known, no
    key aimed at). Also without the extension: the Python reference uses the same root."""
    script = (
        "from kvpeer.router.index import PrefixIndex, _ROOT\n"
        "from kvpeer.router.indexloops import chain\n"
        "from kvpeer.router.kvevents import BlocksStored\n"
        "index = PrefixIndex()\n"
        "index.apply('e', BlocksStored.of_ids('GPU', (1,), None, list(range(16)), 16))\n"
        "key = index.keys(list(range(16))).keys[0]\n"
        "tokens = b''.join(i.to_bytes(4, 'little') for i in range(16))\n"
        "assert key == chain(_ROOT, tokens)\n"
        "print(key.hex(), _ROOT.hex())\n"
    )
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           check=True).stdout.split() for _ in range(2)]
    (key_a, root_a), (key_b, root_b) = runs
    assert key_a != key_b
    assert root_a != root_b
    tokens = b"".join(i.to_bytes(4, "little") for i in range(16))
    for public_root in (b"", b"kvpeer-router-chain-root", bytes(16)):
        guess = hashlib.sha256(public_root + tokens).digest()[:16].hex()
        assert guess not in (key_a, key_b)


@needs_native
def test_chain_refuses_what_is_not_bytes() -> None:
    assert native is not None
    for args in [("p", b"t"), (b"p", bytearray(b"t")), (b"p",)]:
        with pytest.raises(TypeError):
            native.chain(*args)
    for bad in [(b"p", b"t", 0), (b"p", b"t", -1), (b"p", "t", 4), (b"p", b"t")]:
        with pytest.raises(TypeError):
            native.chain_keys(*bad)
    assert index_module._chain is native.chain  # the stored loop's fast path


def _raw(ids: list[int]) -> msgspec.Raw:
    return msgspec.Raw(msgspec.msgpack.encode(ids))


_small_hash_st = st.sampled_from([b"\x01" * 8, b"\x02" * 8, b"\x03" * 8, 4, 5])
_wire_event_st = st.one_of(
    st.builds(
        events_module._WireStored,
        block_hashes=st.lists(_small_hash_st, max_size=3),
        parent_block_hash=st.none() | _small_hash_st,
        token_ids=st.one_of(
            st.lists(st.integers(0, 9), max_size=6).map(_raw),
            st.just(_raw([-1, 2])), st.just(msgspec.Raw(b"\xc0")),
        ),
        block_size=st.sampled_from((0, 1, 2)),
        lora_id=st.none() | st.just(3),
        medium=st.sampled_from((None, "", "GPU", "CPU")),
        lora_name=st.none() | st.just("a"),
        extra_keys=st.none() | st.lists(st.none() | st.just(("salt",)), max_size=2),
        group_idx=st.none() | st.sampled_from((0, 1)),
        ownership=st.none() | st.just("kvcr"),
        kv_cache_spec_kind=st.none() | st.sampled_from(("mamba", "full_attention")),
    ),
    st.builds(
        events_module._WireRemoved,
        block_hashes=st.lists(_small_hash_st, max_size=3),
        medium=st.sampled_from((None, "", "GPU", "CPU")),
        group_idx=st.none() | st.sampled_from((0, 2)),
        ownership=st.none() | st.just("kvcr"),
    ),
    st.just(events_module._WireCleared()),
)


@needs_native
@settings(max_examples=1000, deadline=None)
@given(st.lists(_wire_event_st, max_size=14))
def test_a_batch_translates_as_the_python_loop_does(wire: list[Any]) -> None:
    """The C translation of a batch's wire events (runs of removals joined, stores
    checked, skipped, named unkeyable, ordered and joined; the first malformed store
    rejecting the batch) against events.py's Python loop, event for event."""
    assert native is not None
    events, skipped, rejected = native.translate(
        list(wire), events_module._CLASSES, events_module.MAX_TOKENS_PER_EVENT)
    reference = events_module._translate(list(wire))
    if isinstance(reference, BatchRejected):
        assert rejected == (reference.reason, reference.detail)
        assert (events, skipped) == ([], {})
    else:
        assert rejected is None
        assert (events, skipped) == (reference[0], reference[1])


@needs_native
def test_translate_refuses_what_is_not_a_batch() -> None:
    assert native is not None
    classes = events_module._CLASSES
    with pytest.raises(TypeError):
        native.translate((), classes, 10)
    with pytest.raises(TypeError):
        native.translate([], classes[:6], 10)
    with pytest.raises(TypeError):
        native.translate([], (*classes[:6], "not a class"), 10)
    with pytest.raises(TypeError, match="event 0 is a int"):
        native.translate([1], classes, 10)


def _payload(*events: dict[str, Any]) -> bytes:
    return msgspec.msgpack.encode([1.0, list(events)])


def _store(hashes: list[Any], parent: Any, tokens: list[int], **extra: Any) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": 2, "lora_id": None, "medium": "CPU",
            "lora_name": None, **extra}


@needs_native
def test_decoding_in_c_leaks_nothing_on_any_path() -> None:
    """Valid batches (runs joined, removals joined, unkeyable, skipped, cleared) and
    rejected ones (bad token ids, counts, empty stores), decoded over and over: the
    memory Python traces stays where it was."""
    gone = {"type": "BlockRemoved", "block_hashes": [b"a" * 32], "medium": "GPU"}
    payloads = [
        _payload(_store([b"b" * 32], b"a" * 32, [3, 4]), _store([b"a" * 32], None, [1, 2]),
                 gone, gone, {"type": "AllBlocksCleared"}),
        _payload(_store([7, 8], None, [1, 2, 3, 70_000], extra_keys=[None, ("salt",)]),
                 _store([9], None, [1, 2], lora_id=1, lora_name="a"),
                 _store([9], None, [], block_size=0), {**gone, "group_idx": 1}),
        _payload(gone, _store([1], None, [1, -2])),
        _payload(_store([1], None, [1, 2, 3])),
        _payload(_store([], None, [])),
        _payload(_store([1], None, [1, 2], token_ids=[1.5, 2])),
    ]
    decoded = [events_module.decode_batch(p) for p in payloads]
    assert [type(d).__name__ for d in decoded] == [
        "BatchDecoded", "BatchDecoded", "BatchRejected", "BatchRejected", "BatchRejected",
        "BatchRejected"]
    assert native is not None
    table = native.Holders()
    keys = [index_module._chain(b"k", bytes([i])) for i in range(200)]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(300):
            for payload in payloads:
                events_module.decode_batch(payload)
            for key in keys:
                table.set_bit(key, 70)
            for key in keys:
                table.clear_bit(key, 70)
            native.chain_keys(b"root", bytes(range(64)), 8)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 20_000, grown
    assert len(table) == 0


_AT_THE_EDGE = r"""
import ctypes, mmap, sys
import msgspec
from kvpeer.router import _intake

page = mmap.PAGESIZE
memory = mmap.mmap(-1, 2 * page)
base = ctypes.addressof(ctypes.c_char.from_buffer(memory))
libc = ctypes.CDLL(None, use_errno=True)
libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
if libc.mprotect(base + page, page, 0) != 0:  # PROT_NONE: reading it kills the process
    sys.exit("mprotect failed")
view = memoryview(memory)
encodings = [msgspec.msgpack.encode(ids) for ids in (
    [1, 300, 70_000, 2**32 - 1], [2**40], [-1, -300, -70_000], list(range(20)), [1.5])]
encodings += [b"\x92\xcc\x01", b"\x93\xcd\x00\x01\xce", b"\xdc\x00\x03\xce\x00",
              b"\xdd\x00\x00\x00\x02\xcf\x00", b"\x91\xd3\x00"]
tried = 0
for encoding in encodings:
    for cut in range(1, len(encoding) + 1):
        blob = encoding[:cut]
        view[page - len(blob) : page] = blob  # flush against the page no one may read
        try:
            _intake.msgpack_tokens(view[page - len(blob) : page], 1 << 20)
        except ValueError:
            pass
        tried += 1
print(tried)
"""


@needs_native
def test_token_ids_flush_against_unreadable_memory_are_never_read_past() -> None:
    """Every prefix of many token-id encodings, placed so that its last byte is the last
    readable one: a read past it kills the process. (`\\x92\\xcc\\x01` -- two ids, the
    first taking two of the three bytes left -- was read one byte past its end, found by
    valgrind; a count no larger than the bytes left does not make every item's tag be
    there.)"""
    run = subprocess.run([sys.executable, "-c", _AT_THE_EDGE], capture_output=True,
                         text=True, timeout=120, check=False)
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    assert int(run.stdout) > 80
