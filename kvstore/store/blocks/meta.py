"""The settings record in the backend: read on open, created or updated, and budgets.

A store's settings live in ``kvstore/v1/__meta__`` (format: :mod:`kvstore.store.settings`).
Opening resolves defaults < stored < explicit and writes the record when that
changes it; budgets can change later (``set_budget``, another process), so code
that enforces them reads the record again inside its transaction.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kvstore.abc.store import Backend, ReadView, StoreSettings, WriteView
from kvstore.errors import StoreConfigError
from kvstore.store import keys as K
from kvstore.store.settings import decode_meta, encode_meta, resolve_settings

__all__ = ["open_settings", "current_settings", "write_budget"]


def open_settings(backend: Backend, explicit: dict[str, Any]) -> StoreSettings:
    """The settings of the store in ``backend``, creating or updating its record as needed.

    Raises:
        StoreConfigError: a read-only open of an empty location, a location holding
            someone else's data, or an explicit setting that conflicts with the stored one.
        FormatVersionError: a meta record of a newer kvstore.
    """
    with backend.reader() as view:
        raw = view.get(K.META_KEY)
        stored = None if raw is None else decode_meta(raw, backend.url)[0]
    if stored is None and not backend.supports_writes:
        _refuse_foreign(backend)
        raise StoreConfigError(
            f"[open_store] {backend.url} is empty: no store to open read-only.", url=backend.url
        )
    settings, changed = resolve_settings(stored, explicit)
    if changed and backend.supports_writes:
        settings = backend.transact(lambda txn: _write_meta(backend, txn, explicit))
    return settings


def _write_meta(backend: Backend, txn: WriteView, explicit: dict[str, Any]) -> StoreSettings:
    # Re-read inside the transaction: another process may have created the
    # store (or changed a budget) since we looked.
    raw = txn.get(K.META_KEY)
    if raw is None:
        _refuse_foreign(backend)  # consistent: we hold the write lock, nothing else commits
        stored, created = None, None
    else:
        stored, created = decode_meta(raw, backend.url)
    settings, changed = resolve_settings(stored, explicit)
    if changed:
        txn.put(K.META_KEY, encode_meta(settings, created))
    return settings


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
    """Settings as stored now (budgets may have been changed by another process)."""
    raw = view.get(K.META_KEY)
    return fallback if raw is None else decode_meta(raw, url)[0]


def write_budget(
    txn: WriteView, url: str, max_bytes: int | None, namespace: str | None
) -> StoreSettings:
    """Set (``None``: remove) the store's budget or one namespace's, in ``txn``."""
    raw = txn.get(K.META_KEY)
    assert raw is not None  # an open writable store always has its record
    stored, created = decode_meta(raw, url)
    if namespace is None:
        new = replace(stored, max_bytes=max_bytes)
    else:
        limits = dict(stored.namespace_budgets)
        if max_bytes is None:
            limits.pop(namespace, None)
        else:
            limits[namespace] = max_bytes
        new = replace(stored, namespace_budgets=limits)
    txn.put(K.META_KEY, encode_meta(new, created))
    return new
