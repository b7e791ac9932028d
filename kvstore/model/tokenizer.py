"""An optional tokenizer for a model directory (the model itself works on token ids).

Loaded only when the directory has tokenizer files and ``tokenizers`` (the
``kvstore[tokenizers]`` extra) or ``transformers`` is installed; otherwise the
loader returns ``None`` and callers pass token ids.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["Tokenizer", "load_tokenizer", "TOKENIZER_BACKENDS"]

#: Tried in this order: ``tokenizers`` reads ``tokenizer.json`` and imports in
#: milliseconds; ``transformers`` also reads sentencepiece-only directories.
TOKENIZER_BACKENDS = ("tokenizers", "transformers")


class Tokenizer:
    """Text to token ids and back, over whichever backend loaded the files.

    Attributes:
        backend: ``"tokenizers"`` or ``"transformers"``.
        raw: the backend's tokenizer object.
        eos_token_ids: token ids that end generation (from the config files).
    """

    def __init__(self, raw: Any, backend: str, eos_token_ids: Sequence[int]) -> None:
        self.raw = raw
        self.backend = backend
        self.eos_token_ids = frozenset(eos_token_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        out = self.raw.encode(text, add_special_tokens=add_special_tokens)
        return list(out.ids if self.backend == "tokenizers" else out)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return str(self.raw.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def get_vocab(self) -> dict[str, int]:
        """Token text to id (what a store fingerprints a tokenizer by)."""
        return dict(self.raw.get_vocab())

    def __repr__(self) -> str:
        return f"Tokenizer(backend={self.backend!r}, eos_token_ids={sorted(self.eos_token_ids)})"


def _eos_ids(path: Path) -> list[int]:
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        file = path / name
        if not file.is_file():
            continue
        value = json.loads(file.read_text()).get("eos_token_id")
        if value is not None:
            ids.extend(value if type(value) is list else [value])
    return ids


def _eos_token_text(path: Path) -> str | None:
    """``eos_token`` of tokenizer_config.json (a string or an ``{"content": ...}`` dict)."""
    file = path / "tokenizer_config.json"
    if not file.is_file():
        return None
    value = json.loads(file.read_text()).get("eos_token")
    return value.get("content") if type(value) is dict else value


def _import(name: str) -> Any | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def load_tokenizer(
    path: str | Path, backends: Sequence[str] = TOKENIZER_BACKENDS
) -> Tokenizer | None:
    """The tokenizer of model directory ``path``, or ``None`` when it has no
    tokenizer files or no backend that reads them is installed."""
    path = Path(path)
    # Backends (transformers is slow to import) are imported only for files they read.
    readable = {
        "tokenizers": ("tokenizer.json",),
        "transformers": ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"),
    }
    for backend in backends:
        if not any((path / f).is_file() for f in readable[backend]):
            continue
        module = _import(backend)
        if module is None:
            continue
        eos = _eos_ids(path)
        if backend == "tokenizers":
            raw = module.Tokenizer.from_file(str(path / "tokenizer.json"))
            eos_id = raw.token_to_id(_eos_token_text(path) or "")
            if eos_id is not None:
                eos.append(eos_id)
        else:
            raw = module.AutoTokenizer.from_pretrained(str(path))
            if raw.eos_token_id is not None:
                eos.append(raw.eos_token_id)
        return Tokenizer(raw, backend, eos)
    return None
