"""The prefix index: engine hashes mapped onto token chains, per engine and medium."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from kvpeer.router.feed import EventFeed, StreamReset, StreamSynced
from kvpeer.router.index import MEDIUM_CPU, MEDIUM_GPU, PrefixIndex
from kvpeer.router.kvevents import AllCleared, BlocksRemoved, BlocksStored

BS = 4
PROMPT = list(range(100, 116))  # four full blocks


def hashes(n: int, salt: int = 0) -> tuple[int, ...]:
    """Engine hashes: opaque to the index, unlike ours (salted per engine process)."""
    return tuple(salt * 1000 + 7 * i + 3 for i in range(n))


def store(
    blocks: range, medium: str = MEDIUM_GPU, salt: int = 0, prompt: list[int] = PROMPT
) -> BlocksStored:
    hs = hashes(len(prompt) // BS, salt)
    parent = hs[blocks.start - 1] if blocks.start else None
    tokens = tuple(prompt[blocks.start * BS : blocks.stop * BS])
    return BlocksStored.of_ids(medium, hs[blocks.start : blocks.stop], parent, tokens, BS)


def learned_index(*engines: str) -> PrefixIndex:
    index = PrefixIndex(block_size=BS)
    for engine in engines:
        index.apply(engine, StreamSynced())
    return index


def held(index: PrefixIndex, engine: str, medium: str = MEDIUM_GPU, now: float = 0.0) -> int:
    return index.longest_prefix(engine, index.keys(PROMPT), medium, now)


def test_chained_stores_resolve_the_prompt_prefix_per_medium() -> None:
    index = learned_index("e0")
    index.apply("e0", store(range(0, 2)))
    index.apply("e0", store(range(2, 3)))  # chained through its parent's hash
    index.apply("e0", store(range(0, 1), MEDIUM_CPU))
    assert held(index, "e0") == 12
    assert held(index, "e0", MEDIUM_CPU) == 4
    assert index.longest_prefix("e0", index.keys([*PROMPT[:8], 0, 0, 0, 0]), MEDIUM_GPU, 0) == 8


def test_same_tokens_match_across_engines_with_different_hashes() -> None:
    index = learned_index("e0", "e1")
    index.apply("e0", store(range(0, 4), salt=1))
    index.apply("e1", store(range(0, 2), salt=2))
    assert (held(index, "e0"), held(index, "e1")) == (16, 8)


def test_a_removed_block_ends_the_prefix() -> None:
    index = learned_index("e0")
    index.apply("e0", store(range(0, 4)))
    index.apply("e0", BlocksRemoved(MEDIUM_GPU, (hashes(4)[1],)))
    assert held(index, "e0") == 4


def test_cpu_announcements_are_reference_counted_gpu_ones_are_not() -> None:
    index = learned_index("e0")
    for medium in (MEDIUM_GPU, MEDIUM_CPU):
        index.apply("e0", store(range(0, 2), medium))
        index.apply("e0", store(range(0, 2), medium))  # announced twice
        index.apply("e0", BlocksRemoved(medium, hashes(4)[:2]))
    assert held(index, "e0", MEDIUM_GPU) == 0  # the prefix cache removes once
    assert held(index, "e0", MEDIUM_CPU) == 8  # one chunk still holds them


def test_orphans_unknown_removals_and_other_block_sizes_are_counted() -> None:
    index = learned_index("e0")
    index.apply("e0", store(range(2, 3)))  # parent never seen: cannot be placed
    index.apply("e0", BlocksRemoved(MEDIUM_GPU, (999,)))
    index.apply("e0", BlocksStored.of_ids(MEDIUM_GPU, (5,), None, (1, 2), 2))
    index.apply("e0", BlocksStored.of_ids("STORAGE", (6,), None, (1, 2, 3, 4), BS))
    counts = dict(index.statistics(0.0).counts)
    assert counts == {
        "orphans": 1,
        "unknown_removed": 1,
        "block_size_mismatch": 1,
        "ignored_medium": 1,
    }
    assert held(index, "e0") == 0


def test_unlearned_engine_answers_nothing() -> None:
    index = PrefixIndex(block_size=BS)
    index.apply("e0", store(range(0, 4)))  # events before the stream synced
    assert not index.learned("e0")
    assert held(index, "e0") == 0
    index.apply("e0", StreamSynced())
    assert held(index, "e0") == 16


def test_gap_reset_forgets_blocks_but_keeps_the_hash_mapping() -> None:
    index = learned_index("e0")
    index.apply("e0", store(range(0, 2)))
    index.apply("e0", StreamReset("gap", restarted=False))
    assert not index.learned("e0")
    index.apply("e0", StreamSynced())
    assert held(index, "e0") == 0
    index.apply("e0", store(range(2, 3)))  # same process: its parent hash still maps
    index.apply("e0", store(range(0, 2)))
    assert held(index, "e0") == 12


def test_restart_forgets_everything_including_hashes() -> None:
    index = learned_index("e0")
    index.apply("e0", store(range(0, 2)))
    index.forget("e0")
    assert not index.learned("e0")
    index.apply("e0", StreamSynced())
    index.apply("e0", store(range(2, 3)))  # a new process: the old parent means nothing
    assert dict(index.statistics(0.0).counts)["orphans"] == 1
    assert held(index, "e0") == 0


def test_all_blocks_cleared_forgets_every_medium() -> None:
    index = learned_index("e0")
    index.apply("e0", store(range(0, 2)))
    index.apply("e0", store(range(0, 2), MEDIUM_CPU))
    index.apply("e0", AllCleared())
    assert (held(index, "e0"), held(index, "e0", MEDIUM_CPU)) == (0, 0)
    assert index.learned("e0")


def test_speculative_entries_expire_or_are_confirmed() -> None:
    index = learned_index("e0")
    index.speculate("e0", index.keys(PROMPT[:8]), MEDIUM_GPU, now=10.0, ttl=5.0)
    assert held(index, "e0", now=14.9) == 8
    assert held(index, "e0", now=15.0) == 0
    index.speculate("e0", index.keys(PROMPT[:8]), MEDIUM_GPU, now=20.0, ttl=5.0)
    index.apply("e0", store(range(0, 1)))  # confirms block 0 only
    assert held(index, "e0", now=21.0) == 8
    assert held(index, "e0", now=30.0) == 4
    assert held(index, "e0", MEDIUM_CPU, now=21.0) == 0


def test_memory_is_bounded_oldest_first() -> None:
    index = PrefixIndex(block_size=BS, max_blocks=2, max_speculative=3)
    index.apply("e0", StreamSynced())
    index.apply("e0", store(range(0, 4)))
    assert dict((m, n) for _, m, n in index.statistics(0.0).blocks) == {MEDIUM_GPU: 2}
    assert held(index, "e0") == 0  # the first blocks went first
    index.speculate("e1", index.keys(PROMPT), MEDIUM_GPU, now=0.0, ttl=1.0)
    assert dict(index.statistics(0.0).speculative)["e1"] == 3


def test_block_size_is_adopted_from_the_first_store_when_not_configured() -> None:
    index = PrefixIndex()
    assert index.keys(PROMPT).keys == ()
    index.apply("e0", StreamSynced())
    index.apply("e0", store(range(0, 2)))
    assert index.block_size == BS
    assert held(index, "e0") == 8


def test_prompt_tokens_outside_the_vocabulary_range_stop_the_keys() -> None:
    index = PrefixIndex(block_size=BS)
    assert len(index.keys([1, 2, 3, 4, -1, 2, 3, 4]).keys) == 1
    assert len(index.keys([1, 2, 3, 4, 2**40, 2, 3, 4]).keys) == 1


def test_invalid_block_size_is_refused() -> None:
    with pytest.raises(ValueError, match="block_size"):
        PrefixIndex(block_size=0)


# --- a stream recorded from a real vLLM 0.32 engine ----------------------------------------

RECORDING = Path(__file__).parent / "data" / "vllm-0.32-stream.msgpack"


def recorded() -> tuple[dict[str, list[int]], int, list[tuple[int, bytes]]]:
    """Prompts A, A2 (A's first 4 blocks + 2 more), B; frames: A, A2, reset, B, B."""
    data = msgspec.msgpack.decode(RECORDING.read_bytes())
    frames = [(int(seq), bytes(payload)) for seq, payload in data["frames"]]
    return data["prompts"], int(data["block_size"]), frames


def follow(index: PrefixIndex, feed: EventFeed, frames: list[tuple[int, bytes]]) -> None:
    for seq, payload in frames:
        for item in feed.on_live([b"", seq.to_bytes(8, "big"), payload], 0.0).items:
            index.apply("e0", item)


@pytest.mark.parametrize("media", [(MEDIUM_GPU, MEDIUM_CPU), (MEDIUM_CPU,)])
def test_recorded_vllm_stream_resolves_prompts_per_medium(media: tuple[str, ...]) -> None:
    prompts, block_size, frames = recorded()
    index = PrefixIndex(block_size=block_size, media=media)
    a2 = index.keys(prompts["A2"])
    feed = EventFeed(can_replay=False)
    follow(index, feed, frames[:4])  # A, then A2: six blocks on GPU and in the CPU tier
    assert feed.statistics().dropped == ()
    for medium in media:
        assert index.longest_prefix("e0", a2, medium, 0.0) == 6 * block_size
    # Without GPU events the CPU tier's own, unordered stores must still chain.
    assert "orphans" not in dict(index.statistics(0.0).counts)

    follow(index, feed, frames[4:])  # the prefix-cache reset, then B twice
    b = index.keys(prompts["B"])
    for medium in media:
        assert index.longest_prefix("e0", a2, medium, 0.0) == 0
        assert index.longest_prefix("e0", b, medium, 0.0) == 3 * block_size


def test_mappings_of_blocks_gone_from_every_medium_are_retired_and_bounded() -> None:
    """A router follows engines for days: the hash mappings of blocks no medium holds
    any more must not pile up (kvpeer soak found ~184 bytes per evicted block)."""
    index = PrefixIndex(BS, max_retired=2)
    index.apply("e0", StreamSynced())
    index.apply("e0", store(range(0, 2)))
    index.apply("e0", store(range(0, 1), MEDIUM_CPU))
    first, second = hashes(2)
    index.apply("e0", BlocksRemoved(MEDIUM_GPU, (first, second)))
    assert held(index, "e0") == 0
    assert held(index, "e0", MEDIUM_CPU) == 4  # the first block is still in the CPU tier
    assert dict(index.statistics(0.0).hash_mappings) == {"e0": 2}
    index.apply("e0", store(range(2, 3)))  # its parent (block 1) is retired: it attaches
    assert dict(index.statistics(0.0).counts).get("orphans", 0) == 0
    index.apply("e0", BlocksRemoved(MEDIUM_CPU, (first,)))
    index.apply("e0", BlocksRemoved(MEDIUM_GPU, (hashes(3)[2],)))
    # three blocks left every medium; only the two most recent mappings stay
    assert dict(index.statistics(0.0).hash_mappings) == {"e0": 2}
    index.apply("e0", store(range(2, 3)))  # its parent's (block 1) mapping went first
    assert dict(index.statistics(0.0).counts)["orphans"] == 1


def test_expired_speculative_entries_go_at_the_next_speculation() -> None:
    """Not only past ``max_speculative``: a router sending thousands of requests a
    minute would otherwise hold ``max_speculative`` entries per engine for ever."""
    index = learned_index("e0")
    index.speculate("e0", index.keys(PROMPT[:8]), MEDIUM_GPU, now=10.0, ttl=5.0)
    index.speculate("e0", index.keys(PROMPT[8:16]), MEDIUM_GPU, now=12.0, ttl=5.0)
    assert dict(index.statistics(12.0).speculative) == {"e0": 4}
    index.speculate("e0", index.keys(PROMPT[:4]), MEDIUM_CPU, now=16.0, ttl=5.0)
    stats = index.statistics(0.0)  # at time 0 every entry still kept counts as live
    assert dict(stats.speculative) == {"e0": 3}  # the two of t=10 went, t=12's stay


def test_salted_blocks_offloaded_to_the_cpu_tier_are_not_keyed() -> None:
    """What ``kvpeer soak`` found (invariant 6): a prompt computed again under a cache salt
    is announced with ``extra_keys`` by the GPU prefix cache but by vLLM's CPU tier
    without them. Keyed by its tokens, the salted copy would pass for the unsalted
    prompt, its removal would remove the real block, and its hash mappings would pile up
    (one per block, never retired)."""
    from kvpeer.router.kvevents import BlocksUnkeyable

    index = PrefixIndex(BS, max_retired=8)
    index.apply("e0", StreamSynced())
    index.apply("e0", store(range(0, 4)))  # the prompt itself, unsalted, on GPU
    salted = hashes(4, salt=9)
    for _ in range(50):  # fifty references of the same prompt, each with its own salt
        index.apply("e0", BlocksUnkeyable(salted))  # the GPU store with extra_keys
        tokens = tuple(PROMPT)  # the CPU tier's stores carry no extra keys:
        index.apply("e0", BlocksStored.of_ids(MEDIUM_CPU, salted[:2], None, tokens[: 2 * BS], BS))
        index.apply(
            "e0", BlocksStored.of_ids(MEDIUM_CPU, salted[2:], salted[1], tokens[2 * BS :], BS)
        )
        if _ == 0:  # held, under keys no prompt has
            stats = index.statistics(0.0)
            assert dict(((e, m), n) for e, m, n in stats.blocks)[("e0", MEDIUM_CPU)] == 4
            assert held(index, "e0", MEDIUM_CPU) == 0
        index.apply("e0", BlocksRemoved(MEDIUM_CPU, salted))
        index.apply("e0", BlocksRemoved(MEDIUM_GPU, salted))
        salted = tuple(h + 100_000 for h in salted)

    assert held(index, "e0") == 16  # the unsalted prompt is still held on GPU
    assert held(index, "e0", MEDIUM_CPU) == 0  # and was never in the CPU tier
    # The four live blocks and the eight most recently removed: the salted copies are
    # forgotten as the engine removes them, like any block (invariant 2).
    assert dict(index.statistics(0.0).hash_mappings) == {"e0": 4 + 8}
    assert dict(index.statistics(0.0).counts)["unkeyable_stores"] == 100


def test_a_salted_block_stays_unkeyed_until_it_is_forgotten() -> None:
    """Held under extra keys, a hash keeps its unkeyed key on every medium and passes it
    to its children, also while it is retired; a restart forgets it (its hashes mean
    something else in the new process)."""
    from kvpeer.router.kvevents import BlocksUnkeyable

    index = learned_index("e0")
    index.apply("e0", BlocksUnkeyable((1, 2), MEDIUM_GPU))
    index.apply("e0", BlocksRemoved(MEDIUM_GPU, (1, 2)))  # retired, still known
    index.apply("e0", BlocksStored.of_ids(MEDIUM_CPU, (1,), None, tuple(PROMPT[:BS]), BS))
    index.apply("e0", BlocksStored.of_ids(MEDIUM_CPU, (5,), 2, tuple(PROMPT[BS : 2 * BS]), BS))
    assert held(index, "e0", MEDIUM_CPU) == 0
    assert dict(index.statistics(0.0).counts)["unkeyable_stores"] == 2
    index.apply("e0", BlocksUnkeyable((7,), "NVMe"))  # a medium the index does not follow
    assert dict(index.statistics(0.0).counts)["ignored_medium"] == 1
    index.forget("e0")
    index.apply("e0", StreamSynced())
    index.apply("e0", BlocksStored.of_ids(MEDIUM_CPU, (1,), None, tuple(PROMPT[:BS]), BS))
    assert held(index, "e0", MEDIUM_CPU) == BS
    assert dict(index.statistics(0.0).counts)["unkeyable_stores"] == 2
