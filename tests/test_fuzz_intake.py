"""The intake's fuzz target (kvpeer.lab.fuzz.intake, run by scripts/fuzz-intake under
atheris) without atheris: every seed and every input a fuzzing run has found passes
``check`` (the C intake decides as its Python reference), with the normal build of the
extension. A new finding goes into FOUND once its cause is fixed."""

from __future__ import annotations

import math
from pathlib import Path

import msgspec
import pytest

from kvpeer.lab.fuzz import intake
from kvpeer.router import events

pytestmark = pytest.mark.skipif(
    events._native_intake is None, reason="kvpeer.router._intake is not built"
)  # KVPEER_REQUIRE=native (scripts/test) fails the run before this skips

#: Inputs fuzzing runs found, as (what it was, the input in hex).
FOUND = [
    # scripts/fuzz-intake, 2026-12-07: a batch whose time is NaN (0xcb ff..ff 00) took the
    # target's equality for a disagreement (NaN != NaN); C and Python decoded it alike.
    ("nan timestamp, salted, LoRA, other-group and empty stores",
     "0192cbffffffffffffff009489a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368"
     "6573920708b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69647394010203ce0001"
     "1170aa626c6f636b5f73697a6502a76c6f72615f6964c0a66d656469756da3435055a96c6f72615f6e"
     "616d65c0aa65786174725f6b65797392c091a473616c7488a474797065ab426c6f636b53746f726564"
     "ac626c6f636b5f6861736865739109b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f"
     "696473920102aa626c6f636b5f73697a6502a76c6f72615f696401a66d656469756da3435055a96c6f"
     "72615f6e616d65a16188a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391"
     "09b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69647390aa626c6f636b5f73697a"
     "6500a76c6f72615f6964c0a66d656469756da3435055a96c6f72615f6e616d65c084a474797065ac42"
     "6c6f636b52656d6f766564ac626c6f636b5f68617368657391c4206161616161616161616161616161"
     "616161616161616161616161616161616161a66d656469756da3475055a967726f75705f69647801"),
]


def test_every_seed_passes_the_target() -> None:
    seeds = list(intake.seeds())
    assert {name.split("-")[0] for name, _ in seeds} == {"batch", "tokens"}
    assert len(seeds) > 20  # the recorded stream's batches and their stores' token ids
    for _, data in seeds:
        intake.check(data)


@pytest.mark.parametrize(("what", "found"), FOUND, ids=[what for what, _ in FOUND])
def test_every_found_input_passes_the_target(what: str, found: str) -> None:
    intake.check(bytes.fromhex(found))


def test_a_nan_time_is_no_disagreement_but_a_real_one_is() -> None:
    batch = msgspec.msgpack.encode([math.nan, []])
    intake.check(bytes([intake.BATCH]) + batch)
    # The target does catch a C intake that decides otherwise: here one that drops a
    # token id the Python path packs.
    saved = events._native_intake

    class Dropping:
        def __getattr__(self, name: str) -> object:
            return getattr(saved, name)

        @staticmethod
        def msgpack_tokens(raw: bytes, limit: int) -> bytes:
            assert saved is not None
            packed: bytes = saved.msgpack_tokens(raw, limit)
            return packed[4:]

    events._native_intake = Dropping()  # type: ignore[assignment]
    try:
        with pytest.raises(intake.IntakeMismatch):
            intake.check(bytes([intake.TOKENS]) + msgspec.msgpack.encode([1, 2, 3]))
    finally:
        events._native_intake = saved


def test_the_seeds_are_written_for_libfuzzer(tmp_path: Path) -> None:
    directory = tmp_path / "seeds"
    count = intake.write_seeds(directory)
    assert count == len(list(directory.iterdir())) == len(list(intake.seeds()))
