"""The connection layer: one Redis server or a Redis Cluster, behind one small interface.

* :meth:`Connector.meta` is a client of the node holding the metadata slot
  (the server itself in single-node mode); every metadata read goes there.
* :meth:`Connector.transaction_connection` lends a raw connection to that
  node for a ``WATCH``/``MULTI`` transaction.
* :meth:`Connector.batch` runs many single-key commands (payload chunks) in
  one round trip per node: every node's commands are sent before any reply
  is read, so nodes work in parallel. Large arguments are sent from the
  caller's buffer without being copied into a command buffer.

Timeouts bound every call: ``connect_timeout`` (default 2 s) per connection
attempt, ``socket_timeout`` (default 10 s) per socket read or write, and
``retries`` (default 1) further attempts after a connection error or
timeout, with a short backoff; so a call against a dead server fails within
about ``(retries + 1) * max(connect_timeout, socket_timeout)``. Pooled
connections reconnect by themselves once the server is back.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import redis
from redis import exceptions as rx
from redis.backoff import ExponentialBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from kvstore.store.engines.redis.options import RedisTarget

__all__ = [
    "Connector",
    "pack_commands",
    "DEFAULT_SOCKET_TIMEOUT",
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_RETRIES",
]

#: Seconds a socket read or write may block, when not given.
DEFAULT_SOCKET_TIMEOUT = 10.0
#: Seconds a connection attempt may take, when not given.
DEFAULT_CONNECT_TIMEOUT = 2.0
#: Further attempts after a connection error or a timeout, when not given.
DEFAULT_RETRIES = 1
# Arguments at least this big are sent from their own buffer (no copy into the command).
_ZERO_COPY = 1 << 16
_TRANSIENT = (rx.ConnectionError, rx.TimeoutError, rx.ClusterDownError, rx.TryAgainError)
_MOVED = (rx.MovedError, rx.AskError, rx.SlotNotCoveredError)

Command = Sequence[Any]


def pack_commands(commands: Sequence[Command]) -> list[bytes | memoryview]:
    """The RESP encoding of ``commands``; arguments of 64 KiB or more stay the caller's buffers."""
    out: list[bytes | memoryview] = []
    buf = bytearray()
    for args in commands:
        buf += b"*%d\r\n" % len(args)
        for arg in args:
            if isinstance(arg, str):
                arg = arg.encode()
            elif isinstance(arg, int):
                arg = b"%d" % arg
            size = arg.nbytes if isinstance(arg, memoryview) else len(arg)
            buf += b"$%d\r\n" % size
            if size >= _ZERO_COPY:
                out += [bytes(buf), arg]
                buf = bytearray(b"\r\n")
            else:
                buf += arg
                buf += b"\r\n"
    out.append(bytes(buf))
    return out


