"""Python's cyclic garbage collector held off while a restore runs.

A restore makes tens of thousands of short-lived objects (a lossy 4096-token
llama-8B restore: 3,072 tensor views, their snapshots and joins), enough to
trigger the collector's young generations several times and, now and then, a
full collection of the whole heap. In a process with a model loaded that full
collection is the restore's longest step: 24 ms of a 55 ms restore here with
``mlx_lm`` imported (82k objects), and on an H200 the cause of G1's warm
samples falling in two groups about 10 ms apart
(``tools/bench/results/gpu/71cbce0/``). The objects a restore makes hold no
cycles and are dropped when it returns, so collecting during it frees nothing.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["collection_paused"]

_LOCK = threading.Lock()
#: Restores running now, and whether the collector was on before the first.
_HOLDERS = [0]
_WAS_ENABLED = [False]


@contextmanager
def collection_paused() -> Iterator[None]:
    """The collector off inside the ``with`` (restores on several threads: off until
    the last ends), then as it was."""
    with _LOCK:
        if not _HOLDERS[0]:
            _WAS_ENABLED[0] = gc.isenabled()
            gc.disable()
        _HOLDERS[0] += 1
    try:
        yield
    finally:
        with _LOCK:
            _HOLDERS[0] -= 1
            if not _HOLDERS[0] and _WAS_ENABLED[0]:
                gc.enable()
