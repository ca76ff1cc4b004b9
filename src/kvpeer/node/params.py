"""Request roles from ``kv_transfer_params`` (docs/design.md section 3), parsed once.

Each role key names the remote counterpart: ``remote_decoder`` (we produce
for a decoder that will fetch ``kv_request_id``), ``remote_prefiller`` (PD
consumer: the peer has every block, no probing) and ``remote_kv_source``
(symmetric consumer: probe, then fetch the hits; with ``held_tokens``, a
kvpeer extension the router sets from the peer's KV events, the consumer
trusts that the peer holds the prompt's first ``held_tokens`` tokens and
fetches them without probing; with ``give_up_s``, another, it stops waiting for the
pull that long after submitting it and the engine computes instead). ``remote_decoder`` may
combine with one consumer role. Anything malformed is reported as a problem
and that role is dropped, so the request runs locally; parsing never raises.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeGuard, TypeVar

from kvpeer.protocol import limits

__all__ = [
    "Destination",
    "Routing",
    "Source",
    "format_peer_id",
    "parse_transfer_params",
    "split_peer_id",
]

T = TypeVar("T")
ROLE_KEYS = ("remote_decoder", "remote_prefiller", "remote_kv_source")


@dataclass(frozen=True, slots=True)
class Source:
    """Where a consumer request pulls from."""

    kv_request_id: str
    peer_id: str
    probe: bool  # symmetric (lookup first) vs PD (every block is there)
    #: kvpeer extension: the orchestrator saw the producer's prefill leg answer
    #: before sending this request (a restarted producer then fails it at once).
    prefill_done: bool = False
    #: kvpeer extension (symmetric only): the peer holds the prompt's first
    #: ``held_tokens`` tokens, as the router last saw them.
    held_tokens: int | None = None
    #: kvpeer extension (symmetric only): the router's word that a pull still running
    #: this many seconds after it was submitted is slower than computing its blocks
    give_up_s: float | None = None


@dataclass(frozen=True, slots=True)
class Destination:
    """A producer request: serve every block to whoever fetches the id."""

    kv_request_id: str


@dataclass(frozen=True, slots=True)
class Routing:
    source: Source | None = None
    destination: Destination | None = None
    problems: tuple[str, ...] = ()

    @property
    def is_local(self) -> bool:
        return self.source is None and self.destination is None


LOCAL = Routing()


def format_peer_id(host: str, port: int) -> str:
    """``host:port``, with IPv6 literals in brackets (``[::1]:5710``)."""
    try:  # every IPv6 literal has a colon; parsing a name costs two exceptions
        is_v6 = ":" in host and ipaddress.ip_address(host).version == 6
    except ValueError:
        is_v6 = False
    return f"[{host}]:{port}" if is_v6 else f"{host}:{port}"


def split_peer_id(peer_id: str) -> tuple[str, int] | None:
    """``(host, port)`` of ``host:port`` / ``[v6]:port``; None if it is neither."""
    host, sep, port_text = peer_id.rpartition(":")
    if not sep or not (port_text.isascii() and port_text.isdigit()) or not host:
        return None  # ("²".isdigit() is True, and int() refuses it)
    port = int(port_text)
    if not 0 < port < 65536:
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        return None  # an IPv6 literal must be bracketed
    return (host, port) if host else None


def parse_transfer_params(params: object) -> Routing:
    """The request's roles; malformed roles are dropped with a reason."""
    if params is None:
        return LOCAL
    if not isinstance(params, Mapping):
        return Routing(problems=(f"kv_transfer_params: expected a dict, got {params!r:.80}",))
    problems: list[str] = []
    destination = None
    if "remote_decoder" in params:
        destination = _destination(params["remote_decoder"], problems)
    sources = [k for k in ("remote_prefiller", "remote_kv_source") if k in params]
    source = None
    if len(sources) == 2:
        problems.append("remote_prefiller and remote_kv_source are exclusive; pulling nothing")
    elif sources:
        key = sources[0]
        source = _source(key, params[key], problems, probe=key == "remote_kv_source")
    return Routing(source, destination, tuple(problems))


def _kv_request_id(role: str, value: object, problems: list[str]) -> str | None:
    if isinstance(value, str) and 0 < len(value) <= limits.MAX_NAME_CHARS:
        return value
    problems.append(
        f"{role}.kv_request_id: expected a string of 1..{limits.MAX_NAME_CHARS} characters, "
        f"got {value!r:.80}"
    )
    return None


def _destination(value: object, problems: list[str]) -> Destination | None:
    if not isinstance(value, Mapping):
        problems.append(f"remote_decoder: expected a dict, got {value!r:.80}")
        return None
    kv_request_id = _kv_request_id("remote_decoder", value.get("kv_request_id"), problems)
    return Destination(kv_request_id) if kv_request_id is not None else None


def _source(role: str, value: object, problems: list[str], *, probe: bool) -> Source | None:
    if not isinstance(value, Mapping):
        problems.append(f"{role}: expected a dict, got {value!r:.80}")
        return None
    kv_request_id = _kv_request_id(role, value.get("kv_request_id"), problems)
    host = value.get("remote_host")
    if isinstance(host, str) and host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not isinstance(host, str) or not host or len(host) > 255:
        problems.append(f"{role}.remote_host: expected a host name or IP, got {host!r:.80}")
        host = None
    port = _port(value.get("remote_port"))
    if port is None:
        problems.append(
            f"{role}.remote_port: expected a port 1..65535, got {value.get('remote_port')!r:.80}"
        )
    if kv_request_id is None or host is None or port is None:
        return None
    prefill_done = not probe and value.get("prefill_done") is True
    held = _extension(role, value, "held_tokens", _is_count, problems, probe=probe,
                      expected=f"a token count 0..{limits.INT_LIMIT - 1}",
                      instead="probing instead")  # fmt: skip
    give_up = _extension(role, value, "give_up_s", _is_give_up, problems, probe=probe,
                         expected=f"seconds in (0, {MAX_GIVE_UP_S:g}]",
                         instead="waiting for the pull as long as it takes")  # fmt: skip
    return Source(kv_request_id, format_peer_id(host, port), probe, prefill_done, held,
                  None if give_up is None else float(give_up))


def _extension(role: str, value: Mapping[str, object], key: str,
               valid: Callable[[object], TypeGuard[T]], problems: list[str], *, probe: bool,
               expected: str, instead: str) -> T | None:  # fmt: skip
    """A symmetric consumer's kvpeer extension ``key``: its value if ``valid``; a bad one
    is named (``instead``: what the request does without it) and dropped."""
    found = value.get(key) if probe else None
    if found is not None and not valid(found):
        problems.append(f"{role}.{key}: expected {expected}, got {found!r:.80}; {instead}")
        return None
    return found


MAX_GIVE_UP_S = 3600.0


def _is_give_up(value: object) -> TypeGuard[float]:
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and 0 < value <= MAX_GIVE_UP_S)  # NaN compares False: refused too


def _is_count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and (
        0 <= value < limits.INT_LIMIT
    )


def _port(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, int) and 0 < value < 65536:
        return value
    return None
