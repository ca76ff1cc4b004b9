"""The engine StatefulSet's ``vllm serve`` arguments as vLLM itself reads them.

tests/test_deploy.py checks the manifests against Kubernetes' schemas and the tier
config with ``kvpeer check-config``; here vLLM's own ``vllm serve`` parser and engine
arguments read the expanded args (no engine starts: the image's GPU is not here), so a
flag or a config key vLLM does not know fails CI too.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.cli import serve as vllm_serve
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

from kvpeer.integrations.vllm import KVPeerTier
from kvpeer.integrations.vllm.plugin import register
from tests.test_deploy import SAMPLE_FIELDS, engine_container, expanded_args, flag

# The parser ``vllm serve`` itself builds with, wherever this vLLM keeps it (0.32:
# entrypoints.launchers.cli_args; 0.33 moved it to entrypoints.common.cli_args).
make_arg_parser = vars(vllm_serve)["make_arg_parser"]


def engine_args(args: list[str]) -> AsyncEngineArgs:
    """What ``vllm serve ARGS`` builds its engine from (argparse exits on a bad arg)."""
    parser = make_arg_parser(FlexibleArgumentParser())  # type: ignore[no-untyped-call]
    parsed: AsyncEngineArgs = AsyncEngineArgs.from_cli_args(parser.parse_args(args))
    return parsed


def test_vllm_serve_reads_the_engine_args_with_the_kvpeer_tier() -> None:
    args = expanded_args(engine_container())
    parsed = engine_args(args)
    transfer = parsed.kv_transfer_config
    assert transfer is not None
    assert transfer.kv_connector == "KVPeerOffloadingConnector"
    assert transfer.kv_connector_module_path == "kvpeer.integrations.vllm.connector"
    assert transfer.engine_id == SAMPLE_FIELDS["metadata.name"]
    (entry,) = transfer.kv_connector_extra_config["secondary_tiers"]
    assert entry["host"] == SAMPLE_FIELDS["status.podIP"]
    register()
    assert SecondaryTierFactory.get_tier_class(entry) is KVPeerTier
    events = parsed.kv_events_config
    assert events is not None
    assert events.enable_kv_cache_events
    assert (events.endpoint, events.replay_endpoint) == ("tcp://*:5557", "tcp://*:5558")
    assert parsed.enable_prefix_caching


def test_a_key_vllm_does_not_know_fails_its_parser() -> None:
    args = expanded_args(engine_container())
    transfer = json.loads(flag(args, "--kv-transfer-config"))
    transfer["kv_rol"] = transfer.pop("kv_role")
    args[args.index("--kv-transfer-config") + 1] = json.dumps(transfer)
    with pytest.raises(SystemExit):
        engine_args(args)
