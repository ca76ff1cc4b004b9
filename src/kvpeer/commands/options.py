"""Options several commands share: sizes, comma lists, and a node's tier config."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvpeer.config import TierConfig
from kvpeer.errors import ConfigError, KVPeerError

__all__ = [
    "DEFAULT_HASH_SEED",
    "add_node_options",
    "csv",
    "read_text",
    "ready_file_option",
    "size",
    "tier_config",
]

DEFAULT_HASH_SEED = "vllm-none-hash"


def csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def size(text: str) -> int:
    """``65536``, ``64K``, ``1M``, ``4MiB`` -> bytes."""
    units = {
        "": 1,
        "K": 1024,
        "KB": 1024,
        "KIB": 1024,
        "M": 1 << 20,
        "MB": 1 << 20,
        "MIB": 1 << 20,
        "G": 1 << 30,
        "GB": 1 << 30,
        "GIB": 1 << 30,
    }
    stripped = text.strip().upper()
    digits = stripped.rstrip("KMGIB")
    unit = stripped[len(digits) :]
    if not digits.isdigit() or unit not in units:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 65536, 64K, 1M)")
    return int(digits) * units[unit]


def read_text(option: str, path: str) -> str:
    """A config file's text; a missing, unreadable or non-UTF-8 file is named."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        bad = exc.object[exc.start : exc.start + 1]
        raise ConfigError(f"{option} {path}: not UTF-8 text (byte {exc.start}: {bad!r})") from exc
    except OSError as exc:
        raise ConfigError(f"{option} {path}: {exc.strerror or exc}") from exc


def ready_file_option(path: str | None, option: str = "--ready-file") -> None:
    """A ready file's folder must exist now (the file is written only once listening)."""
    if path is None:
        return
    folder = Path(path).parent
    if not folder.is_dir():
        raise ConfigError(f"{option} {path}: no such folder {str(folder)!r}")


def tier_config(args: argparse.Namespace) -> TierConfig:
    """The node's tier config: ``--config``'s JSON, then the flags over it."""
    mapping: dict[str, Any] = {}
    if args.config:
        try:
            loaded = json.loads(read_text("--config", args.config))
        except json.JSONDecodeError as exc:
            raise KVPeerError(f"--config {args.config}: {exc}") from exc
        if not isinstance(loaded, dict):
            raise KVPeerError(f"--config {args.config}: expected a JSON object")
        mapping.update({k: v for k, v in loaded.items() if k not in ("type", "module_path")})
    overrides = {
        "host": args.host,
        "port": args.port,
        "data_transports": args.data_planes,
        "hash_seed": args.hash_seed,
        "allowed_peers": args.allow,
        "nixl_peers": args.nixl_peer,
    }
    mapping.update({k: v for k, v in overrides.items() if v is not None})
    if args.curve_secret or args.curve_server_public or args.curve_clients:
        mapping["curve"] = {
            "server_secret_key_file": args.curve_secret,
            "server_public_key_file": args.curve_server_public,
            "client_public_keys_dir": args.curve_clients,
        }
    mapping.setdefault("hash_seed", DEFAULT_HASH_SEED)
    return TierConfig.from_dict(mapping)


def add_node_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="JSON file with tier config keys (docs/design.md §6)")
    parser.add_argument("--host", help="address to bind and advertise (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="control port (default 5710; 0 = any)")
    parser.add_argument("--block-len", type=size, default=64 * 1024, help="bytes per block")
    parser.add_argument("--blocks", type=int, default=1024, help="blocks in the region")
    parser.add_argument("--data-planes", type=csv, help="preference list, e.g. shm,tcp,nixl")
    parser.add_argument(
        "--hash-seed", help=f"prefix-hash seed peers must share (default {DEFAULT_HASH_SEED})"
    )
    parser.add_argument(
        "--allow", action="append", help="allowed peer: CIDR or host:port (repeatable)"
    )
    parser.add_argument(
        "--nixl-peer",
        action="append",
        help="peer whose NIXL metadata this node loads: CIDR or host:port (repeatable; "
        "default: the --allow list if given, else nobody)",
    )
    parser.add_argument("--curve-secret", help="CURVE: this node's secret key file")
    parser.add_argument("--curve-server-public", help="CURVE: the servers' public key file")
    parser.add_argument("--curve-clients", help="CURVE: directory of allowed client keys")
