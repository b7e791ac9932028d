"""The settings record in the backend: read on open, created or updated, budgets, and repair.

A store's settings live in ``kvstore/v1/__meta__`` and, byte for byte, in its
copy ``kvstore/v1/!meta`` (format: :mod:`kvstore.store.settings`; the two keys
sort apart, so one damaged LMDB page does not take both). Opening resolves
defaults < stored < explicit and writes the record when that changes it;
budgets can change later (``set_budget``, another process), so code that
enforces them reads the record again inside its transaction.

Damage (issue 18): the record is checksummed, and read from whichever copy is
intact. A writable open rewrites a damaged, missing or format-1 copy (the
store repairs itself). With neither copy intact a store that holds blocks is
*damaged*: opening it says to run ``kvstore verify --fix``, and ``verify``
(``recover=True``) opens it with settings rebuilt from what it holds (the block
size of its blocks; storage policy and budgets back to their defaults), which
``verify(repair=True)`` writes.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from kvstore.abc.store import Backend, ReadView, StoreSettings, WriteView
from kvstore.errors import CorruptEntryError, StoreConfigError
from kvstore.store import keys as K
from kvstore.store.blocks.index import iter_entries
from kvstore.store.settings import (
    DEFAULT_FILE_VALUES,
    damaged_meta,
    decode_meta,
    encode_meta,
    resolve_settings,
)

__all__ = [
    "StoredSettings",
    "read_settings",
    "open_settings",
    "current_settings",
    "write_budget",
    "settings_problems",
    "repair_settings",
    "rebuilt_settings",
]


@dataclass(frozen=True)
class StoredSettings:
    """The settings as stored, and what is wrong with their two copies."""

    settings: StoreSettings
    created: float | None
    #: One line per copy that is damaged, missing or in the old format 1.
    problems: tuple[str, ...] = ()
    #: Neither copy read: ``settings`` were rebuilt from the blocks.
    rebuilt: bool = False


def read_settings(view: ReadView, url: str, *, recover: bool = False) -> StoredSettings | None:
    """The settings of the store in ``view``; ``None`` where there is no store.

    Raises:
        CorruptEntryError: neither copy is intact and the store holds blocks (unless
            ``recover``: then the settings are rebuilt from them); the message says to
            run ``kvstore verify --fix``.
        FormatVersionError: an intact record of a newer kvstore.
    """
    good: tuple[StoreSettings, float] | None = None
    problems: list[str] = []
    first_damage: CorruptEntryError | None = None
    for key in K.META_KEYS:
        raw = view.get(key)
        if raw is None:
            problems.append(f"{key.decode()} is missing")
            continue
        try:
            decoded = decode_meta(raw, url)
        except CorruptEntryError as exc:
            first_damage = first_damage or exc
            problems.append(f"{key.decode()}: {exc.problem}")  # type: ignore[attr-defined]
            continue
        if bytes(raw[:4]) != b"KVSM":
            problems.append(f"{key.decode()} is in format 1 (no checksum)")
        good = good or decoded
    if good is not None:
        return StoredSettings(good[0], good[1], tuple(problems))
    if not _holds_blocks(view):
        if first_damage is None:
            return None  # no store here (yet)
        if not recover:
            raise first_damage
    elif not recover:
        raise first_damage or damaged_meta(url, "both copies are missing")
    return StoredSettings(rebuilt_settings(view), None, tuple(problems), rebuilt=True)


def _holds_blocks(view: ReadView) -> bool:
    """Whether any key of the kvstore layout but the settings record is stored."""
    for key in view.keys(K.SCHEMA):
        if key not in K.META_KEYS:
            return True
    return False


def rebuilt_settings(view: ReadView) -> StoreSettings:
    """Settings rebuilt from the blocks: their block size (that of most full blocks),
    everything else the defaults (the storage policy and budgets are not recoverable)."""
    sizes: Counter[int] = Counter()
    namespaces = {key.split(b"/")[2] for key in view.keys(K.SCHEMA) if b"/.c/" in key}
    for ns in sorted(namespaces):
        for _, entry in iter_entries(view, K.namespace_dir(ns) + b".c/", with_tokens=False):
            sizes[entry.ntokens] += 1
    default = StoreSettings()
    return replace(default, block_size=sizes.most_common(1)[0][0]) if sizes else default


def open_settings(
    backend: Backend,
    explicit: dict[str, Any],
    *,
    recover: bool = False,
    clock: Callable[[], float] = time.time,
) -> StoreSettings:
    """The settings of the store in ``backend``, creating, updating or repairing its record,
    and the backend told where its large values go (``values``).

    ``clock`` stamps a record created now (the store's clock, so a store built
    with a fixed clock is the same bytes every time). A store created now on a backend
    that can keep a value file takes :data:`~kvstore.store.settings.DEFAULT_FILE_VALUES`
    unless ``explicit`` says otherwise.

    Raises:
        StoreConfigError: a read-only open of an empty location, a location holding
            someone else's data, or an explicit setting that conflicts with the stored one.
        CorruptEntryError: the record is damaged (both copies), unless ``recover``.
        FormatVersionError: a meta record of a newer kvstore.
    """
    created = {"values": DEFAULT_FILE_VALUES} if backend.supports_value_file else {}
    with backend.reader() as view:
        stored = read_settings(view, backend.url, recover=recover)
    if stored is None and not backend.supports_writes:
        _refuse_foreign(backend)
        raise StoreConfigError(
            f"[open_store] {backend.url} is empty: no store to open read-only.", url=backend.url
        )
    settings, changed = resolve_settings(
        None if stored is None else stored.settings, explicit, created
    )
    # A damaged copy is rewritten now, except where verify is to report and repair it.
    mend = stored is not None and bool(stored.problems) and not recover
    if (changed or mend) and backend.supports_writes:
        settings = backend.transact(lambda txn: _write_meta(backend, txn, explicit, clock, created))
    where = settings.values
    if where == "inline" and backend.has_value_file:
        where = "file"  # settings rebuilt from the blocks (recover): the file says so
    elif where == "file" and not backend.supports_value_file and "values" not in explicit:
        where = "inline"  # keys copied from a store that kept one: none is here
    backend.write_values_to(where)  # refuses an explicit "file" it cannot keep
    return replace(settings, values=where) if where != settings.values else settings


def _write_meta(
    backend: Backend,
    txn: WriteView,
    explicit: dict[str, Any],
    clock: Callable[[], float],
    created: dict[str, Any] | None,
) -> StoreSettings:
    # Re-read inside the transaction: another process may have created the
    # store (or changed a budget) since we looked.
    stored = read_settings(txn, backend.url)
    if stored is None:
        _refuse_foreign(backend)  # consistent: we hold the write lock, nothing else commits
    settings, changed = resolve_settings(
        None if stored is None else stored.settings, explicit, created
    )
    if changed or stored is None or stored.problems:
        _put(txn, settings, clock() if stored is None else stored.created)
    return settings


def _put(txn: WriteView, settings: StoreSettings, created: float | None) -> None:
    record = encode_meta(settings, created)
    for key in K.META_KEYS:
        txn.put(key, record)


def _refuse_foreign(backend: Backend) -> None:
    """Raise if the backend holds data but no meta record: it is someone else's."""
    entries = backend.stats().get("entries", 0)
    if entries:
        raise StoreConfigError(
            f"[open_store] {backend.url} holds {entries} entries but no kvstore/v1/__meta__ "
            f"record: it is not a kvstore store. Use an empty or new location.",
            url=backend.url,
        )


