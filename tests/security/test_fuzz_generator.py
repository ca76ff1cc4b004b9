"""The hostile-frame generator: deterministic per seed, and it covers what it claims to.

Pure and fast: no node, no sockets. What the frames do to a real node is
``test_fuzz_node.py``'s business.
"""

from __future__ import annotations

import msgspec
import pytest

from kvpeer.errors import ProtocolError
from kvpeer.lab.fuzz import wire
from kvpeer.lab.fuzz.fuzz_peers import normalize_reason
from kvpeer.lab.fuzz.generator import MESSAGE_TYPES, SCENARIOS, Case, FrameGenerator, Target
from kvpeer.lab.fuzz.hostile import HOSTILE_ACKS, HOSTILE_CONNECTS
from kvpeer.lab.fuzz.mutations import SCHEMAS
from kvpeer.lab.fuzz.process import deaths_in
from kvpeer.protocol import Codec, Connect, ConnectAck, UnknownMessage, limits

CODEC = Codec()
SAMPLE = 60_000  # enough cases that every rare label shows up


def target(**overrides: object) -> Target:
    values: dict[str, object] = {
        "identities": tuple(f"127.0.0.1:{40_000 + i}" for i in range(12)),
        "listening": 8,
        "block_len": 4096,
        "synthetic_blocks": 256,
        "odd_identities": (b"\xff\xfe-not-utf8", b"no-port-here"),
        "host_id": "0123456789abcdef0123456789abcdef",
        "node_shm_path": "/dev/shm/kvpeer-serve-1-0",
        "node_agent_metadata": b"nixlSerDes|" + bytes(range(200)),
        "shm_files": ("/dev/shm/kvpeer-fuzz-1-0",),
        "decoy_files": ("/tmp/decoy-region",),
        "tcp_sinks": (("127.0.0.1", 45_000),),
        "dead_port": 1,
    }
    values.update(overrides)
    return Target(**values)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def sample() -> list[Case]:
    return FrameGenerator(target(), seed=7).take(SAMPLE)


def decoded(case: Case) -> object:
    return msgspec.msgpack.decode(case.parts[0])


def labels_of(cases: list[Case]) -> set[str]:
    return {case.label for case in cases}


# -- determinism ------------------------------------------------------------------------------


def test_the_same_seed_gives_the_same_cases() -> None:
    first = FrameGenerator(target(), seed=3).take(3000)
    second = FrameGenerator(target(), seed=3).take(3000)
    assert first == second


def test_another_seed_gives_other_cases() -> None:
    first = FrameGenerator(target(), seed=3).take(500)
    second = FrameGenerator(target(), seed=4).take(500)
    assert [c.parts for c in first] != [c.parts for c in second]


def test_take_returns_exactly_the_count_asked_for() -> None:
    assert len(FrameGenerator(target(), seed=1).take(1234)) == 1234


# -- labels and coverage -----------------------------------------------------------------------


def test_every_label_is_kind_slash_mutation(sample: list[Case]) -> None:
    kinds = {*MESSAGE_TYPES, "raw", "parts"}
    for label in labels_of(sample):
        kind, slash, mutation = label.partition("/")
        assert slash, label
        assert mutation, label
        assert kind in kinds, label


def test_every_message_type_and_scenario_is_sent(sample: list[Case]) -> None:
    assert {c.kind for c in sample} == {*MESSAGE_TYPES, "raw", "parts"}
    assert {c.scenario for c in sample} == {name for name, _ in SCENARIOS}


def test_every_message_type_is_sent_valid_and_mutated(sample: list[Case]) -> None:
    labels = labels_of(sample)
    for kind, fields in SCHEMAS.items():
        assert any(label.startswith(f"{kind}/valid") for label in labels), kind
        # ping/pong have no fields: nothing to leave out, retype or repeat.
        per_field = ("missing:", "wrong-type:", "duplicate-key:") if fields else ()
        for mutation in (*per_field, "extra-key", "type:"):
            assert any(label.startswith(f"{kind}/{mutation}") for label in labels), (
                kind,
                mutation,
            )


