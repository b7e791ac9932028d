"""A process's LMDB environments: one per store directory, shared by every store open
on it, with the gate that lets a map resize run while no transaction is open.

LMDB forbids opening one environment twice in a process (its locks are per process),
and ``mdb_env_set_mapsize`` may only run while the process has no transaction open,
which python-lmdb leaves to the caller. An environment inherited across ``fork()`` is
closed in the child (its locks and reader slots are the parent's) and opened anew there.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lmdb

from kvstore.errors import StoreConfigError, StoreError
from kvstore.store.engines import writeback as _writeback
from kvstore.store.engines.lmdb_guard import NodeGuard
from kvstore.store.engines.lmdb_values import ValueFile

__all__ = ["Gate", "SharedEnv"]


class Gate:
    """In-process gate: every transaction holds it shared; a map resize holds it alone.

    LMDB's ``mdb_env_set_mapsize`` may only run while this process has no
    transaction open, which python-lmdb leaves to the caller to ensure.
    """

    def __init__(self) -> None:
        # On a plain lock: a re-entrant one (Condition's default) costs more to take, and
        # nothing here takes it twice.
        self._cond = threading.Condition(threading.Lock())
        self._shared = 0
        self._exclusive = False
        self._waiting = 0
        self._held: dict[int, int] = {}  # thread -> shared holds (re-entrant)

    @contextmanager
    def shared(self) -> Iterator[None]:
        self.enter()
        try:
            yield
        finally:
            self.leave()

    def enter(self) -> None:
        """Hold the gate shared (:meth:`shared` without its generator, for a reader)."""
        me = threading.get_ident()
        with self._cond:
            # A thread already inside may nest (re-entrant); others let a resize go first.
            while self._exclusive or (self._waiting and not self._held.get(me)):
                self._cond.wait()
            self._shared += 1
            self._held[me] = self._held.get(me, 0) + 1

    def leave(self) -> None:
        """Release what :meth:`enter` took."""
        me = threading.get_ident()
        with self._cond:
            self._shared -= 1
            held = self._held[me] - 1
            if held:
                self._held[me] = held
            else:
                del self._held[me]
            # Only a resize waits for shared holders to leave (a shared waiter waits
            # for the resize, which notifies): no notify otherwise, which costs a
            # lock check and a walk of the waiters on every read.
            if self._waiting:
                self._cond.notify_all()

    @contextmanager
    def exclusive(self, operation: str) -> Iterator[None]:
        with self._cond:
            if self._held.get(threading.get_ident()):
                raise StoreError(
                    f"[{operation}] The LMDB map must grow, which needs every read view of "
                    f"this store closed, but this thread holds one; leave the read() block "
                    f"before writing."
                )
            self._waiting += 1
            while self._exclusive or self._shared:
                self._cond.wait()
            self._waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


class SharedEnv:
    """One LMDB environment per directory per process, shared by every store open on it.

    LMDB forbids opening an environment twice in one process (its locks are
    per process), so a second ``open_store`` of the same path shares the first
    one's environment and gate; the last close closes it.
    """

    _open: dict[str, SharedEnv] = {}
    _lock = threading.Lock()

    def __init__(self, key: str, env: lmdb.Environment, readonly: bool) -> None:
        self.key = key
        self.env = env
        self.readonly = readonly
        #: The process that opened it (a forked child's own open makes its own).
        self.pid = os.getpid()
        self.gate = Gate()
        self.refs = 0
        self.guard = NodeGuard(env.stat()["psize"])
        #: The map's first byte, as python-lmdb's view of the first overflow value read
        #: says (``lmdb._LMDBView._value``); ``None`` until then and after each remap
        #: (``LMDBBackend._set_mapsize``); 0 where a second value's view was not
        #: where that puts it (then every value is read through python-lmdb).
        self.map_base: int | None = None
        #: Where the value ``map_base`` was learned from lies, until another value
        #: confirms it (``None`` then).
        self.map_unconfirmed: int | None = None
        self._data = Path(key) / "data.mdb"
        #: Starts a large synced commit's writeback early (None: read-only, unsynced,
        #: or not on Linux).
        self.writeback = (
            _writeback.writeback_for(self._data) if not readonly and env.flags()["sync"] else None
        )
        #: Large values written beside the file (:mod:`~kvstore.store.engines.lmdb_values`).
        self.values = ValueFile(Path(key), sync=bool(env.flags()["sync"]))

    def file_size(self) -> int:
        """Bytes of ``data.mdb`` now (it only grows while open)."""
        try:
            return self._data.stat().st_size
        except OSError:
            return 0

    @classmethod
    def acquire(cls, path: Path, url: str, **options: Any) -> SharedEnv:
        key = str(path.resolve())
        readonly = bool(options.get("readonly"))
        with cls._lock:
            shared = cls._open.get(key)
            if shared is not None and shared.pid != os.getpid():
                shared._close_inherited()  # the parent's, in a forked child: open anew
                shared = None
            if shared is None:
                env = lmdb.open(key, **options)
                if not readonly:
                    # Slots left by processes that died inside a read transaction
                    # would pin old pages forever (a SIGKILL leaves them behind).
                    env.reader_check()
                shared = cls._open[key] = cls(key, env, readonly)
            elif shared.readonly and not readonly:
                raise StoreConfigError(
                    f"[open_store] {url} is already open read-only in this process; close "
                    f"that store before opening it for writing.",
                    url=url,
                )
            shared.refs += 1
            return shared

    def release(self) -> None:
        with self._lock:
            self.refs -= 1
            if self.pid != os.getpid():
                self._close_inherited()
            elif self.refs == 0:
                del self._open[self.key]
                if self.writeback is not None:
                    self.writeback.close()
                self.values.close()
                self.env.close()

    def _close_inherited(self) -> None:
        """In a forked child, close this process's copy of the parent's environment (its
        map and file handles; the parent's stay open, and the child holds no lock or
        reader slot of it), so that the directory may be opened here (python-lmdb
        refuses a second environment of one path in a process)."""
        if self._open.get(self.key) is self:
            del self._open[self.key]
        self.values.close()  # this process's descriptors and mappings of the value file
        self.env.close()  # a no-op once closed

    @classmethod
    def _after_fork_in_child(cls) -> None:
        # A thread of the parent's may have held the lock at the fork.
        cls._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=SharedEnv._after_fork_in_child)
