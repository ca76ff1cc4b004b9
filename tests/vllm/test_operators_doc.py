"""docs/operators.md's ``vllm serve`` line, for each engine of its fleet, as vLLM's own
``vllm serve`` parser and engine arguments read it (no engine starts: no GPU here)."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("vllm")

from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

from kvpeer.integrations.vllm import KVPeerTier
from kvpeer.integrations.vllm.plugin import register
from tests.test_operators_doc import ENGINES, serve_line

try:  # where vLLM keeps the parser ``vllm serve`` builds: 0.32, then 0.33 on
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
except ImportError:  # pragma: no cover
    from vllm.entrypoints.common.cli_args import (  # type: ignore[no-redef,import-not-found,unused-ignore]
        make_arg_parser,
    )


def vllm_serve(argv: list[str]) -> tuple[argparse.Namespace, AsyncEngineArgs]:
    """What ``vllm serve`` reads (its API server's options) and builds its engine from;
    argparse exits on an unknown flag or a config key vLLM does not know."""
    args = argv[argv.index("serve") + 1 :]
    parser = make_arg_parser(FlexibleArgumentParser())  # type: ignore[no-untyped-call]
    parsed = parser.parse_args(args)
    if getattr(parsed, "model_tag", None) is not None:
        parsed.model = parsed.model_tag  # as ``vllm serve MODEL`` does
    engine: AsyncEngineArgs = AsyncEngineArgs.from_cli_args(parsed)
    return parsed, engine


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_vllm_serve_reads_the_documented_line(engine: str) -> None:
    server, parsed = vllm_serve(serve_line(engine))
    assert parsed.model == "Qwen/Qwen3-8B"
    assert parsed.enable_prefix_caching
    assert server.enable_prompt_tokens_details is True  # an API server option
    assert (server.host, server.port) == ("0.0.0.0", 8000)
    transfer = parsed.kv_transfer_config
    assert transfer is not None
    assert transfer.kv_connector == "KVPeerOffloadingConnector"
    assert transfer.kv_role == "kv_both"
    extra = transfer.kv_connector_extra_config
    assert extra["spec_name"] == "KVPeerTieringOffloadingSpec"
    (entry,) = extra["secondary_tiers"]
    assert entry["host"] == ENGINES[engine]
    register()
    assert SecondaryTierFactory.get_tier_class(entry) is KVPeerTier
    events = parsed.kv_events_config
    assert events is not None
    assert events.enable_kv_cache_events
    assert (events.endpoint, events.replay_endpoint) == ("tcp://*:5557", "tcp://*:5558")


def test_a_misspelt_flag_in_such_a_line_fails_vllms_parser() -> None:
    argv = serve_line()
    argv[argv.index("--enable-prompt-tokens-details")] = "--enable-prompt-token-details"
    with pytest.raises(SystemExit):
        vllm_serve(argv)
