"""The training text: the ``.py`` sources of the running Python's standard library.

Every machine with Python has them, so the corpus ships with no data and the
same recipe runs here and on the GPU machine (their Pythons differ: 3.11 here,
3.12 there, whose library lacks ``test/``, so the GPU run carries 3.11's and
passes it as ``--corpus``; the export records whose library it was). Each file
becomes one document under the header line the demo's context uses
(``# ---- json/decoder.py ----``, :mod:`kvstore.demo.script`), so the model has
seen the layout of the prompts it is shown. Whole packages are held out for
evaluation: ``json`` and ``email``, as for the pycode-lm fixture, so held-out
bits per byte compare with its 1.23.
"""

from __future__ import annotations

import platform
import random
import re
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["HELD_OUT", "Corpus", "document", "read_corpus", "stdlib_root"]

HELD_OUT = ("json", "email")


@dataclass(frozen=True)
class Corpus:
    """Documents for training and for evaluation, and where they came from."""

    root: Path
    train: list[str]
    eval: list[str]
    held_out: tuple[str, ...]
    skipped: int

    @property
    def python(self) -> str:
        """Whose library it is: ``Python 3.11`` for a ``python3.11`` directory (a carried
        copy), this Python's full version for its own library."""
        if self.root.resolve() == stdlib_root().resolve():
            return f"Python {platform.python_version()}"
        match = re.fullmatch(r"python(\d+\.\d+)", self.root.name)
        return f"Python {match[1]}" if match else f"the Python library at {self.root}"

    def describe(self) -> str:
        size = sum(len(d.encode("utf-8")) for d in self.train)
        held = sum(len(d.encode("utf-8")) for d in self.eval)
        return (
            f"corpus {self.root}: {len(self.train)} files, {size / 1e6:.1f} MB for training; "
            f"{'/, '.join(self.held_out)}/ held out ({len(self.eval)} files, {held / 1e6:.2f} MB); "
            f"{self.skipped} files skipped (not UTF-8)"
        )


def stdlib_root() -> Path:
    """The directory of this Python's standard-library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def document(relative: str, source: str) -> str:
    """One file as the model sees it: the demo context's header line, then the source."""
    return f"# ---- {relative} ----\n{source}\n"


def read_corpus(
    root: Path | None = None,
    held_out: Sequence[str] = HELD_OUT,
    max_bytes: int | None = None,
    seed: int = 0,
) -> Corpus:
    """Read the standard library's ``.py`` files as documents.

    Args:
        root: the library directory (this Python's by default).
        held_out: top-level packages kept for evaluation.
        max_bytes: keep about this many training bytes, a seeded sample of files (toy runs).
        seed: the sample's seed.

    Raises:
        FileNotFoundError: no ``.py`` sources under ``root`` (a Python installed without them).
    """
    root = stdlib_root() if root is None else root
    train: list[str] = []
    evaluation: list[str] = []
    skipped = 0
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if "site-packages" in parts or "dist-packages" in parts:
            continue  # third-party code, and not on every machine
        try:
            source = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            skipped += 1  # test data written in other encodings on purpose
            continue
        text = document("/".join(parts), source)
        (evaluation if parts[0] in held_out else train).append(text)
    if not train:
        raise FileNotFoundError(
            f"[demo_model] The corpus is the standard library's .py sources; {root} has none. "
            f"Run with a Python that has its full library (Debian: libpython3-stdlib)."
        )
    if max_bytes is not None:
        random.Random(seed).shuffle(train)
        kept, size = [], 0
        for text in train:
            if size >= max_bytes:
                break
            kept.append(text)
            size += len(text.encode("utf-8"))
        train = kept
    return Corpus(root, train, evaluation, tuple(held_out), skipped)
