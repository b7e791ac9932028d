"""mlx-lm's sliding-window cache, keeping each block it completes for the store.

A ``RotatingKVCache`` holds only its last ``max_size`` rows, so when a prompt is
saved after generation its window has forgotten the blocks before it, and a
later prompt that shares a shorter prefix (or the same one: a window that
starts inside a block needs that whole block) cannot restore its windowed
layers. The reference model captures blocks during its chunked prefill
(:class:`kvstore.bridge.capture.BlockCapture`); mlx-lm's ``generate_step``,
``BatchGenerator`` and server have no such hook, so the cache does it itself:
after each update it snapshots every block of ``block_size`` tokens that was
completed while the ring still holds it. A multi-token (prefill) update keeps
``max_size - 1 + S`` rows, so every block of a chunk is caught; during decode a
block is caught when its last token arrives (the window then covers it when
``block_size <= max_size``).

Snapshots are views of the ring; they are copied into arrays of their own at
the next update (scheduled with ``mx.async_eval``, so the copy does not stall
the forward pass) and handed to the save with ``captured=``.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache

from kvstore.abc.codec import Snapshot
from kvstore.caches import RotatingQuantizedKVCache
from kvstore.codecs import codec_for
from kvstore.errors import CapabilityError

__all__ = [
    "BlockCapturing",
    "CapturingRotatingKVCache",
    "CapturingRotatingQuantizedKVCache",
    "capturing_like",
    "captured_blocks",
]


class BlockCapturing:
    """The capture, over any ring with ``offset``/``keys``/``_idx`` and a codec.

    Attributes:
        block_size: the store's block size.
        captured: block start -> snapshot of the block ``[start, start + block_size)``.
    """

    block_size: int
    captured: dict[int, Snapshot]
    _pending: list[int]
    offset: int

    def _init_capture(self, block_size: int) -> None:
        self.block_size = block_size
        self.captured = {}
        self._pending = []

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        self._own_pending()
        before = int(self.offset)
        out = super().update_and_fetch(keys, values)  # type: ignore[misc]
        size = self.block_size
        first = (before // size + 1) * size  # the first block end after `before`
        codec = None
        for end in range(first, int(self.offset) + 1, size):
            codec = codec or codec_for(self)
            try:
                self.captured[end - size] = codec.snapshot(self, end - size, end)
            except CapabilityError:  # gone already: a window shorter than a block
                continue
            self._pending.append(end - size)
        return out

    def _own_pending(self) -> None:
        """Copy the views taken at the last update into arrays of their own."""
        if not self._pending:
            return
        arrays: list[mx.array] = []
        for start in self._pending:
            snap = self.captured[start]
            owned = {name: mx.array(a) for name, a in snap.tensors.items()}
            arrays.extend(owned.values())
            self.captured[start] = Snapshot(snap.signature, snap.start, snap.stop, owned, snap.meta)
        mx.async_eval(arrays)  # computed on this thread's stream; waited for by the save
        self._pending = []


class CapturingRotatingKVCache(BlockCapturing, RotatingKVCache):  # type: ignore[misc]
    """mlx-lm's ``RotatingKVCache`` (same state, same logits) that keeps completed blocks."""

    def __init__(self, max_size: int, keep: int = 0, *, block_size: int = 256) -> None:
        RotatingKVCache.__init__(self, max_size=max_size, keep=keep)
        self._init_capture(block_size)

    def signature(self) -> str:
        return "kv:rotating-plain"


class CapturingRotatingQuantizedKVCache(BlockCapturing, RotatingQuantizedKVCache):
    """Our windowed affine ring that keeps completed blocks."""

    def __init__(
        self,
        max_size: int,
        keep: int = 0,
        group_size: int = 64,
        bits: int = 8,
        *,
        block_size: int = 256,
    ) -> None:
        RotatingQuantizedKVCache.__init__(self, max_size, keep, group_size, bits)
        self._init_capture(block_size)


def capturing_like(cache: Any, block_size: int) -> Any:
    """A capturing ring holding what the ring ``cache`` holds (the same arrays):
    mlx-lm's ``RotatingKVCache`` or a windowed affine one; other caches as they are."""
    out: Any
    if isinstance(cache, BlockCapturing):
        return cache
    if isinstance(cache, RotatingQuantizedKVCache):
        out = CapturingRotatingQuantizedKVCache(
            int(cache.max_size),
            int(cache.keep),
            cache.group_size,
            cache.bits,
            block_size=block_size,
        )
    elif isinstance(cache, RotatingKVCache):  # mlx-lm's
        out = CapturingRotatingKVCache(int(cache.max_size), int(cache.keep), block_size=block_size)
    else:
        return cache
    out.keys, out.values = cache.keys, cache.values
    out.offset, out._idx = int(cache.offset), int(cache._idx)
    return out


def captured_blocks(caches: list[Any]) -> dict[tuple[int, int], Snapshot]:
    """``(layer, block start) -> snapshot`` of every block the caches captured, owned
    and evaluated; the caches forget them (they go to one save)."""
    out: dict[tuple[int, int], Snapshot] = {}
    for i, cache in enumerate(caches):
        if isinstance(cache, BlockCapturing):
            cache._own_pending()
            out.update({(i, start): snap for start, snap in cache.captured.items()})
            cache.captured = {}
    return out