class Connector:
    """A redis-py client (or cluster client) for ``target``, and where the metadata lives.

    Args:
        target: the parsed URL.
        meta_key: a key in the metadata slot (the store's key index).
        socket_timeout, connect_timeout, retries: see the module docstring.
        max_connections: per node.
        ssl: extra TLS options (``ssl_ca_certs``...).
    """

    def __init__(
        self,
        target: RedisTarget,
        meta_key: bytes,
        *,
        socket_timeout: float,
        connect_timeout: float,
        retries: int,
        max_connections: int | None = None,
        ssl: dict[str, Any] | None = None,
    ) -> None:
        self.target = target
        self.cluster = target.cluster
        self.retries = retries
        self._meta_key = meta_key
        common: dict[str, Any] = {
            "username": target.username,
            "password": target.password,
            "socket_timeout": socket_timeout,
            "socket_connect_timeout": connect_timeout,
            "socket_keepalive": True,
            "retry": Retry(ExponentialBackoff(cap=0.5, base=0.05), retries),
            "ssl": target.tls,
            **(ssl or {}),
        }
        if max_connections is not None:
            common["max_connections"] = max_connections
        self.client: redis.Redis | RedisCluster
        if target.cluster:
            self.client = RedisCluster(
                startup_nodes=[ClusterNode(h, p) for h, p in target.nodes],
                require_full_coverage=True,
                **common,
            )
        else:
            ((host, port),) = target.nodes
            self.client = redis.Redis(host=host, port=port, db=target.db, **common)

    # ------------------------------------------------------------------ metadata node

    def meta(self) -> redis.Redis:
        """A client of the node serving the metadata slot."""
        if isinstance(self.client, RedisCluster):
            node = self.client.get_node_from_key(self._meta_key)
            return self.client.get_redis_connection(node)
        return self.client

    @contextmanager
    def transaction_connection(self) -> Iterator[Any]:
        """A raw connection to the metadata node, returned clean (no WATCH left) or closed."""
        pool = self.meta().connection_pool
        conn = pool.get_connection()
        clean = False
        try:
            yield conn
            clean = True
        finally:
            if not clean:
                conn.disconnect()  # a WATCH or a half-read reply must not reach the next user
            pool.release(conn)

    @staticmethod
    def call(conn: Any, commands: Sequence[Command]) -> list[Any]:
        """Send ``commands`` on ``conn`` in one write and read every reply.

        Error replies are returned as exception objects (every reply is read,
        so the connection stays in step); connection errors raise.
        """
        conn.send_packed_command(pack_commands(commands), check_health=False)
        return [_read_reply(conn) for _ in commands]

    # ------------------------------------------------------------------ batches

    def batch(self, commands: Sequence[Command], *, key_index: int = 1) -> list[Any]:
        """Run single-key ``commands`` (the key at ``key_index``), one round trip per node.

        Every command must be idempotent (it may be sent again after a
        connection error). Returns the replies in order; an error reply raises
        after every reply was read.
        """
        if not commands:
            return []
        for attempt in range(self.retries + 1):
            try:
                replies = self._batch_once(commands, key_index)
            except _TRANSIENT + _MOVED:
                if attempt == self.retries:
                    raise
                self._recover(attempt)
                continue
            # A slot that moved (resharding, failover) answers MOVED: ask the cluster again.
            if attempt < self.retries and any(isinstance(r, _TRANSIENT + _MOVED) for r in replies):
                self._recover(attempt)
                continue
            break
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies

    def _recover(self, attempt: int) -> None:
        time.sleep(min(0.5, 0.05 * 2**attempt))
        if isinstance(self.client, RedisCluster):
            self.client.nodes_manager.initialize()

    def _batch_once(self, commands: Sequence[Command], key_index: int) -> list[Any]:
        groups: dict[str, tuple[redis.Redis, list[int]]] = {}
        if isinstance(self.client, RedisCluster):
            rc = self.client
            for i, cmd in enumerate(commands):
                node = rc.get_node_from_key(cmd[key_index])
                groups.setdefault(node.name, (rc.get_redis_connection(node), []))[1].append(i)
        else:
            groups[""] = (self.client, list(range(len(commands))))
        lent: list[tuple[Any, Any, list[int]]] = []
        replies: list[Any] = [None] * len(commands)
        try:
            for node_client, indices in groups.values():
                pool = node_client.connection_pool
                conn = pool.get_connection()
                lent.append((pool, conn, indices))
                conn.send_packed_command(
                    pack_commands([commands[i] for i in indices]), check_health=False
                )
            for _, conn, indices in lent:
                for i in indices:
                    replies[i] = _read_reply(conn)
        except BaseException:
            for _, conn, _ in lent:
                conn.disconnect()
            raise
        finally:
            for pool, conn, _ in lent:
                pool.release(conn)
        return replies

    def nodes(self) -> list[redis.Redis]:
        """A client per primary node (one in single-node mode)."""
        if isinstance(self.client, RedisCluster):
            rc = self.client
            return [rc.get_redis_connection(n) for n in rc.get_primaries()]
        return [self.client]

    def close(self) -> None:
        self.client.close()


def _read_reply(conn: Any) -> Any:
    try:
        return conn.read_response()
    except rx.ResponseError as exc:
        return exc
