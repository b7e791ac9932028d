"""Which mlx-lm is installed, read from its package metadata without importing it.

kvstore's mlx-lm integration (:mod:`kvstore.mlx_lm`) builds on one range of releases and
does not import with others, but what kvstore writes for mlx-lm still depends on the
release a user has (the prompt-cache file layout: :mod:`kvstore.codecs.prompt_cache`), so
that is asked here, below every layer that needs it.
"""

from __future__ import annotations

import re
from importlib import metadata

__all__ = ["mlx_lm_version", "version_tuple"]


def mlx_lm_version() -> str | None:
    """The installed mlx-lm's version string, or ``None`` when it is not installed."""
    try:
        return metadata.version("mlx-lm")
    except metadata.PackageNotFoundError:
        return None


def version_tuple(text: str) -> tuple[int, int, int]:
    """``"0.31.3"`` (or ``"0.32.0rc1"``) as ``(0, 31, 3)``: major, minor, patch."""
    major, minor, patch = ([int(p) for p in re.findall(r"\d+", text)] + [0, 0, 0])[:3]
    return major, minor, patch
