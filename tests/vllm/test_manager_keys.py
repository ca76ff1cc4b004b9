"""Which keys kvpeer's tiering manager promotes together with the one looked up: the
request's following keys of the same KV-cache group, in prompt order."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import OffloadKey, ReqContext, make_offload_key

from kvpeer.integrations.vllm.manager import following_keys


def request_with_two_groups(blocks: int) -> tuple[ReqContext, list[OffloadKey], list[OffloadKey]]:
    context = ReqContext("r")
    groups: list[list[OffloadKey]] = [[], []]
    # recorded out of order, as a sliding-window backfill records them
    for i in reversed(range(blocks)):
        for group in (0, 1):
            key = make_offload_key(bytes([i, group]) * 16, group)
            context.set_offload_key_position(key, 32 * (i + 1))
            groups[group].insert(0, key)
    return context, groups[0], groups[1]


def test_the_following_keys_of_the_same_group_in_prompt_order() -> None:
    context, group0, group1 = request_with_two_groups(5)
    assert following_keys(group0[1], context) == group0[2:]
    assert following_keys(group1[0], context) == group1[1:]
    assert following_keys(group0[-1], context) == []


def test_a_key_the_request_does_not_have_has_no_following_keys() -> None:
    context, _, _ = request_with_two_groups(3)
    assert following_keys(make_offload_key(b"\x07" * 32, 0), context) == []
