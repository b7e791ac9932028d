"""Arguments several subcommands share: the store URL, ``--json``, sizes, token files.

Values that can be wrong in ways worth explaining (sizes, token files) are
checked in ``run`` rather than by argparse, so a mistake ends in one line
saying what was wrong and what to do (exit status 2), like every bad input.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import numpy as np

from kvstore.errors import CorruptEntryError, StoreConfigError
from kvstore.layout import is_layout_text, read_layout_file
from kvstore.store.keys import as_tokens
from kvstore.store.settings import parse_byte_size

__all__ = [
    "URL_HELP",
    "DEFAULT_STORE",
    "command_parser",
    "add_store",
    "add_json",
    "parse_size",
    "read_tokens",
    "layout_argument",
]

#: The embedded default store (demo, import): the LMDB directory ./kvstore-demo.
DEFAULT_STORE = "kvstore-demo"

URL_HELP = "the store: lmdb:///path, a directory path, redis://host:6379/0, memory://name"


def command_parser(
    sub: argparse._SubParsersAction, name: str, help: str, doc: str | None, *, store: bool = True
) -> argparse.ArgumentParser:
    """A subcommand's parser: ``help`` in the command list, the first paragraph of the
    module docstring ``doc`` as its description, and the store URL argument."""
    p = sub.add_parser(name, help=help, description=doc.split("\n\n")[0] if doc else None)
    # Also after the subcommand (kvstore ls URL --debug); SUPPRESS keeps the global value.
    p.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks"
    )
    if store:
        add_store(p)
    return p


def add_store(p: argparse.ArgumentParser, name: str = "url", help: str = URL_HELP) -> None:
    p.add_argument(name, metavar=name.upper(), help=help)


def add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON document (for scripts)")


def parse_size(text: str, flag: str, command: str) -> int:
    """``"10GB"``, ``"512MiB"``, ``"1048576"`` -> bytes (``K/M/G`` and ``KiB``... are
    powers of 1024, ``KB/MB/GB`` powers of 1000).

    Raises:
        StoreConfigError: not a size.
    """
    try:
        return parse_byte_size(text, flag)
    except StoreConfigError as exc:
        raise StoreConfigError(
            f"[{command}] {flag} takes a size such as 10GB, 512MiB or 1048576 (bytes); "
            f"received {text!r}.",
            found=text,
        ) from exc


_INTS = re.compile(r"[\s,]+")


def read_tokens(path: str | Path, command: str) -> np.ndarray:
    """The token ids in ``path``: a JSON array, a ``.npy`` 1-D integer array, or
    integers separated by spaces, commas or newlines.

    Raises:
        FileNotFoundError: no such file.
        CorruptEntryError: the file holds something else.
        CapabilityError: ids outside ``[0, 2**32 - 2]``.
    """
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(
            f"[{command}] No tokens file at {file}. Give a file of token ids (a JSON array, "
            f"a .npy array, or integers separated by spaces or newlines)."
        )
    raw = file.read_bytes()
    try:
        if raw.startswith(b"\x93NUMPY"):
            values = np.load(file, allow_pickle=False)
        elif raw.lstrip().startswith(b"["):
            values = json.loads(raw)
        else:
            text = raw.decode("utf-8").strip()
            values = [int(t) for t in _INTS.split(text) if t]
    except (ValueError, UnicodeDecodeError, OSError) as exc:
        raise CorruptEntryError(
            f"[{command}] {file} is not a tokens file: {type(exc).__name__}: {exc}. Give a "
            f"JSON array, a .npy array, or integers separated by spaces or newlines.",
            path=str(file),
        ) from exc
    if isinstance(values, list) and not all(type(v) is int for v in values):
        raise CorruptEntryError(
            f"[{command}] {file} holds a JSON array of something other than integers; give "
            f"token ids.",
            path=str(file),
        )
    tokens = as_tokens(values, command)
    if not len(tokens):
        raise CorruptEntryError(f"[{command}] {file} holds no token ids.", path=str(file))
    return tokens


def layout_argument(text: str, command: str) -> str:
    """A family argument as given, or the layout a layout file holds (its text form):
    ``kv:quant:8:64``, ``default=kv:quant:4:64;0=kv:quant:8:64``, or ``policy.json``.

    Raises:
        StoreConfigError: a path to something that is not a layout file.
    """
    if is_layout_text(text) or not (text.endswith(".json") or Path(text).is_file()):
        return text
    try:
        layout, _ = read_layout_file(text, command)
    except ValueError as exc:
        raise StoreConfigError(str(exc), found=text) from exc
    return layout.text()
