"""Keeping the blocks a sliding window is about to forget, during prefill.

A sliding-window cache holds only its last ``max_size`` rows, so by the time a
long prompt is saved its early blocks are gone from such layers. The model's
chunked prefill ends chunks on block boundaries and calls ``on_prefill_chunk``
after each; :class:`BlockCapture` snapshots every completed block of the
windowed layers then, and the save stores those snapshots
(``store.save(..., captured=capture.snapshots)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from kvstore.abc.cache import is_sliding_window_cache
from kvstore.abc.codec import Snapshot
from kvstore.codecs import codec_for
from kvstore.errors import CapabilityError

__all__ = ["BlockCapture"]


class BlockCapture:
    """An ``on_prefill_chunk`` callback keeping sliding-window layers' blocks.

    After each prefill chunk, every whole block that ended inside the chunk
    is snapshotted from each sliding-window cache while the window still holds
    it, and copied (a snapshot is a view into the ring, which the next chunk
    replaces). Layers that keep every token are read at save time instead.

    Args:
        block_size: the store's block size.
        start: tokens the caches held before prefill (a restored prefix).
    """

    def __init__(self, block_size: int, start: int = 0) -> None:
        self.block_size = block_size
        self.snapshots: dict[tuple[int, int], Snapshot] = {}
        #: Set when a capture raised: the rest of the prefill is not captured.
        self.failed = False
        self._done = start // block_size * block_size

    def __call__(self, offset_end: int, caches: Sequence[Any]) -> None:
        bsize = self.block_size
        starts = range(self._done, offset_end // bsize * bsize, bsize)
        if not starts:
            return
        arrays: list[mx.array] = []
        for i, cache in enumerate(caches):
            if not is_sliding_window_cache(cache):
                continue
            codec = codec_for(cache)
            for start in starts:
                try:
                    snap = codec.snapshot(cache, start, start + bsize)
                except CapabilityError:  # gone already (a window shorter than the chunk's lag)
                    continue
                owned = {name: mx.array(a) for name, a in snap.tensors.items()}
                arrays.extend(owned.values())
                self.snapshots[(i, start)] = Snapshot(
                    snap.signature, snap.start, snap.stop, owned, snap.meta
                )
        mx.eval(arrays)
        self._done = starts[-1] + bsize
