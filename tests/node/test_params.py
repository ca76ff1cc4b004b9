"""Parsing of kv_transfer_params into request roles (docs/design.md section 3)."""

from __future__ import annotations

import pytest

from kvpeer.node.params import (
    Destination,
    Routing,
    Source,
    format_peer_id,
    parse_transfer_params,
)

SRC = {"kv_request_id": "req-1", "remote_host": "10.0.0.5", "remote_port": 5710}


class TestWellFormed:
    def test_no_params_is_local(self) -> None:
        assert parse_transfer_params(None) == Routing()
        assert parse_transfer_params({}).is_local

    def test_pd_consumer_does_not_probe(self) -> None:
        routing = parse_transfer_params({"remote_prefiller": SRC})
        assert routing.source == Source("req-1", "10.0.0.5:5710", probe=False)
        assert routing.destination is None
        assert routing.problems == ()

    @pytest.mark.parametrize(
        ("role", "value", "done"),
        [
            ("remote_prefiller", True, True),
            ("remote_prefiller", "true", False),  # only a JSON true says so
            ("remote_prefiller", 1, False),
            ("remote_kv_source", True, False),  # a PD hint: no prefill leg to finish
        ],
    )
    def test_prefill_done_extension(self, role: str, value: object, done: bool) -> None:
        routing = parse_transfer_params({role: {**SRC, "prefill_done": value}})
        assert routing.source is not None
        assert routing.source.prefill_done is done
        assert routing.problems == ()

    def test_symmetric_consumer_probes(self) -> None:
        routing = parse_transfer_params({"remote_kv_source": SRC})
        assert routing.source == Source("req-1", "10.0.0.5:5710", probe=True)

    @pytest.mark.parametrize(
        ("role", "value", "held", "problem"),
        [
            ("remote_kv_source", 640, 640, None),
            ("remote_kv_source", 0, 0, None),
            ("remote_prefiller", 640, None, None),  # PD fetches everything anyway
            ("remote_kv_source", -1, None, "held_tokens"),
            ("remote_kv_source", True, None, "held_tokens"),
            ("remote_kv_source", "640", None, "held_tokens"),
            ("remote_kv_source", 2**64, None, "held_tokens"),
            ("remote_kv_source", 64.0, None, "held_tokens"),
        ],
    )
    def test_held_tokens_extension(
        self, role: str, value: object, held: int | None, problem: str | None
    ) -> None:
        """A bad count is named and ignored: the request still pulls, probing first."""
        routing = parse_transfer_params({role: {**SRC, "held_tokens": value}})
        assert routing.source is not None
        assert routing.source.held_tokens == held
        if problem is None:
            assert routing.problems == ()
        else:
            [text] = routing.problems
            assert problem in text
            assert repr(value)[:20] in text

    @pytest.mark.parametrize(
        ("role", "value", "give_up", "problem"),
        [
            ("remote_kv_source", 0.75, 0.75, None),
            ("remote_kv_source", 2, 2.0, None),
            ("remote_prefiller", 0.75, None, None),  # PD: the producer parks for one fetch
            ("remote_kv_source", 0, None, "give_up_s"),
            ("remote_kv_source", -1.0, None, "give_up_s"),
            ("remote_kv_source", float("nan"), None, "give_up_s"),
            ("remote_kv_source", float("inf"), None, "give_up_s"),
            ("remote_kv_source", 1e9, None, "give_up_s"),
            ("remote_kv_source", True, None, "give_up_s"),
            ("remote_kv_source", "0.5", None, "give_up_s"),
        ],
    )
    def test_give_up_extension(
        self, role: str, value: object, give_up: float | None, problem: str | None
    ) -> None:
        """A bad value is named and ignored: the pull waits as it would without one."""
        routing = parse_transfer_params({role: {**SRC, "give_up_s": value}})
        assert routing.source is not None
        assert routing.source.give_up_s == give_up
        if problem is None:
            assert routing.problems == ()
        else:
            [text] = routing.problems
            assert problem in text

    def test_producer_leg(self) -> None:
        routing = parse_transfer_params({"remote_decoder": {"kv_request_id": "req-9"}})
        assert routing.destination == Destination("req-9")
        assert routing.source is None

    def test_decoder_plus_kv_source_is_legal(self) -> None:
        routing = parse_transfer_params(
            {"remote_decoder": {"kv_request_id": "p"}, "remote_kv_source": SRC}
        )
        assert routing.destination == Destination("p")
        assert routing.source is not None
        assert routing.source.probe
        assert routing.problems == ()

    @pytest.mark.parametrize("host", ["::1", "[::1]"])
    def test_ipv6_peer_id_is_bracketed(self, host: str) -> None:
        routing = parse_transfer_params({"remote_kv_source": {**SRC, "remote_host": host}})
        assert routing.source is not None
        assert routing.source.peer_id == "[::1]:5710"

    def test_port_as_digit_string(self) -> None:
        routing = parse_transfer_params({"remote_prefiller": {**SRC, "remote_port": "5711"}})
        assert routing.source is not None
        assert routing.source.peer_id == "10.0.0.5:5711"

    def test_unrelated_keys_are_ignored(self) -> None:
        routing = parse_transfer_params({"max_offload_tokens": 3, "remote_prefiller": SRC})
        assert routing.source is not None
        assert routing.problems == ()


class TestMalformed:
    """Malformed roles are dropped with a reason naming the field; nothing raises."""

    @pytest.mark.parametrize(
        ("change", "field"),
        [
            ({"remote_host": ""}, "remote_host"),
            ({"remote_host": None}, "remote_host"),
            ({"remote_port": 0}, "remote_port"),
            ({"remote_port": 70000}, "remote_port"),
            ({"remote_port": True}, "remote_port"),
            ({"remote_port": "57a"}, "remote_port"),
            ({"kv_request_id": ""}, "kv_request_id"),
            ({"kv_request_id": 7}, "kv_request_id"),
            ({"kv_request_id": "x" * 513}, "kv_request_id"),
        ],
    )
    def test_bad_source_field(self, change: dict[str, object], field: str) -> None:
        routing = parse_transfer_params({"remote_kv_source": {**SRC, **change}})
        assert routing.source is None
        assert len(routing.problems) == 1
        assert f"remote_kv_source.{field}" in routing.problems[0]

    def test_missing_fields_all_reported(self) -> None:
        routing = parse_transfer_params({"remote_prefiller": {}})
        assert routing.source is None
        assert len(routing.problems) == 3

    def test_role_not_a_dict(self) -> None:
        routing = parse_transfer_params({"remote_decoder": "abc"})
        assert routing.is_local
        assert "remote_decoder: expected a dict" in routing.problems[0]

    def test_decoder_without_id(self) -> None:
        routing = parse_transfer_params({"remote_decoder": {}})
        assert routing.destination is None
        assert "remote_decoder.kv_request_id" in routing.problems[0]

    def test_both_consumer_roles_are_refused(self) -> None:
        routing = parse_transfer_params({"remote_prefiller": SRC, "remote_kv_source": SRC})
        assert routing.source is None
        assert "exclusive" in routing.problems[0]

    def test_params_not_a_dict(self) -> None:
        routing = parse_transfer_params(["remote_prefiller"])
        assert routing.is_local
        assert routing.problems


def test_format_peer_id() -> None:
    assert format_peer_id("node-a", 1) == "node-a:1"
    assert format_peer_id("127.0.0.1", 5710) == "127.0.0.1:5710"
    assert format_peer_id("fe80::1", 5710) == "[fe80::1]:5710"
