"""Request bodies: router-owned kv_transfer_params, the legs, usage in streams."""

from __future__ import annotations

import json
from typing import Any

from kvpeer.router import params
from kvpeer.router.policy import EngineSpec

PEER = EngineSpec("p", "http://127.0.0.1:1", "10.0.0.5", 5712)


def test_sanitize_removes_every_routing_field_and_keeps_the_rest() -> None:
    body = {"model": "m", "prompt": [1], "kv_transfer_params": {"x": 1},
            "ec_transfer_params": {}, "vllm_xargs": {"kv_transfer_params": "{}", "keep": 1}}
    clean, removed = params.sanitize(body)
    assert clean == {"model": "m", "prompt": [1], "vllm_xargs": {"keep": 1}}
    assert removed == ["kv_transfer_params", "ec_transfer_params",
                       "vllm_xargs.kv_transfer_params"]
    assert "kv_transfer_params" in body  # the client's body is not mutated


def test_prefill_leg_is_one_token_unstreamed_and_parks_for_the_id() -> None:
    body = {"messages": [], "stream": True, "stream_options": {"include_usage": True},
            "min_tokens": 4, "max_completion_tokens": 100, "n": 2, "temperature": 0.3}
    leg = params.prefill_leg(body, "id1", chat=True)
    assert leg == {"messages": [], "max_completion_tokens": 1, "max_tokens": 1,
                   "stream": False, "n": 1, "temperature": 0.3,
                   "kv_transfer_params": {"remote_decoder": {"kv_request_id": "id1"}}}


def test_decode_and_shared_legs_name_only_the_given_peer() -> None:
    body: dict[str, Any] = {"prompt": [1, 2], "max_tokens": 9}
    target = {"kv_request_id": "id1", "remote_host": "10.0.0.5", "remote_port": 5712}
    assert params.decode_leg(body, "id1", PEER)["kv_transfer_params"] == {
        "remote_prefiller": target | {"prefill_done": True}}
    assert params.shared_leg(body, "id1", PEER)["kv_transfer_params"] == {
        "remote_kv_source": target}
    assert params.decode_leg(body, "id1", None) == body
    assert params.shared_leg(body, "id1", None) == body
    assert params.shared_leg(body, "id1", PEER, 640)["kv_transfer_params"] == {
        "remote_kv_source": target | {"held_tokens": 640}}
    assert params.shared_leg(body, "id1", PEER, 0)["kv_transfer_params"] == {
        "remote_kv_source": target}  # nothing held: the engine probes as before
    assert params.shared_leg(body, "id1", None, 640) == body
    assert params.shared_leg(body, "id1", PEER, 640, 0.41234)["kv_transfer_params"] == {
        "remote_kv_source": target | {"held_tokens": 640, "give_up_s": 0.412}}
    assert params.shared_leg(body, "id1", None, 640, 0.4) == body


def test_want_usage_only_when_streaming_and_not_asked() -> None:
    assert params.want_usage({"stream": False}) == ({"stream": False}, False)
    asked = {"stream": True, "stream_options": {"include_usage": True}}
    assert params.want_usage(asked) == (asked, False)
    leg, injected = params.want_usage(
        {"stream": True, "stream_options": {"continuous_usage_stats": False}})
    assert injected
    assert leg["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}


def test_prompt_token_ids_and_tokenize_body() -> None:
    assert params.prompt_token_ids({"prompt": [3, 4]}, chat=False) == [3, 4]
    assert params.prompt_token_ids({"prompt": "text"}, chat=False) is None
    assert params.prompt_token_ids({"prompt": [[1], [2]]}, chat=False) is None
    assert params.prompt_token_ids({"prompt": [True]}, chat=False) is None
    assert params.tokenize_body({"model": "m", "prompt": "hi"}, chat=False) == {
        "model": "m", "prompt": "hi"}
    assert params.tokenize_body({"prompt": ["a", "b"]}, chat=False) is None
    messages = [{"role": "user", "content": "x"}]
    assert params.tokenize_body({"messages": messages, "temperature": 1}, chat=True) == {
        "messages": messages}


def event(document: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(document)}\n\n".encode()


USAGE = {"choices": [], "usage": {"prompt_tokens": 40,
                                  "prompt_tokens_details": {"cached_tokens": 32}}}
CHUNK = {"choices": [{"text": "a"}]}


def test_stream_filter_splits_across_reads_and_strips_the_usage_it_added() -> None:
    stream = event(CHUNK) + event(CHUNK) + event(USAGE) + b"data: [DONE]\n\n"
    out = b""
    relay = params.StreamFilter(strip_usage=True)
    for i in range(0, len(stream), 7):  # events cut at arbitrary places
        out += relay.feed(stream[i : i + 7])
    out += relay.flush()
    assert out == event(CHUNK) + event(CHUNK) + b"data: [DONE]\n\n"
    assert relay.usage == params.Usage(40, 32)


def test_stream_filter_keeps_usage_the_client_asked_for_and_passes_whole_events() -> None:
    relay = params.StreamFilter(strip_usage=False)
    assert relay.feed(event(CHUNK)[:-1]) == b""  # not complete yet: held
    assert relay.feed(b"\n" + event(USAGE)) == event(CHUNK) + event(USAGE)
    assert relay.usage == params.Usage(40, 32)


def test_read_usage_tolerates_engine_garbage() -> None:
    assert params.read_usage({"usage": None}) is None
    assert params.read_usage([1]) is None
    assert params.read_usage({"usage": {"prompt_tokens": "x"}}) == params.Usage(None, None)
