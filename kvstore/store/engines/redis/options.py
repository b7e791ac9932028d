"""Redis URLs and options, parsed without importing redis-py (``open_store`` lists them).

URL forms (the scheme picks the protocol, TLS and single node or cluster)::

    redis://[user:password@]host[:port][/db]      one server (Redis or Valkey)
    rediss://...                                  the same over TLS
    valkey://..., valkeys://...                   aliases of redis:// and rediss://
    redis+cluster://host:port[,host:port...]      a Redis Cluster (any reachable nodes)
    rediss+cluster://..., valkey+cluster://..., valkeys+cluster://...

User and password are percent-decoded. The port defaults to 6379 and the
database to 0; a cluster has only database 0.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

from kvstore.errors import StoreConfigError
from kvstore.store.settings import (
    parse_bool,
    parse_byte_size,
    parse_int,
    parse_seconds,
)

__all__ = [
    "REDIS_SCHEMES",
    "REDIS_OPTIONS",
    "RedisTarget",
    "parse_redis_url",
    "parse_duration",
    "parse_key_prefix",
]

#: URL scheme -> (TLS, cluster).
REDIS_SCHEMES: dict[str, tuple[bool, bool]] = {
    "redis": (False, False),
    "rediss": (True, False),
    "valkey": (False, False),
    "valkeys": (True, False),
    "redis+cluster": (False, True),
    "rediss+cluster": (True, True),
    "valkey+cluster": (False, True),
    "valkeys+cluster": (True, True),
}

DEFAULT_PORT = 6379
_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*")
_DURATION_UNITS = {None: 1.0, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_PREFIX = re.compile(r"[A-Za-z0-9:/._-]{0,64}")


@dataclass(frozen=True)
class RedisTarget:
    """Where a Redis URL points: the nodes, credentials, database, TLS and mode."""

    url: str
    nodes: tuple[tuple[str, int], ...]
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False
    cluster: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def parse_duration(value: object, name: str = "ttl") -> float | None:
    """Seconds from a number or ``"90"``, ``"500ms"``, ``"30s"``, ``"15m"``, ``"12h"``, ``"7d"``;
    ``None`` (or ``"none"``) for no limit."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
        return None
    if isinstance(value, str):
        m = _DURATION.fullmatch(value.lower())
        if m is None:
            raise StoreConfigError(
                f"[open_store] {name} must be a duration such as 30, '500ms', '15m', '12h' or "
                f"'7d'; received {value!r}.",
                setting=name,
                found=value,
            )
        value = float(m.group(1)) * _DURATION_UNITS[m.group(2)]
    seconds = parse_seconds(value, name)
    if seconds <= 0:
        raise StoreConfigError(
            f"[open_store] {name} must be positive (or None for no limit); received {value!r}.",
            setting=name,
            found=value,
        )
    return seconds


def parse_key_prefix(value: object) -> str:
    """A prefix in front of every key, so several stores can share one database."""
    if not isinstance(value, str) or not _PREFIX.fullmatch(value):
        raise StoreConfigError(
            f"[open_store] key_prefix is up to 64 characters of [A-Za-z0-9:/._-] (no braces: "
            f"they would move keys between cluster slots); received {value!r}.",
            setting="key_prefix",
            found=value,
        )
    return value


def _parse_cert_reqs(value: object) -> str:
    if value not in ("none", "optional", "required"):
        raise StoreConfigError(
            f"[open_store] ssl_cert_reqs is 'none', 'optional' or 'required'; received {value!r}.",
            setting="ssl_cert_reqs",
            found=value,
        )
    return str(value)


def _parse_path(name: str) -> Callable[[object], str]:
    def parse(value: object) -> str:
        if not isinstance(value, str) or not value:
            raise StoreConfigError(
                f"[open_store] {name} is a file path; received {value!r}.",
                setting=name,
                found=value,
            )
        return value

    return parse


def _positive_seconds(name: str) -> Callable[[object], float]:
    def parse(value: object) -> float:
        seconds = parse_duration(value, name)
        if seconds is None:
            raise StoreConfigError(
                f"[open_store] {name} must be a positive number of seconds; a store call must "
                f"not wait forever for a server. Received {value!r}.",
                setting=name,
                found=value,
            )
        return seconds

    return parse


#: Options of the Redis backends (keyword arguments or URL query parameters).
REDIS_OPTIONS: dict[str, Callable[[Any], Any]] = {
    "socket_timeout": _positive_seconds("socket_timeout"),
    "connect_timeout": _positive_seconds("connect_timeout"),
    "retries": lambda v: parse_int(v, "retries", 0, 10),
    "chunk_size": lambda v: parse_int(parse_byte_size(v, "chunk_size"), "chunk_size", 16),
    "ttl": lambda v: parse_duration(v, "ttl"),
    "server_eviction": lambda v: parse_bool(v, "server_eviction"),
    "readonly": lambda v: parse_bool(v, "readonly"),
    "key_prefix": parse_key_prefix,
    "max_connections": lambda v: parse_int(v, "max_connections", 1),
    "ssl_ca_certs": _parse_path("ssl_ca_certs"),
    "ssl_certfile": _parse_path("ssl_certfile"),
    "ssl_keyfile": _parse_path("ssl_keyfile"),
    "ssl_cert_reqs": _parse_cert_reqs,
}


def _bad_url(url: str, rule: str) -> StoreConfigError:
    return StoreConfigError(
        f"[open_store] {rule}; received {url!r}. Examples: redis://localhost:6379/0, "
        f"rediss://user:secret@cache.example:6380/1, redis+cluster://10.0.0.1:7000,10.0.0.2:7000.",
        url=url,
    )


def _parse_node(url: str, text: str) -> tuple[str, int]:
    if text.startswith("["):  # [ipv6]:port
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, port_text = text.rpartition(":") if ":" in text else (text, "", "")
    if not host:
        raise _bad_url(url, f"A Redis URL names a host; {text!r} has none")
    if not port_text:
        return host, DEFAULT_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise _bad_url(url, f"A port is a number from 1 to 65535; {text!r} has {port_text!r}")
    return host, int(port_text)


def parse_redis_url(url: str) -> RedisTarget:
    """The nodes, credentials, database, TLS and mode a Redis URL names.

    Raises:
        StoreConfigError: an unknown scheme, a bad host, port or database, or a
            cluster URL naming a database other than 0.
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in REDIS_SCHEMES:
        raise _bad_url(url, f"Unknown Redis scheme {scheme!r} (known: {', '.join(REDIS_SCHEMES)})")
    tls, cluster = REDIS_SCHEMES[scheme]
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username = password = None
    if userinfo:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    if not hosts:
        raise _bad_url(url, "A Redis URL names at least one host:port")
    nodes = tuple(_parse_node(url, h) for h in hosts.split(","))
    if len(nodes) > 1 and not cluster:
        raise _bad_url(url, "Several hosts need a cluster URL (redis+cluster://h1:p1,h2:p2)")
    path = parts.path.strip("/")
    if path and not path.isdigit():
        raise _bad_url(url, f"The path of a Redis URL is a database number; got {path!r}")
    db = int(path) if path else 0
    if cluster and db:
        raise _bad_url(url, f"A Redis Cluster has only database 0; the URL asks for {db}")
    return RedisTarget(url, nodes, db, username, password, tls, cluster)
