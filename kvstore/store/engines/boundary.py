"""Translating a storage engine's exceptions into kvstore's error tree, in one place.

Each backend declares a table from its engine's exception classes to ours
(with a hint saying what to do); :func:`translate_errors` wraps every call
into the engine and re-raises ``Ours(...) from theirs``, so a caller catches
``StoreFullError`` or ``StoreUnavailableError`` and never an ``lmdb.*`` or
``redis.*`` class. A test enumerates the engine's classes and fails when one
is missing from the table.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from kvstore.errors import KVStoreError

__all__ = ["Translation", "raise_translated", "translate_errors", "translated"]


@dataclass(frozen=True)
class Translation:
    """Our error class for one engine exception class, and the fix to suggest."""

    error: type[KVStoreError]
    hint: str


def translated(
    exc: BaseException, table: Mapping[type[BaseException], Translation], operation: str, url: str
) -> KVStoreError | None:
    """Our error for ``exc`` (looked up along its MRO), or ``None`` if not an engine error."""
    for cls in type(exc).__mro__:
        entry = table.get(cls)
        if entry is not None:
            return entry.error(
                f"[{operation}] {type(exc).__name__} from the store at {url}: "
                f"{str(exc).rstrip('. ')}. {entry.hint}",
                url=url,
                cause=type(exc).__name__,
            )
    return None


@contextmanager
def translate_errors(
    table: Mapping[type[BaseException], Translation], operation: str, url: str
) -> Iterator[None]:
    """Re-raise engine exceptions listed in ``table`` as ours, chained with ``from``."""
    try:
        yield
    except Exception as exc:
        raise_translated(exc, table, operation, url)
        raise


def raise_translated(
    exc: BaseException, table: Mapping[type[BaseException], Translation], operation: str, url: str
) -> None:
    """Raise our error for ``exc`` from it where ``exc`` is an engine exception listed in
    ``table``; else return (the caller lets ``exc`` go on): :func:`translate_errors`' rule,
    for a context manager written as a class."""
    if isinstance(exc, Exception) and not isinstance(exc, KVStoreError):
        ours = translated(exc, table, operation, url)
        if ours is not None:
            raise ours from exc