def current_settings(view: ReadView, fallback: StoreSettings, url: str) -> StoreSettings:
    """Settings as stored now (budgets may have been changed by another process);
    ``fallback`` (the settings the store opened with) where neither copy reads."""
    try:
        stored = read_settings(view, url)
    except CorruptEntryError:
        return fallback  # verify reports it; enforcing budgets goes on with what we know
    return fallback if stored is None else stored.settings


def write_budget(
    txn: WriteView, url: str, max_bytes: int | None, namespace: str | None, fallback: StoreSettings
) -> StoreSettings:
    """Set (``None``: remove) the store's budget or one namespace's, in ``txn``."""
    stored = read_settings(txn, url, recover=True)
    settings = fallback if stored is None or stored.rebuilt else stored.settings
    if namespace is None:
        new = replace(settings, max_bytes=max_bytes)
    else:
        limits = dict(settings.namespace_budgets)
        if max_bytes is None:
            limits.pop(namespace, None)
        else:
            limits[namespace] = max_bytes
        new = replace(settings, namespace_budgets=limits)
    _put(txn, new, None if stored is None else stored.created)
    return new


def settings_problems(view: ReadView, url: str) -> tuple[str, ...]:
    """What ``verify`` reports about the settings record: one line per bad copy."""
    stored = read_settings(view, url, recover=True)
    if stored is None:
        return ("kvstore/v1/__meta__ and its copy are missing",)
    if stored.rebuilt:
        rebuilt = "settings rebuilt from the blocks (storage policy and budgets: defaults)"
        return (*stored.problems, rebuilt)
    return stored.problems


def repair_settings(txn: WriteView, url: str, fallback: StoreSettings) -> None:
    """Rewrite both copies where either is bad (``fallback``: the settings the store runs with)."""
    stored = read_settings(txn, url, recover=True)
    if stored is None or stored.problems:
        settings = fallback if stored is None or stored.rebuilt else stored.settings
        _put(txn, settings, None if stored is None else stored.created)
