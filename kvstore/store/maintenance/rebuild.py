"""Rebuilding an LMDB store whose file is damaged: every intact key copied into a fresh
file, swapped in whole (``kvstore verify --fix``, issue 18).

A damaged B-tree or free list cannot be repaired through LMDB: its writes
follow the damaged pointers and reuse the pages the free list wrongly names.
So the keys are read with :func:`kvstore.store.engines.lmdb_file.salvage`
(plain bounded reads of the file, no LMDB), written into a new environment
beside the store, and the two directories are exchanged atomically
(:func:`~kvstore.store.maintenance.migrate.swap.exchange_paths`). What the
damage made unreadable is gone -- a cache recomputes it -- and the store-level
repair (checksums, index, totals) runs on the rebuilt file next.

Other processes must not have the store open: they would go on using the old
file. The rebuild refuses while LMDB's reader table lists another process.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import lmdb

from kvstore.errors import CapabilityError, StoreError
from kvstore.store.engines.lmdb_file import salvage
from kvstore.store.engines.lmdb_values import FILE_NAME as VALUE_FILE
from kvstore.store.engines.lmdb_values import reader_slots
from kvstore.store.maintenance.migrate.swap import exchange_paths

__all__ = ["Rebuilt", "rebuild_lmdb"]

_BATCH_BYTES = 64 << 20


@dataclass(frozen=True)
class Rebuilt:
    """What a rebuild copied: keys and bytes kept, and the file's size before."""

    keys: int
    bytes: int
    old_file_bytes: int


def _other_readers(env: lmdb.Environment) -> list[int]:
    """Pids in the reader table other than this process (dead ones cleared first)."""
    env.reader_check()
    pids = {pid for pid, _ in reader_slots(env.readers())}
    pids.discard(os.getpid())
    return sorted(pids)


def rebuild_lmdb(path: str | os.PathLike[str], *, url: str | None = None) -> Rebuilt:
    """Replace the LMDB store at ``path`` by a fresh file holding every key that reads intact.

    Raises:
        StoreError: another process has the store open (the message lists them),
            or the new file could not be written (nothing was swapped).
    """
    store = Path(path)
    name = url or f"lmdb://{store}"
    old_bytes = (store / "data.mdb").stat().st_size
    try:
        env = lmdb.open(str(store), subdir=True, readonly=False, create=False, max_dbs=0, lock=True)
    except lmdb.Error:
        # LMDB refuses the file (a damaged meta page: magic, version, map size): take
        # the lock LMDB takes itself to say no other process has the store open.
        with _alone(store, name):
            return _rebuilt(store, old_bytes)
    try:
        others = _other_readers(env)
        if others:
            raise StoreError(
                f"[verify] {name} is open in {len(others)} other process(es) (pids "
                f"{', '.join(map(str, others))}); its damaged file can only be rebuilt while "
                f"nothing else uses it. Stop them and run 'kvstore verify {name} --fix' again.",
                url=name,
                pids=others,
            )
        with env.begin(write=True):  # holds the writer lock: nothing commits meanwhile
            return _rebuilt(store, old_bytes)
    finally:
        env.close()


def _rebuilt(store: Path, old_bytes: int) -> Rebuilt:
    fresh = store.with_name(f"{store.name}.rebuild-{os.getpid()}")
    shutil.rmtree(fresh, ignore_errors=True)
    try:
        keys, nbytes = _copy_into(store, fresh, old_bytes)
        _carry_values(store, fresh)
        _swap(store, fresh)
    finally:
        shutil.rmtree(fresh, ignore_errors=True)  # the old, damaged store after the swap
    return Rebuilt(keys, nbytes, old_bytes)


@contextmanager
def _alone(store: Path, name: str) -> Iterator[None]:
    """Held while no other process has ``store`` open, without LMDB: LMDB holds a
    shared ``fcntl`` lock on the first byte of ``lock.mdb`` while an environment is
    open (``mdb_env_excl_lock``), so an exclusive one is granted only to a sole user."""
    fd = os.open(store / "lock.mdb", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0)
        except OSError as exc:
            raise StoreError(
                f"[verify] {name} is open in another process; its damaged file can only be "
                f"rebuilt while nothing else uses it. Stop it and run 'kvstore verify "
                f"{name} --fix' again.",
                url=name,
            ) from exc
        yield
    finally:
        os.close(fd)


def _copy_into(store: Path, fresh: Path, size_hint: int) -> tuple[int, int]:
    fresh.mkdir()
    out = lmdb.open(str(fresh), map_size=max(2 * size_hint, 16 << 20), max_dbs=0, subdir=True)
    keys = nbytes = 0
    try:
        items = salvage(store)
        # A key whose size bits were flipped can read as one LMDB cannot hold (empty,
        # or longer than its maximum): it is not an intact key, so it is left behind.
        longest = out.max_key_size()
        done = False
        while not done:
            with out.begin(write=True) as txn:
                batch = 0
                for key, value in items:
                    if not 0 < len(key) <= longest:
                        continue
                    txn.put(key, value)
                    keys, nbytes, batch = keys + 1, nbytes + len(value), batch + len(value)
                    if batch >= _BATCH_BYTES:
                        break
                else:
                    done = True
        out.sync(True)
    finally:
        out.close()
    return keys, nbytes


def _carry_values(store: Path, fresh: Path) -> None:
    """The value file beside ``data.mdb`` (:mod:`kvstore.store.engines.lmdb_values`),
    whose values the copied pointers name, into the fresh store: hard-linked, or
    copied where the file system refuses links. Its bytes are checked as every value's
    are, when read (the store-level repair after a rebuild reads them all)."""
    source = store / VALUE_FILE
    if not source.exists():
        return
    try:
        os.link(source, fresh / VALUE_FILE)
    except OSError:
        shutil.copyfile(source, fresh / VALUE_FILE)


def _swap(store: Path, fresh: Path) -> None:
    """``fresh`` at ``store``'s path, the old store at ``fresh``'s."""
    try:
        exchange_paths(store, fresh)
    except CapabilityError:
        # No atomic exchange here: two renames (nothing else has the store open).
        aside = fresh.with_name(fresh.name + ".old")
        os.rename(store, aside)
        os.rename(fresh, store)
        os.rename(aside, fresh)
