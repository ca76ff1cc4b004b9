"""Every problem of a router configuration at once, each blamed on where it came from.

:func:`kvpeer.router.config.from_mapping` stops at the first bad value. An operator fixing
a config wants them all, like the tier's check gives (``kvpeer check-config``), and wants
a bad flag blamed on the flag (``--retries: 'x' is not an integer``), not on the file it
overrides. This module runs the same checks as ``config`` piece by piece:

1. Unknown keys, top-level and per engine, one line each with the closest known key
   (``did you mean 'retries'?``).
2. Each scalar alone: its type (``_number``), then its range, by building a config in
   which only that key differs from the defaults, so the error is that key's.
3. Each engine table key by key over a known-good engine (so each bad key is named once),
   then the whole table; each ``--engine`` flag blamed as ``--engine '...'``.
4. Only when every value is good: the whole config (cross-key rules: duplicate engines,
   pd roles, a policy pd cannot use, the CURVE pair).

So :func:`problems` is empty exactly when :func:`kvpeer.router.config.from_mapping`
succeeds on the same input (tested over the bad-config table of tests/router).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kvpeer.errors import ConfigError
from kvpeer.router import config
from kvpeer.router.discovery import suggest
from kvpeer.router.policy import Mode

__all__ = ["TOP_LEVEL_KEYS", "flag_names", "from_args", "problems"]

#: Every key a router TOML file may hold at the top level.
TOP_LEVEL_KEYS = ("mode", "listen", "engine", "discovery", *config.SCALARS)
_GOOD_ENGINE = {"name": "probe", "url": "http://127.0.0.1:1", "peer": "127.0.0.1:1"}
#: Keys valid only together (the CURVE pair): their types are checked alone, their
#: values with the whole config.
_PAIRED = ("prefetch_curve_key", "prefetch_curve_server_key")


def flag_names() -> dict[str, str]:
    """Config key -> the ``kvpeer router`` flag that sets it (from the parser itself)."""
    parser = argparse.ArgumentParser(add_help=False)
    config.add_arguments(parser)
    names = {action.dest: action.option_strings[0] for action in parser._actions
             if action.option_strings}  # fmt: skip
    names["tokenize"] = names.pop("no_tokenize")
    return {key: flag for key, flag in names.items()
            if key in TOP_LEVEL_KEYS and key not in ("engine", "discovery")}  # fmt: skip


def _first(call: Callable[[], object]) -> list[str]:
    try:
        call()
    except ConfigError as exc:
        return str(exc).splitlines()
    return []


def _where(key: str, source: str, flags: Mapping[str, str]) -> str:
    return flags.get(key) or f"{source}: {key}"


def problems(
    mapping: Mapping[str, Any],
    source: str = "config",
    extra_engines: Sequence[tuple[str, Mapping[str, Any]]] = (),
    flagged: Mapping[str, str] | None = None,
) -> list[str]:
    """Every problem, one line each; [] when :func:`config.from_mapping` would succeed.

    ``extra_engines``: (the ``--engine`` text, its table); ``flagged``: keys of
    ``mapping`` that came from flags -> the flag's name."""
    flags = flagged or {}
    found: list[str] = []
    for key in mapping:
        if key not in TOP_LEVEL_KEYS:
            found.append(f"{source}: unknown key {key!r}{suggest(key, TOP_LEVEL_KEYS)}")
    if "mode" in mapping:
        try:
            Mode(mapping["mode"])
        except ValueError:
            found.append(f"{_where('mode', source, flags)}: {mapping['mode']!r} is not one "
                         f"of {', '.join(m.value for m in Mode)}")  # fmt: skip
    if "listen" in mapping:
        where = _where("listen", source, flags)
        found += _first(lambda: config.parse_host_port(where, mapping["listen"], allow_zero=True))
    found += _scalars(mapping, source, flags)
    tables = mapping.get("engine", [])
    engines: list[tuple[str, Mapping[str, Any]]] = []
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        found.append(f"{source}: engine must be [[engine]] tables")
    else:
        engines = [(f"{source}: engine #{i + 1}", t) for i, t in enumerate(tables)]
    for text, table in extra_engines:
        engines.append((f"--engine {text!r}", table))
    for where, table in engines:
        found += _engine(where, table)
    if "discovery" in mapping:
        found += _first(lambda: config.from_mapping(
            {"discovery": mapping["discovery"]}, source))  # fmt: skip
    if not found:  # 4. the whole config (cross-key rules)
        whole = _first(lambda: config.from_mapping(
            mapping, source, [table for _, table in extra_engines]))  # fmt: skip
        found += [line if line.startswith(source) else f"{source}: {line}" for line in whole]
    return found