def test_integer_fields_get_bools_negatives_and_huge_values(sample: list[Case]) -> None:
    labels = labels_of(sample)
    for mutation in ("bool-for-int:round_seq", "negative:round_seq", "huge:round_seq"):
        assert f"fetch/{mutation}" in labels
    assert "connect/bool-for-int:num_blocks" in labels


def test_sizes_at_and_past_the_limits_are_sent(sample: list[Case]) -> None:
    labels = labels_of(sample)
    assert {"lookup/at-limit:keys", "lookup/over-limit:keys"} <= labels
    assert {"fetch/at-limit:kv_request_id", "fetch/over-limit:kv_request_id"} <= labels


def test_every_hostile_connect_and_ack_is_sent(sample: list[Case]) -> None:
    labels = labels_of(sample)
    for name, _ in HOSTILE_CONNECTS:
        assert f"connect/{name}" in labels, name
    for name, _ in HOSTILE_ACKS:
        assert f"connect_ack/{name}" in labels, name


def test_the_ack_that_crashed_the_driver_is_sent_verbatim(sample: list[Case]) -> None:
    """The connect_ack extension that killed the node's driver thread (issue 15)."""
    crashing = {"version": [1, 0], "transport": {"name": "tcp", "params": {}}}
    found = [
        c
        for c in sample
        if c.label == "connect_ack/transport:tcp-empty-params"
        and isinstance(message := decoded(c), dict)
        and message.get("kvpeer") == crashing
    ]
    assert found
    assert all(c.scenario in ("handshake", "out-of-order") for c in found)


def test_offers_name_hostile_paths_hosts_and_ports(sample: list[Case]) -> None:
    offers: list[dict[str, object]] = []
    for case in sample:
        if case.label.startswith("connect/offer:"):
            message = decoded(case)
            assert isinstance(message, dict)
            extension = message.get("kvpeer")
            if isinstance(extension, dict) and isinstance(extension.get("transports"), dict):
                offers.extend(extension["transports"].values())
    paths = {repr(o.get("path")) for o in offers if isinstance(o, dict)}
    hosts = {repr(o.get("host")) for o in offers if isinstance(o, dict)}
    ports = {repr(o.get("port")) for o in offers if isinstance(o, dict)}
    assert {"'/etc/passwd'", "'/dev/shm/kvpeer-serve-1-0'", "'/tmp/decoy-region'"} <= paths
    assert {"'10.1.2.3'", "'127.0.0.9'"} <= hosts
    assert {"0", "65536", "-1", "'x'"} <= ports


def test_handshake_scenarios_start_with_a_connect(sample: list[Case]) -> None:
    first: dict[int, Case] = {}
    for case in sample:
        first.setdefault(case.sequence, case)
    handshakes = [c for c in first.values() if c.scenario == "handshake"]
    assert handshakes
    assert all(c.kind == "connect" for c in handshakes)


def test_identities_index_claimed_then_odd_ones(sample: list[Case]) -> None:
    t = target()
    claimed = len(t.identities)
    odd = {c.identity for c in sample if c.scenario == "odd-identity"}
    assert odd == set(range(claimed, claimed + len(t.odd_identities)))
    assert all(0 <= c.identity < claimed for c in sample if c.scenario != "odd-identity")


def test_wrong_part_counts_are_sent(sample: list[Case]) -> None:
    parts = {len(c.parts) for c in sample if c.kind == "parts"}
    assert 1 not in parts
    assert {2, 3} <= parts


def test_exclude_drops_labels_and_scenarios() -> None:
    cases = FrameGenerator(target(), seed=7, exclude=("connect_ack/transport:", "raw")).take(20_000)
    assert not any(c.label.startswith("connect_ack/transport:") for c in cases)
    assert not any(c.scenario == "raw" for c in cases)


# -- what the frames are ----------------------------------------------------------------------


