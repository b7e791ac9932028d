"""Where kvstore keeps what it can make again: ``KVSTORE_CACHE_DIR``, else the XDG cache.

Model-file digests (:mod:`kvstore.bridge.fingerprint`) and compiled CUDA kernels
(:mod:`kvstore.kernel_cache`) live under it; deleting it loses nothing but the time
to make them again.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CACHE_DIR", "cache_dir"]

#: The variable that moves it.
CACHE_DIR = "KVSTORE_CACHE_DIR"


def cache_dir() -> Path:
    """``$KVSTORE_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvstore``, else ``~/.cache/kvstore``
    (read at each call: a test or a tool may move it)."""
    base = os.environ.get(CACHE_DIR) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvstore"
    )
    return Path(base)
