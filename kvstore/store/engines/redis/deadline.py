"""One deadline per call into Redis, reconnects and retries included (issue 18, damage 5).

redis-py bounds each socket operation (``socket_timeout``,
``socket_connect_timeout``) and retries on its own: a command after a
connection error, and -- since 5.x -- the whole connect-and-handshake of a
connection. Stacked on our own retries, a call against a server that stopped
answering (SIGSTOP, a partition, a host gone) blocked for several socket
timeouts more than documented. So:

* redis-py's retries are off (``Retry(NoBackoff(), 0)`` on every connection);
  :meth:`~kvstore.store.engines.redis.client.Connector.run` makes the only
  retries, ``retries`` of them, with a short backoff;
* a call runs under one :func:`deadline` of ``(retries + 1) * max(connect_timeout,
  socket_timeout)`` seconds, and every socket operation in it -- connect, TLS and
  protocol handshake, each send and each read -- is given the time left, at most
  its own timeout (:func:`bounded_connection_class`). When no time is left the
  call raises ``redis.TimeoutError``, which the store maps to
  ``StoreUnavailableError``.

A deadline is per thread; a call inside another's deadline shares it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from redis import exceptions as rx

__all__ = ["deadline", "remaining", "bounded_connection_class", "DeadlineExceeded"]

_local = threading.local()


class DeadlineExceeded(rx.TimeoutError):
    """A call's deadline passed (a ``redis.TimeoutError``: the boundary maps it)."""


@contextmanager
def deadline(seconds: float, what: str = "call") -> Iterator[float]:
    """Run the ``with`` body under a deadline ``seconds`` from now (or the one already
    running on this thread); yields the monotonic time it ends at."""
    outer = getattr(_local, "end", None)
    if outer is not None:
        yield outer
        return
    _local.end = time.monotonic() + seconds
    _local.limit = seconds
    _local.what = what
    try:
        yield _local.end
    finally:
        _local.end = None


def remaining() -> float | None:
    """Seconds left to the running deadline (``None``: none is running).

    Raises:
        DeadlineExceeded: it has passed.
    """
    end = getattr(_local, "end", None)
    if end is None:
        return None
    left = end - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded(
            f"the {_local.what}'s deadline of {_local.limit:g} s passed "
            f"(retries and reconnects included)"
        )
    return left


def _bound(timeout: float | None) -> float | None:
    left = remaining()
    if left is None:
        return timeout
    return left if timeout is None else min(timeout, left)


_CLASSES: dict[type, type] = {}


def bounded_connection_class(base: type) -> type:
    """``base`` (a redis-py connection class) with every socket operation bounded by
    the running deadline: the connect and handshake, each send, each read."""
    if getattr(base, "_kvstore_bounded", False):
        return base
    cls = _CLASSES.get(base)
    if cls is not None:
        return cls

    class Bounded(base):  # type: ignore[misc, valid-type]
        _kvstore_bounded = True

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._kv_timeouts: tuple[float | None, float | None] = (
                getattr(self, "socket_timeout", None),
                getattr(self, "socket_connect_timeout", None),
            )

        def _connect(self) -> Any:
            base_socket, base_connect = self._kv_timeouts
            self.socket_timeout = _bound(base_socket)
            self.socket_connect_timeout = _bound(base_connect)
            try:
                return super()._connect()
            finally:
                self.socket_timeout, self.socket_connect_timeout = base_socket, base_connect

        def _set_timeout(self) -> None:
            try:
                timeout = _bound(self._kv_timeouts[0])
            except DeadlineExceeded:
                self.disconnect()  # a reply may be pending: the connection is out of step
                raise
            sock = self._sock
            if sock is not None:
                sock.settimeout(timeout)

        def send_packed_command(self, command: Any, check_health: bool = True) -> None:
            self._set_timeout()
            super().send_packed_command(command, check_health)

        def read_response(self, *args: Any, **kwargs: Any) -> Any:
            self._set_timeout()
            return super().read_response(*args, **kwargs)

    Bounded.__name__ = Bounded.__qualname__ = f"Bounded{base.__name__}"
    _CLASSES[base] = Bounded
    return Bounded