def test_valid_frames_decode_to_their_type(sample: list[Case]) -> None:
    for case in sample:
        if not case.label.endswith(("/valid", "/valid:after-lookup", "/valid:terminal")):
            continue
        if "odd-identity" in case.label:
            continue
        message = CODEC.decode(case.parts[0])
        if case.kind == "unknown":
            assert isinstance(message, UnknownMessage)
        else:
            assert message.__struct_config__.tag == case.kind


def test_valid_connects_match_the_node(sample: list[Case]) -> None:
    t = target()
    for case in sample:
        if case.label.startswith("connect/valid:"):
            hello = CODEC.decode(case.parts[0])
            assert isinstance(hello, Connect)
            assert (hello.block_len, hello.hash_seed) == (t.block_len, t.hash_seed)
            assert hello.kvpeer is not None


def test_limits_decide_what_decodes(sample: list[Case]) -> None:
    """At a bound still decodes; one past it is a protocol error."""
    at = [c for c in sample if c.label == "fetch/at-limit:kv_request_id"]
    over = [c for c in sample if c.label == "fetch/over-limit:kv_request_id"]
    assert at
    assert over
    for case in at:
        CODEC.decode(case.parts[0])
    for case in over:
        with pytest.raises(ProtocolError):
            CODEC.decode(case.parts[0])


def test_mutated_frames_never_decode_to_a_valid_different_message(sample: list[Case]) -> None:
    """Mutations of one type stay that type or fail to decode (labels tell the truth)."""
    for case in sample[:20_000]:
        if case.kind in ("raw", "parts", "unknown") or "/valid" in case.label:
            continue
        try:
            message = CODEC.decode(case.parts[0])
        except ProtocolError:
            continue
        if isinstance(message, UnknownMessage):
            continue
        assert message.__struct_config__.tag == case.kind, case.label


def test_acks_claim_the_identity_they_come_from(sample: list[Case]) -> None:
    t = target()
    for case in sample:
        if case.label.startswith("connect_ack/valid:") and case.scenario == "handshake":
            ack = CODEC.decode(case.parts[0])
            assert isinstance(ack, ConnectAck)
            assert ack.peer_id == t.identities[case.identity]


def test_a_target_needs_identities_and_blocks() -> None:
    with pytest.raises(ValueError, match="identities"):
        target(identities=())
    with pytest.raises(ValueError, match="synthetic"):
        target(synthetic_blocks=0)


# -- raw msgpack helpers ----------------------------------------------------------------------


def test_map_of_pairs_keeps_duplicate_keys() -> None:
    frame = wire.map_of_pairs([("type", "lookup"), ("type", "fetch")])
    assert frame[0] == 0x82  # two entries
    assert msgspec.msgpack.decode(frame) == {"type": "fetch"}


def test_large_maps_get_a_map16_header() -> None:
    frame = wire.map_of_pairs([(f"k{i}", i) for i in range(20)])
    assert frame[0] == 0xDE
    assert len(msgspec.msgpack.decode(frame)) == 20


def test_deep_nesting_is_refused_by_the_codec_not_a_crash() -> None:
    with pytest.raises(ProtocolError):
        CODEC.decode(wire.deep_nesting(100_000, as_map=True))


def test_truncation_and_bitflips_change_the_frame() -> None:
    import random

    rng = random.Random(1)
    frame = wire.encode({"type": "lookup", "keys": [b"k"], "round_seq": 1})
    cut = wire.truncate(frame, rng)
    assert 0 < len(cut) < len(frame)
    assert frame.startswith(cut)
    flipped = wire.bitflip(frame, rng)
    assert len(flipped) == len(frame)
    assert flipped != frame


def test_the_largest_frames_stay_within_what_zmq_accepts(sample: list[Case]) -> None:
    biggest = max(sum(len(p) for p in c.parts) for c in sample)
    assert biggest <= limits.MAX_FRAME_BYTES + 1


# -- reading the node's reactions and crashes -------------------------------------------------


