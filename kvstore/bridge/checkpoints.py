"""Which recurrent checkpoints a hybrid model's generation keeps, and taking them (issue 16).

A recurrent layer's state exists only at the position the model has reached,
so a checkpoint is taken *when* the caches are there: at the end of a prefill
chunk (chunks are made to end at the positions planned here), or after a
decode step or speculative round that lands on a block boundary (rounds are
capped so that they do). Every token the state has seen is verified by then:
no checkpoint is ever taken of a state that has seen a draft token.

The plan (SGLang's ``MambaRadixCache`` rules, at block boundaries ``B``):

* every ``stride`` blocks (the store's ``checkpoint_stride``, 8 by default);
* the last block boundary at most ``P - 1`` of a ``P``-token prompt: a repeat
  of the prompt (whose last token is always recomputed) restores there;
* the branch point where the prompt leaves the stored prefix it shares (the
  last block boundary of the KV match), so the next sibling reuses it;
* during decode, the latest block boundary reached (the last boundary of the
  saved sequence) -- the end of the saved sequence itself is the live state,
  which the save takes as it is.

Positions at or before the restored prefix are not taken again (the store
holds them already).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from kvstore.abc.cache import is_recurrent_cache
from kvstore.abc.codec import Snapshot
from kvstore.codecs import codec_for

__all__ = ["CheckpointPlan", "plan_positions"]


def plan_positions(
    block_size: int, stride: int, prompt_tokens: int, start: int, kv_matched: int
) -> list[int]:
    """The prefill positions to checkpoint: in ``(start, prompt_tokens - 1]``, sorted."""
    last = prompt_tokens - 1
    out: set[int] = set()
    if stride > 0:
        step = stride * block_size
        out.update(range(step, last + 1, step))
    out.add(last // block_size * block_size)  # the last boundary a repeat restores at
    out.add(kv_matched // block_size * block_size)  # the branch point
    return sorted(p for p in out if start < p <= last)


class CheckpointPlan:
    """Takes the checkpoints of one generation's recurrent layers (see the module docstring).

    Args:
        block_size: the store's block size.
        stride: blocks between checkpoints (0: only the rules' own).
        prompt_tokens: the prompt's length.
        start: tokens restored from the store (the prefill starts there).
        kv_matched: prompt tokens whose KV the store matched (the branch point's source).
    """

    def __init__(
        self, block_size: int, stride: int, prompt_tokens: int, start: int, kv_matched: int
    ) -> None:
        self.block_size = block_size
        self.stride = stride
        self.prefill = plan_positions(block_size, stride, prompt_tokens, start, kv_matched)
        self._planned = set(self.prefill)
        #: ``(layer, position) -> checkpoint``: what the save stores.
        self.snapshots: dict[tuple[int, int], Snapshot] = {}
        self._latest: int | None = None  # the decode checkpoint kept only as the latest

    def on_prefill_chunk(self, offset_end: int, caches: Sequence[Any]) -> None:
        if offset_end in self._planned:
            self.take(offset_end, caches)

    def next_stop(self, offset: int) -> int:
        """The next block boundary after ``offset``: where a decode round must land."""
        return (offset // self.block_size + 1) * self.block_size

    def on_decode(self, offset: int, caches: Sequence[Any]) -> None:
        """After a decode step or round: take a checkpoint on a block boundary, keeping
        the ones of the stride and only the latest of the others."""
        if offset % self.block_size or offset in self._planned:
            return
        self.take(offset, caches)
        on_stride = self.stride > 0 and offset % (self.stride * self.block_size) == 0
        if self._latest is not None:
            for key in [k for k in self.snapshots if k[1] == self._latest]:
                del self.snapshots[key]
        self._latest = None if on_stride else offset

    def take(self, position: int, caches: Sequence[Any]) -> None:
        """Every recurrent layer's state, now at ``position`` (references: the arrays
        are immutable, a layer replaces them rather than writing into them)."""
        arrays: list[Any] = []
        for i, cache in enumerate(caches):
            if is_recurrent_cache(cache):
                snap = codec_for(cache).snapshot(cache, position, position)
                self.snapshots[(i, position)] = snap
                arrays.extend(snap.tensors.values())
        mx.eval(arrays)  # a lazy state would keep the step's whole graph alive
