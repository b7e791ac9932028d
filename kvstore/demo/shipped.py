"""The model ``kvstore demo`` runs by default: a small llama that writes Python, shipped
as package data in ``kvstore/demo/model/`` (an mlx-lm directory, 4-bit, under 8 MB).

It was trained from scratch on the standard library's sources by
``tools/demo_model`` (its ``README.md`` says how, and how to retrain); its
tokenizer needs the ``tokenizers`` package (``mlx-kvstore[tokenizers]``, part
of the dev install ``make demo`` makes).
"""

from __future__ import annotations

from pathlib import Path

from kvstore.errors import ModelLoadError

__all__ = ["SHIPPED_MODEL", "SHIPPED_FILES", "shipped_model_dir"]

SHIPPED_MODEL = Path(__file__).resolve().with_name("model")

#: The files of the shipped directory (tools/demo_model writes the same names).
SHIPPED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "README.md",
    "train_log.txt",
)


def shipped_model_dir() -> Path:
    """The shipped model's directory.

    Raises:
        ModelLoadError: files of it are missing (an install without package data).
    """
    missing = [name for name in SHIPPED_FILES if not (SHIPPED_MODEL / name).is_file()]
    if missing:
        raise ModelLoadError(
            f"[demo] The demo's model ships in {SHIPPED_MODEL}, which lacks "
            f"{', '.join(missing)}; reinstall mlx-kvstore with its package data, or pass "
            f"--model DIR (an mlx-lm model directory) or --config small (seeded weights).",
            path=str(SHIPPED_MODEL),
            missing=missing,
        )
    return SHIPPED_MODEL