@pytest.mark.parametrize(
    ("reason", "normalized"),
    [
        (
            "fetch 'fz-1-2' round 7: block index 64 outside the peer's 64 blocks",
            "fetch '…' round N: block index N outside the peer's N blocks",
        ),
        (
            "invalid message: Expected `int` >= 0 - at `$.keys[3]`",
            "invalid message: Expected `int` >= N - at `$.keys[N]`",
        ),
        ("peer restarted (new boot id)", "peer restarted (new boot id)"),
    ],
)
def test_reasons_are_counted_without_their_variable_parts(reason: str, normalized: str) -> None:
    assert normalize_reason(reason) == normalized


THREAD_DEATH = """\
2026-12-01 14:51:12,100 kvpeer.tier WARNING session 127.0.0.1:1 ended (rejected): x
Exception in thread kvpeer-tcp-w-127.0.0.1:37371:
Traceback (most recent call last):
  File "/usr/lib/python3.11/encodings/idna.py", line 165, in encode
2026-12-01 14:51:12,214 kvpeer.tier WARNING session 127.0.0.1:2 ended (protocol_error): y
    raise UnicodeError("label too long")
UnicodeError: label too long

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "/src/kvpeer/transport/data/tcp.py", line 545, in _connect
    for family, kind, proto, _, address in socket.getaddrinfo(
  File "/usr/lib/python3.11/socket.py", line 962, in getaddrinfo
    for res in _socket.getaddrinfo(host, port, family, type, proto, flags):
UnicodeError: encoding with 'idna' codec failed (UnicodeError: label too long)
2026-12-01 14:51:12,217 kvpeer.tier WARNING session 127.0.0.1:3 ended (restarted): z
"""

DRIVER_DEATH = """\
2026-12-01 14:41:47,294 kvpeer.driver ERROR kvpeer driver crashed
Traceback (most recent call last):
  File "/src/kvpeer/node/driver.py", line 158, in _poll_locked
    self._tier.poll()
  File "/src/kvpeer/transport/data/tcp.py", line 249, in accept_writer
    raise DataPlaneError(f"tcp: {peer_id!r} sent no valid token: {params!r}")
kvpeer.errors.DataPlaneError: tcp: '127.0.0.1:33763' sent no valid token: {}
2026-12-01 14:41:47,295 kvpeer.tier WARNING session 127.0.0.1:33763 ended (local): tier
kvpeer: kvpeer driver thread crashed: DataPlaneError("tcp: ... sent no valid token: {}")
"""


def test_a_dead_thread_is_found_in_an_interleaved_log() -> None:
    (death,) = deaths_in(THREAD_DEATH)
    assert death.kind == "thread"
    assert death.signature == "thread kvpeer-tcp-w-N.N.N.N:N: UnicodeError at tcp.py:_connect"
    assert "WARNING" not in death.traceback


def test_a_driver_crash_is_found_once() -> None:
    deaths = deaths_in(THREAD_DEATH + DRIVER_DEATH)
    assert [d.kind for d in deaths] == ["thread", "driver"]
    assert deaths[1].signature == "driver: kvpeer.errors.DataPlaneError at tcp.py:accept_writer"
    assert deaths[1].exception.endswith("sent no valid token: {}")


EXIT_AFTER_CRASH = """\
Traceback (most recent call last):
  File "/src/kvpeer/node/serve.py", line 81, in serve
    node.wait_for_work(0.5)
kvpeer.node.driver.DriverCrashed: kvpeer driver thread crashed: DataPlaneError("tcp: ...")

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "/src/kvpeer/cli.py", line 337, in main
    return int(args.func(args))
  File "/src/kvpeer/host/pool.py", line 250, in close
    self._view.release()
BufferError: cannot close exported pointers exist
"""


def test_a_failed_exit_after_a_driver_crash_is_its_own_death() -> None:
    deaths = deaths_in(DRIVER_DEATH + EXIT_AFTER_CRASH)
    assert [d.signature for d in deaths] == [
        "driver: kvpeer.errors.DataPlaneError at tcp.py:accept_writer",
        "exit: BufferError at pool.py:close",
    ]


def test_a_quiet_log_has_no_deaths() -> None:
    assert deaths_in("2026-12-01 14:41:47,295 kvpeer.tier WARNING session x ended\n") == []
