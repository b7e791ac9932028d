"""The Redis / Valkey / Redis Cluster backend: many hosts share one prefix store.

``open_store("redis://cache:6379/0")`` (every URL form is in
:mod:`kvstore.store.engines.redis.options`) opens a :class:`RedisBackend` under the
same :class:`~kvstore.store.blocks.prefix.BlockPrefixStore` as LMDB: the same keys
(``kvstore/v1/<namespace>/<block hash>``...), the same record bytes, the
same lookup, budgets and eviction. redis-py is imported only when a Redis
URL is opened; without it the error says ``pip install 'mlx-kvstore[redis]'``.

Design
------
The backend contract asks for an ordered key/value store with atomic
read-modify-write transactions. Redis gives atomic ``MULTI``/``EXEC`` with
optimistic ``WATCH`` -- but, in a cluster, only over keys of one hash slot --
and no ordered keys. So (:mod:`.layout` has the key names):

* **Metadata in one slot, payloads everywhere.** Everything that must change
  atomically -- index entries, last uses, namespace totals, the meta record,
  each record's small *manifest*, and a sorted set of every key (the ordered
  index ``scan`` reads with ``ZRANGEBYLEX``) -- carries the hash tag
  ``{kvstore/v1}``: one slot, so one ``MULTI`` commits a save, an eviction
  or a delete whole. Record bytes -- 99.9% of what is stored -- go to
  *chunk* keys without a hash tag, which spread over every slot and node.
* **Payload before index.** A save writes its chunks first (under keys with a
  fresh nonce, so no two writes ever share a chunk), then commits the
  manifests and index entries in the ``MULTI``; a reader finds a record only
  through its manifest, so it can never see a half-written record. Chunks of
  a writer that dies before committing carry a one-hour pending expiry and
  disappear by themselves. Saves are idempotent: the store writes a block
  only when it is absent, checked under ``WATCH`` (a concurrent writer of the
  same block makes the ``EXEC`` fail and the save re-run, finding it stored).
* **One round trip per restore step.** Reading blocks is one ``MGET`` of their
  manifests (one slot: one command) and one pipelined batch of every chunk,
  sent to every node before any reply is read; a lookup's chain walk is one
  ``ZMSCORE``. Large values are sent from the caller's buffer without a copy
  and, with ``hiredis`` installed (the ``redis`` extra), parsed in C.
* **Expiry and server-side eviction touch payloads only.** ``ttl`` gives
  chunks an expiry refreshed by every read (``GETEX``); ``server_eviction``
  lets a ``volatile-*`` ``maxmemory`` policy evict chunks. The index never
  expires, so totals and chains stay consistent: a block whose payload is
  gone is a miss counted as ``evicted_by_server`` and removed from the index.

Trade-offs
----------
* The metadata slot's node serves every lookup's small reads and every
  commit: it is the cluster's hot spot, though it holds about 1/1000 of
  the bytes (an index entry is ~1 KiB per 256-token block of megabytes).
  A slot per namespace would spread that load, but a save evicts across
  namespaces when the store has a budget, and batched recency updates span
  every namespace a process used; Redis has no transaction across slots,
  so those writes could no longer be atomic.
* Transactions are optimistic: concurrent savers to one store conflict and
  re-run (each conflict costs the loser a round trip per read it made);
  chunks written before a lost conflict are reused, not rewritten.
* Deleting a record deletes its chunks after the commit; a reader that had
  already fetched the manifest then finds a chunk missing and gets a miss.
* No snapshot reads: a lookup's reads may straddle a concurrent commit; the
  store tolerates that (a vanished block is a miss, never wrong data).
* Payloads carry no checksum of their own; the record format's checksum
  (the store's ``verify``) catches damage, and a record whose chunks do not
  add up to the manifest's length is served as missing.
"""

from __future__ import annotations

from typing import Any

from kvstore.abc.store import Backend
from kvstore.errors import StoreConfigError
from kvstore.store.engines.redis.options import REDIS_OPTIONS, REDIS_SCHEMES

__all__ = ["open_redis_backend", "REDIS_OPTIONS", "REDIS_SCHEMES", "INSTALL_HINT"]

INSTALL_HINT = "pip install 'mlx-kvstore[redis]'"


def open_redis_backend(location: str, url: str, options: dict[str, Any]) -> Backend:
    """The Redis URL schemes (``redis``, ``rediss``, ``valkey``, ``redis+cluster``...).

    Raises:
        StoreConfigError: redis-py is not installed (the message says how to
            install it), or the URL or an option is malformed.
        StoreUnavailableError: the server cannot be reached.
    """
    try:
        import redis  # noqa: F401 - only to learn whether the extra is installed
    except ImportError as exc:
        scheme = url.partition(":")[0]
        raise StoreConfigError(
            f"[open_store] {scheme}:// stores need the Redis client (redis-py), which is not "
            f"installed: {INSTALL_HINT}.",
            url=scheme,
            missing="redis",
        ) from exc
    from kvstore.store.engines.redis.backend import RedisBackend

    return RedisBackend(url, **options)