def _scalars(mapping: Mapping[str, Any], source: str, flags: Mapping[str, str]) -> list[str]:
    probe = config.engine_entries([_GOOD_ENGINE])
    found: list[str] = []
    for key, kind in config.SCALARS.items():
        if key not in mapping:
            continue
        where = _where(key, source, flags)
        try:
            value = config._number(where, mapping[key], kind)
            if key not in _PAIRED:
                config.RouterConfig(mode=Mode.SHARED, engines=probe, **{key: value})
        except ConfigError as exc:
            for line in str(exc).splitlines():
                # range errors name the key (``retries: 11 must be ...``): name the origin
                text = line.removeprefix(f"{key}: ")
                found.append(text if text.startswith(where) else f"{where}: {text}")
        except TypeError:
            pass  # a key the config's constructor does not take: from_mapping says so
    return found


def _engine(where: str, table: Mapping[str, Any]) -> list[str]:
    found = [f"{where}: unknown key {key!r}{suggest(key, sorted(config.ENGINE_KEYS))}"
             for key in table if key not in config.ENGINE_KEYS]  # fmt: skip
    known = {k: v for k, v in table.items() if k in config.ENGINE_KEYS}
    for key in ("name", "url", "peer"):
        if key not in known:
            found.append(f"{where}: {key} is missing")
    good = dict(_GOOD_ENGINE)
    name_lines = _first(lambda: config.engine_entries([{**good, "name": known.get("name")}],
                                                      where))  # fmt: skip
    if "name" in known and not name_lines:
        good["name"] = known["name"]
    elif "name" in known:
        found += [f"{where}: {line.split(': ', 1)[-1]}" for line in name_lines]
    per_key: list[str] = []
    for key, value in known.items():
        if key == "name":
            continue
        trial: dict[str, Any] = {**good, key: value}
        if key == "url" and isinstance(value, list):
            trial["dp_size"] = len(value)  # checked against dp_size with the whole table
        per_key += _engine_lines(trial, where)
    found += [line if line.startswith(where) else f"{where}: {line}"
              for line in dict.fromkeys(line.replace("engine 'probe': ", "")
                                        for line in per_key)]  # fmt: skip
    if not found:
        found += [line if line.startswith(where) else f"{where}: {line}"
                  for line in _first(lambda: config.engine_entries([known], where))]  # fmt: skip
    return found


def _engine_lines(table: Mapping[str, Any], where: str) -> list[str]:
    return _first(lambda: config.engine_entries([table], where))


def from_args(args: argparse.Namespace) -> config.RouterConfig:
    """:func:`config.from_args` with every problem reported at once, flags blamed as such."""
    mapping: dict[str, Any] = config.load_file(Path(args.config)) if args.config else {}
    source = args.config or "flags"
    flagged: dict[str, str] = {}
    for key, flag in flag_names().items():
        value = getattr(args, "no_tokenize" if key == "tokenize" else key, None)
        if key == "tokenize":
            value = False if value else None
        if value is not None:
            mapping[key] = value
            flagged[key] = flag
    engines: list[tuple[str, Mapping[str, Any]]] = []
    found: list[str] = []
    for text in args.engine:
        try:
            engines.append((text, config.parse_engine_flag(text)))
        except ConfigError as exc:
            found.append(str(exc))
    found += problems(mapping, source, engines, flagged)
    if found:
        raise ConfigError("\n".join(found))
    return config.from_mapping(mapping, source, [table for _, table in engines])
