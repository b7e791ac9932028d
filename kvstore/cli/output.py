"""How subcommands print: aligned plain-text tables for people, JSON for scripts.

Plain text needs no terminal library and survives pipes (``kvstore ls | grep``).
JSON goes to stdout as one document; numbers stay numbers (bytes in bytes,
times in Unix seconds), so scripts never parse the human units.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any, TextIO

__all__ = ["human_bytes", "when", "short", "table", "print_table", "print_fields", "print_json"]

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def human_bytes(n: int | float | None) -> str:
    """``1536`` -> ``"1.5 KiB"`` (powers of 1024); ``None`` -> ``"-"``."""
    if n is None:
        return "-"
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def when(seconds: float | None) -> str:
    """A Unix time as local ``YYYY-MM-DD HH:MM:SS``; ``None`` -> ``"-"``."""
    if seconds is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))


def short(digest: str, n: int = 16) -> str:
    """The first ``n`` hex digits of a hash (enough to name a block to ``inspect``)."""
    return digest[:n]


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    """Lines of a table: columns padded to their widest cell, numbers right-aligned."""
    body = [[str(c) for c in row] for row in rows]
    cells = [list(headers), *body]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [all(_is_number(r[i]) for r in body) and bool(body) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric)
        ).rstrip()

    return [line(headers), *(line(r) for r in body)]


def _is_number(text: str) -> bool:
    head = text.split(" ")[0].lstrip("~")
    try:
        float(head)
    except ValueError:
        return text == "-"
    return True


def print_table(
    headers: Sequence[str], rows: Iterable[Sequence[Any]], out: TextIO | None = None
) -> None:
    for row in table(headers, rows):
        print(row, file=out or sys.stdout)


def print_fields(fields: Sequence[tuple[str, Any]], out: TextIO | None = None) -> None:
    """``name  value`` lines, names padded to the longest."""
    width = max((len(name) for name, _ in fields), default=0)
    for name, value in fields:
        print(f"{name.ljust(width)}  {value}", file=out or sys.stdout)


def _plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [_plain(v) for v in obj]
    if isinstance(obj, bytes):
        return obj.decode("ascii", "backslashreplace")
    return obj


def print_json(obj: Any, out: TextIO | None = None) -> None:
    """``obj`` (dataclasses, dicts, lists, bytes as text) as indented JSON."""
    json.dump(_plain(obj), out or sys.stdout, indent=2, sort_keys=False)
    print(file=out or sys.stdout)
