"""An in-process backend: a sorted dict under a lock. For tests and as a fast L1 tier.

``memory://`` opens a fresh private store; ``memory://<name>`` opens the
store of that name in this process, shared by every ``open_store`` of the
same URL until the process exits. Nothing is persisted.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from kvstore.abc.store import Backend, Buffer
from kvstore.errors import StoreConfigError
from kvstore.store.keys import prefix_successor

__all__ = ["MemoryBackend", "open_memory_backend"]

T = TypeVar("T")
_MISSING = object()


class _State:
    """The shared contents: a dict plus its keys kept sorted for ordered scans."""

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}
        self.keys: list[bytes] = []
        self.lock = threading.RLock()


_NAMED: dict[str, _State] = {}
_NAMED_LOCK = threading.Lock()


class _MemoryView:
    """Reads and (inside a transaction) writes, with an undo log for rollback."""

    def __init__(self, state: _State, undo: list[tuple[bytes, Any]] | None = None) -> None:
        self._s = state
        self._undo = undo

    def get(self, key: bytes) -> Buffer | None:
        with self._s.lock:
            value = self._s.data.get(key)
        return None if value is None else memoryview(value)

    def contains(self, key: bytes) -> bool:
        return key in self._s.data

    def scan(
        self, prefix: bytes, *, start: bytes | None = None, reverse: bool = False
    ) -> Iterator[tuple[bytes, Buffer]]:
        with self._s.lock:
            keys = self._s.keys
            lo = bisect.bisect_left(keys, prefix)
            hi = bisect.bisect_left(keys, prefix_successor(prefix))
            if start is None:
                picked = keys[lo:hi]
            elif not reverse:
                picked = keys[max(lo, bisect.bisect_left(keys, start)) : hi]
            else:
                picked = keys[lo : min(hi, bisect.bisect_left(keys, start))]
            if reverse:
                picked.reverse()
        for key in picked:
            value = self._s.data.get(key)
            if value is not None:
                yield key, memoryview(value)

    def keys(self, prefix: bytes) -> Iterator[bytes]:
        with self._s.lock:
            keys = self._s.keys
            lo = bisect.bisect_left(keys, prefix)
            picked = keys[lo : bisect.bisect_left(keys, prefix_successor(prefix))]
        yield from picked

    def put(self, key: bytes, value: Any, *, if_absent: bool = False) -> bool:
        s = self._s
        old = s.data.get(key, _MISSING)
        if old is not _MISSING and if_absent:
            return False
        assert self._undo is not None, "writes happen inside transact()"
        self._undo.append((key, old))
        if old is _MISSING:
            bisect.insort(s.keys, key)
        s.data[key] = bytes(value)
        return True

    def delete(self, key: bytes) -> bool:
        s = self._s
        old = s.data.pop(key, _MISSING)
        if old is _MISSING:
            return False
        assert self._undo is not None, "writes happen inside transact()"
        self._undo.append((key, old))
        del s.keys[bisect.bisect_left(s.keys, key)]
        return True

    def rollback(self) -> None:
        s = self._s
        assert self._undo is not None
        for key, old in reversed(self._undo):
            present = key in s.data
            if old is _MISSING:
                if present:
                    del s.data[key]
                    del s.keys[bisect.bisect_left(s.keys, key)]
            else:
                if not present:
                    bisect.insort(s.keys, key)
                s.data[key] = old


class MemoryBackend(Backend):
    """A sorted in-memory map; transactions hold the lock and roll back on error."""

    def __init__(self, name: str | None = None, *, url: str | None = None) -> None:
        self.url = url or (f"memory://{name}" if name else "memory://")
        if name is None:
            self._state = _State()
        else:
            with _NAMED_LOCK:
                self._state = _NAMED.setdefault(name, _State())

    @property
    def supports_zero_copy(self) -> bool:
        return True

    @contextmanager
    def reader(self) -> Iterator[_MemoryView]:
        yield _MemoryView(self._state)

    def _transact(self, fn: Callable[[_MemoryView], T], size_hint: int) -> T:
        with self._state.lock:
            view = _MemoryView(self._state, undo=[])
            try:
                return fn(view)
            except BaseException:
                view.rollback()
                raise

    def stats(self) -> dict[str, Any]:
        with self._state.lock:
            return {
                "engine": "memory",
                "entries": len(self._state.data),
                "used_bytes": sum(len(k) + len(v) for k, v in self._state.data.items()),
            }

    def close(self) -> None:
        pass  # named stores live as long as the process; private ones with this object


def open_memory_backend(location: str, url: str, options: dict[str, Any]) -> MemoryBackend:
    """The ``memory`` URL scheme: ``location`` is an optional store name."""
    if options:
        raise StoreConfigError(
            f"[open_store] The memory backend takes no options; received "
            f"{', '.join(sorted(options))}.",
            found=sorted(options),
        )
    return MemoryBackend(location or None, url=url)
