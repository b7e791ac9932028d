"""Tuning knobs read from the environment: one parser per kind of value, one error shape.

The data path's knobs (``KVSTORE_COPY_THREADS``, ``KVSTORE_CUDA_GATHER_MIN_MIB``,
``KVSTORE_CUDA_SWITCH_MS``, ...) are read when their module loads or their pool is
made; its on/off switches (``KVSTORE_COMMIT_WRITEBACK``, ``KVSTORE_TQ_TOGETHER``, ...)
are on unless set to exactly ``"0"``; its choices (``KVSTORE_CUDA_PAGES_ROUTE``, ...)
take one of a few words. A count or amount that is not one raises
:class:`~kvstore.errors.StoreConfigError` naming the variable, what it got and what it
expects, instead of Python's own ``ValueError`` from ``int()`` or ``float()``.
"""

from __future__ import annotations

import math
import os

from kvstore.errors import StoreConfigError

__all__ = ["choice_from_env", "count_from_env", "mib_from_env", "ms_from_env", "switch_from_env"]

_MiB = 1 << 20


def _refused(name: str, value: str, expected: str, default: object) -> StoreConfigError:
    return StoreConfigError(
        f"[config] {name}={value!r}: expected {expected}; unset it for the default ({default}).",
        variable=name,
        found=value,
    )


def switch_from_env(name: str) -> bool:
    """Whether the switch ``name`` is on: unset or anything but ``"0"``."""
    return os.environ.get(name, "1") != "0"


def _value(name: str) -> str:
    return os.environ.get(name, "").strip()


def count_from_env(name: str, default: int, what: str = "threads") -> int:
    """``default``, unless the environment variable ``name`` sets a positive count (of
    ``what``, for the error).

    Raises:
        StoreConfigError: ``name`` is set to something other than a positive integer.
    """
    value = _value(name)
    if not value:
        return default
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise _refused(name, value, f"a positive number of {what}", default)
    return count


def _amount(name: str, default: float, unit: str) -> float:
    value = _value(name)
    if not value:
        return default
    try:
        amount = float(value)
    except ValueError:
        amount = math.nan
    if not (math.isfinite(amount) and amount >= 0):
        raise _refused(name, value, f"a number of {unit}, 0 or more", f"{default:g} {unit}")
    return amount


def mib_from_env(name: str, default_mib: float) -> int:
    """Bytes: ``default_mib`` MiB unless ``name`` sets another number (0 or more) of MiB.

    Raises:
        StoreConfigError: ``name`` is set to something other than such a number.
    """
    return int(_amount(name, default_mib, "MiB") * _MiB)


def choice_from_env(
    name: str, choices: tuple[str, ...], default: str, *, counting: str | None = None
) -> str:
    """``default``, unless ``name`` sets one of ``choices`` (any case, spaces around
    ignored), or, with ``counting``, a number (0 or more) of what it counts: lower case.

    Raises:
        StoreConfigError: ``name`` is set to something else.
    """
    value = _value(name).lower()
    if not value:
        return default
    if value in choices or (counting is not None and value.isdigit()):
        return value
    named = [repr(choice) for choice in choices]
    if counting is not None:
        named.insert(0, f"a number of {counting}")
    expected = named[0] if len(named) == 1 else f"{', '.join(named[:-1])} or {named[-1]}"
    raise _refused(name, _value(name), expected, repr(default) if default else "unset")


def ms_from_env(name: str, default_ms: float) -> float:
    """Seconds: ``default_ms`` ms unless ``name`` sets another number (0 or more) of ms.

    Raises:
        StoreConfigError: ``name`` is set to something other than such a number.
    """
    return _amount(name, default_ms, "ms") / 1e3
