"""The Redis / Valkey / Redis Cluster backend (design: :mod:`kvstore.store.engines.redis`)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any, TypeVar, cast
from urllib.parse import urlsplit, urlunsplit

from redis import exceptions as rx

from kvstore.abc.store import Backend, Buffer
from kvstore.errors import CorruptEntryError, FormatVersionError, StoreConfigError, StoreError
from kvstore.store.engines.boundary import translate_errors
from kvstore.store.engines.redis.client import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_RETRIES,
    DEFAULT_SOCKET_TIMEOUT,
    Command,
    Connector,
)
from kvstore.store.engines.redis.errors import REDIS_ERRORS
from kvstore.store.engines.redis.layout import Layout, Manifest
from kvstore.store.engines.redis.options import parse_redis_url
from kvstore.store.engines.redis.transaction import ChunkMemo, RedisTransaction, lex_pages

__all__ = ["RedisBackend", "DEFAULT_CHUNK_SIZE"]

T = TypeVar("T")

#: Records above this many bytes are split into several chunk keys.
DEFAULT_CHUNK_SIZE = 64 << 20
# With server_eviction and no ttl, chunks still need an expiry for volatile-* policies
# to consider them; one far in the future (100 years, in ms) never fires.
_EVICTABLE_TTL_MS = 100 * 365 * 86_400_000
_ATTEMPTS = 64


def redact(url: str) -> str:
    """``url`` with its password replaced by ``***`` (URLs end up in error messages)."""
    parts = urlsplit(url)
    user, at, hosts = parts.netloc.rpartition("@")
    if not at or ":" not in user:
        return url
    return urlunsplit(parts._replace(netloc=f"{user.partition(':')[0]}:***@{hosts}"))


class _ReadView:
    """Reads straight from the server (Redis has no snapshots: each call sees the latest)."""

    def __init__(self, backend: RedisBackend) -> None:
        self._b = backend

    def get(self, key: bytes) -> Buffer | None:
        return self._b.get_many([key])[0]

    def contains(self, key: bytes) -> bool:
        return self._b.contains_many([key])[0]

    def scan(
        self, prefix: bytes, *, start: bytes | None = None, reverse: bool = False
    ) -> Iterator[tuple[bytes, Buffer]]:
        with self._b.boundary("read"):
            for keys in self._b.key_pages(prefix, start, reverse):
                for key, value in zip(keys, self._b.fetch(keys)):
                    if value is not None:
                        yield key, value

    def keys(self, prefix: bytes) -> Iterator[bytes]:
        with self._b.boundary("read"):
            for keys in self._b.key_pages(prefix, None, False):
                yield from keys


class RedisBackend(Backend):
    """A prefix-store backend on one Redis/Valkey server or a Redis Cluster.

    Args:
        url: ``redis://``, ``rediss://``, ``valkey://``, ``redis+cluster://``...
            (:mod:`kvstore.store.engines.redis.options`).
        socket_timeout: seconds a socket read or write may block (default 10).
        connect_timeout: seconds a connection attempt may take (default 2).
        retries: further attempts after a connection error or timeout (default 1).
        chunk_size: records larger than this are split into chunks (default 64 MiB).
        ttl: seconds a record's payload lives after it was last written or
            read (``None``: no expiry). The index never expires; an entry
            whose payload is gone is a miss ``evicted_by_server``, then removed.
        server_eviction: let the server's ``maxmemory`` policy evict payloads
            (which needs a ``volatile-*`` policy: the index has no expiry and
            is never evicted). Then set no store byte budget.
        readonly: refuse writes.
        key_prefix: put in front of every key, so stores can share a database.
        max_connections: connections per node.
        **ssl: ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``, ``ssl_cert_reqs``.
    """

    def __init__(
        self,
        url: str,
        *,
        socket_timeout: float = DEFAULT_SOCKET_TIMEOUT,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        retries: int = DEFAULT_RETRIES,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        ttl: float | None = None,
        server_eviction: bool = False,
        readonly: bool = False,
        key_prefix: str = "",
        max_connections: int | None = None,
        **ssl: Any,
    ) -> None:
        target = parse_redis_url(url)
        self.url = redact(url)
        self.layout = Layout(key_prefix)
        self.chunk_size = chunk_size
        self.ttl = ttl
        self.server_eviction = server_eviction
        self._readonly = readonly
        if ttl is not None:
            self._ttl_ms: int | None = max(1, round(ttl * 1000))
        else:
            self._ttl_ms = _EVICTABLE_TTL_MS if server_eviction else None
        with self.boundary("open_store"):
            self.connector = Connector(
                target,
                self.layout.index,
                socket_timeout=socket_timeout,
                connect_timeout=connect_timeout,
                retries=retries,
                max_connections=max_connections,
                ssl=ssl,
            )
            try:
                self.server = self._probe()
            except BaseException:
                self.connector.close()
                raise

    def boundary(self, operation: str) -> Any:
        """Translate redis-py exceptions raised inside the ``with`` (see :mod:`.errors`)."""
        return translate_errors(REDIS_ERRORS, operation, self.url)

    def _probe(self) -> dict[str, Any]:
        """Reach the server (fail now, not at the first lookup) and check the eviction policy."""
        meta = self.connector.meta()
        info = self.connector.run(lambda: meta.info("server"), "open")
        engine = (
            f"valkey {info['valkey_version']}"
            if "valkey_version" in info
            else f"redis {info.get('redis_version', '?')}"
        )
        if self.server_eviction:
            self._check_policy()
        return {"engine": engine, "mode": "cluster" if self.connector.cluster else "single"}

    def _check_policy(self) -> None:
        for node in self.connector.nodes():
            try:
                reply = self.connector.run(partial(node.config_get, "maxmemory-policy"), "open")
                policy = reply.get("maxmemory-policy", "")
            except rx.ResponseError:
                return  # CONFIG is disabled (managed services): trust the operator
            if not str(policy).startswith("volatile-"):
                raise StoreConfigError(
                    f"[open_store] server_eviction=true needs a volatile-* maxmemory-policy "
                    f"(volatile-lru, volatile-lfu...) so the server evicts payloads but never the "
                    f"index; {self.url} has {policy!r}. Set one with CONFIG SET maxmemory-policy "
                    f"volatile-lru, or drop server_eviction.",
                    found=policy,
                    url=self.url,
                )

    # ------------------------------------------------------------------ capabilities

    @property
    def supports_ttl(self) -> bool:
        return True

    @property
    def supports_multiprocess(self) -> bool:
        return True

    @property
    def supports_persistence(self) -> bool:
        return True  # the data lives in the server, not in this process

    @property
    def supports_pipelining(self) -> bool:
        return True

    @property
    def supports_writes(self) -> bool:
        return not self._readonly

    # ------------------------------------------------------------------ reads

    def manifest(self, key: bytes, raw: bytes) -> Manifest | None:
        """The manifest of record ``key``; ``None`` if ``raw`` is not one this reader reads."""
        try:
            return Manifest.decode(raw, key)
        except (CorruptEntryError, FormatVersionError):
            return None  # unusable: served as missing, then removed like an evicted payload

    def settle_chunk(self, chunk: bytes) -> Command:
        """The command that makes a committed chunk permanent, or gives it the store's TTL."""
        if self._ttl_ms is None:
            return ("PERSIST", chunk)
        return ("PEXPIRE", chunk, self._ttl_ms)

    def payloads(self, records: Sequence[tuple[bytes, Manifest]]) -> list[bytes | None]:
        """The bytes of ``records``: every chunk of every record in one round trip per node.

        A record with a chunk missing (evicted, expired, deleted meanwhile) is ``None``.
        """
        layout = self.layout
        sliding = self.ttl is not None
        commands: list[Command] = [
            ("GETEX", chunk, "PX", self._ttl_ms) if sliding else ("GET", chunk)
            for key, m in records
            for chunk in layout.chunks(key, m)
        ]
        replies = self.connector.batch(commands)
        out: list[bytes | None] = []
        at = 0
        for _, m in records:
            parts = replies[at : at + m.chunks]
            at += m.chunks
            if any(p is None for p in parts):
                out.append(None)
                continue
            value = parts[0] if len(parts) == 1 else b"".join(parts)
            out.append(value if len(value) == m.total else None)
        return out

    def resolve(self, keys: Sequence[bytes], raws: Sequence[bytes | None]) -> list[Any]:
        """Values of ``keys`` from their raw metadata values (records: fetch the chunks)."""
        out: list[Any] = list(raws)
        records: list[tuple[int, bytes, Manifest]] = []
        for i, (key, raw) in enumerate(zip(keys, raws)):
            if raw is not None and self.layout.is_record(key):
                m = self.manifest(key, raw)
                if m is None:
                    out[i] = None
                else:
                    records.append((i, key, m))
        if records:
            found = self.payloads([(key, m) for _, key, m in records])
            for (i, _, _), value in zip(records, found):
                out[i] = value
        return out

    def fetch(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Values of ``keys`` in two round trips: manifests and values, then every chunk."""
        if not keys:
            return []
        return self.resolve(keys, self.raw_values(keys))

    def raw_values(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The metadata values of ``keys`` (manifests for records): one ``MGET``, one slot."""
        meta = self.connector.meta()
        raws = self.connector.run(lambda: meta.mget([self.layout.meta(k) for k in keys]), "read")
        return cast("list[bytes | None]", raws)  # decode_responses is off: bytes

    def key_pages(self, prefix: bytes, start: bytes | None, reverse: bool) -> Iterator[list[bytes]]:
        """Stored keys under ``prefix`` in scan order, a page per round trip (pages grow)."""
        meta, index = self.connector.meta(), self.layout.index

        def query(lo: bytes, hi: bytes, count: int) -> list[bytes]:
            if reverse:
                page = lambda: meta.zrevrangebylex(index, hi, lo, start=0, num=count)  # noqa: E731
            else:
                page = lambda: meta.zrangebylex(index, lo, hi, start=0, num=count)  # noqa: E731
            return cast("list[bytes]", self.connector.run(page, "scan"))

        return lex_pages(query, prefix, start, reverse)

    @contextmanager
    def reader(self) -> Iterator[_ReadView]:
        yield _ReadView(self)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        # One deadline for both round trips (manifests, then chunks).
        with self.boundary("read"), self.connector.deadline("read"):
            return self.fetch(list(keys))

    @contextmanager
    def view_many(self, keys: Sequence[bytes]) -> Iterator[list[Buffer | None]]:
        # Values are owned bytes: nothing to release, but the contract is the same.
        yield list(self.get_many(keys))

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []
        meta = self.connector.meta()
        with self.boundary("read"):
            scores = self.connector.run(
                lambda: meta.zmscore(self.layout.index, list(keys)),  # type: ignore[arg-type]
                "read",
            )
        return [s is not None for s in scores]

    def scan(self, prefix: bytes, *, keys_only: bool = False) -> list[tuple[bytes, bytes | None]]:
        with self.boundary("read"):
            pages = list(self.key_pages(prefix, None, False))
            if keys_only:
                return [(k, None) for keys in pages for k in keys]
            out: list[tuple[bytes, bytes | None]] = []
            for keys in pages:
                out += [(k, v) for k, v in zip(keys, self.fetch(keys)) if v is not None]
            return out

    # ------------------------------------------------------------------ writes

    def _transact(self, fn: Callable[[RedisTransaction], T], size_hint: int) -> T:
        memo = ChunkMemo()
        txn: RedisTransaction | None = None
        try:
            with self.boundary("write"):
                for attempt in range(_ATTEMPTS):
                    with self.connector.transaction_connection() as conn:
                        txn = RedisTransaction(self, conn, memo)
                        try:
                            result = fn(txn)
                        except Exception:
                            # fn may have read an inconsistent state another commit made;
                            # only an error on a consistent view is the caller's.
                            if txn.watch_broken():
                                continue
                            raise
                        if txn.commit():
                            return result
                    time.sleep(random.uniform(0, min(0.05, 0.001 * 2**attempt)))
                raise StoreError(
                    f"[write] {_ATTEMPTS} attempts of one transaction on {self.url} lost to "
                    f"concurrent writers; retry, or write less often to the same namespace.",
                    url=self.url,
                )
        finally:
            # Only chunks no committed manifest names; committed is set before any
            # post-commit step can fail.
            self._drop_unused(memo, txn.committed if txn is not None else {})

    def _drop_unused(self, memo: ChunkMemo, committed: dict[bytes, Manifest]) -> None:
        """Delete chunks no committed manifest names (best effort: they expire anyway)."""
        doomed = [
            ("DEL", chunk)
            for key, m in memo.unused(committed)
            for chunk in self.layout.chunks(key, m)
        ]
        try:
            self.connector.batch(doomed)
        except rx.RedisError:
            pass  # written with a pending expiry: the server removes them within the hour

    def set_ttl(self, keys: Sequence[bytes], seconds: float) -> None:
        """Let the payloads of the records ``keys`` expire after ``seconds``.

        Only record payloads expire; the index never does (a record whose
        payload expired is then a miss ``evicted_by_server`` and is removed).
        """
        self.require("supports_ttl", "set_ttl")
        others = [k for k in keys if not self.layout.is_record(k)]
        if others:
            raise StoreConfigError(
                f"[set_ttl] Only record keys (kvstore/v1/<namespace>/<hash>) expire, so the "
                f"index stays consistent; received {others[0]!r}.",
                found=others[0],
            )
        ms = max(1, round(seconds * 1000))
        with self.boundary("set_ttl"), self.connector.deadline("set_ttl"):
            raws = self.raw_values(keys)
            commands: list[Command] = []
            for key, raw in zip(keys, raws):
                m = None if raw is None else self.manifest(key, raw)
                if m is not None:
                    commands += [("PEXPIRE", c, ms) for c in self.layout.chunks(key, m)]
            self.connector.batch(commands)

    # ------------------------------------------------------------------ stats

    def stats(self) -> dict[str, Any]:
        with self.boundary("stats"):
            meta = self.connector.meta()
            entries = self.connector.run(lambda: meta.zcard(self.layout.index), "stats")
            used = evicted = expired = maxmemory = 0
            policies = set()
            nodes = self.connector.nodes()
            for node in nodes:
                info = self.connector.run(node.info, "stats")
                used += int(info.get("used_memory", 0))
                maxmemory += int(info.get("maxmemory", 0))
                policies.add(info.get("maxmemory_policy", "?"))
                evicted += int(info.get("evicted_keys", 0))
                expired += int(info.get("expired_keys", 0))
        return {
            **self.server,
            "url": self.url,
            "nodes": len(nodes),
            "entries": entries,
            "used_bytes": used,
            "maxmemory": maxmemory,
            "maxmemory_policy": ",".join(sorted(map(str, policies))),
            "evicted_keys": evicted,
            "expired_keys": expired,
            "chunk_size": self.chunk_size,
            "ttl": self.ttl,
            "server_eviction": self.server_eviction,
        }

    def close(self) -> None:
        connector = getattr(self, "connector", None)
        if connector is not None:
            self.connector = None  # type: ignore[assignment]
            connector.close()
