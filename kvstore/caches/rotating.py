"""Sliding-window rings: ``kv:rotating-plain`` and ``kv:rotating-quant:{bits}:{group}``.

Each windowed family declares the growing family it keeps a window of
(``window_of``); the model's cache policy gives sliding layers the windowed
family of the one it was asked for.

The ring arithmetic is mlx-lm's ``RotatingKVCache``, written once over row
trees so the affine variant (which mlx-lm lacks) shares it. Multi-token
updates put the ring in temporal order and keep up to ``max_size + S - 1``
rows so every new token sees a full window; single-token updates write in
place, wrapping to just after the ``keep`` sink tokens.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx.utils import tree_map

from kvstore.caches.base import (
    BaseKVCache,
    Batchable,
    Tree,
    UnwrittenRoom,
    row_leaves,
    tree_length,
    zeros_like_rows,
)
from kvstore.caches.mask import create_causal_mask
from kvstore.caches.packed import quantize_rows
from kvstore.caches.plain import PLAIN_FAMILY
from kvstore.caches.quantized import AFFINE_ATTENTION, AFFINE_PARAMS, QUANT_FAMILY, AffineRows
from kvstore.errors import CapabilityError
from kvstore.family import Family
from kvstore.signature import parse_signature

__all__ = [
    "ROTATING_PLAIN_FAMILY",
    "ROTATING_QUANT_FAMILY",
    "RingKVCache",
    "RotatingKVCache",
    "RotatingQuantizedKVCache",
]

ROTATING_PLAIN_FAMILY = Family(
    kind="kv:rotating-plain",
    description="raw rows in a sliding window",
    window_of=PLAIN_FAMILY.kind,
    factory=lambda sig, window, keep: RotatingKVCache(window, keep),
)

ROTATING_QUANT_FAMILY = Family(
    kind="kv:rotating-quant",
    description="MLX affine rows in a sliding window",
    params=AFFINE_PARAMS,
    attention=AFFINE_ATTENTION,
    window_of=QUANT_FAMILY.kind,
    lossy=True,
    factory=lambda sig, window, keep: RotatingQuantizedKVCache(
        window, keep, sig.param("group_size"), sig.param("bits")
    ),
)


class RingKVCache(UnwrittenRoom, BaseKVCache):
    """A window of the last ``max_size`` tokens plus the first ``keep`` ones; before the
    window fills, a host restore may leave its room unwritten (:class:`UnwrittenRoom`:
    the steps here use ``_keys``/``_values``)."""

    def __init__(self, max_size: int, keep: int = 0) -> None:
        if not (isinstance(max_size, int) and max_size > 0):
            raise ValueError(
                f"[{type(self).__name__}] max_size must be a positive int; received {max_size!r}."
            )
        if not (isinstance(keep, int) and 0 <= keep < max_size):
            raise ValueError(
                f"[{type(self).__name__}] keep must be an int in [0, max_size={max_size}); "
                f"received {keep!r}."
            )
        self.keep = keep
        self._keys = None
        self._values = None
        self.offset = 0
        self.max_size = max_size
        self._idx = 0

    # -- ring arithmetic (mlx-lm RotatingKVCache) ---------------------------------------
    def _trim(self, trim_size: int, v: Tree, append: Tree | None = None) -> Tree:
        def one(a: mx.array, *extra: mx.array) -> mx.array:
            parts = (
                [a[..., : self.keep, :], a[..., trim_size + self.keep :, :]]
                if trim_size > 0
                else [a]
            )
            return mx.concatenate([*parts, *extra], axis=2)

        return tree_map(one, v) if append is None else tree_map(one, v, append)

    def _temporal_order(self, v: Tree) -> Tree:
        """The ring in temporal order, the unused end sliced off."""
        if self._idx == tree_length(v):
            return v
        if self._idx < self.offset:
            return tree_map(
                lambda a: mx.concatenate(
                    [
                        a[..., : self.keep, :],
                        a[..., self._idx :, :],
                        a[..., self.keep : self._idx, :],
                    ],
                    axis=2,
                ),
                v,
            )
        return tree_map(lambda a: a[..., : self._idx, :], v)

    def _update_concat(self, keys: Tree, values: Tree, num_steps: int) -> tuple[Tree, Tree]:
        if self._keys is None:
            self._keys, self._values = keys, values
        else:
            # In temporal order the ring ends at _idx: no row past it, written or not.
            self._keys = self._temporal_order(self._keys)
            self._values = self._temporal_order(self._values)
            self._unwritten = None
            self._idx = tree_length(self._keys)
            # Up to max_size + S - 1 rows, so every new token sees a full window.
            trim_size = self._idx - self.max_size + 1
            self._keys = self._trim(trim_size, self._keys, keys)
            self._values = self._trim(trim_size, self._values, values)
        self.offset += num_steps
        self._idx = tree_length(self._keys)
        return self._keys, self._values

    def _update_in_place(self, keys: Tree, values: Tree, num_steps: int) -> tuple[Tree, Tree]:
        prev = self.offset
        if self._keys is None or (
            prev >= tree_length(self._keys) and tree_length(self._keys) < self.max_size
        ):
            # Every row written by now (the room past them is not reached before).
            new_size = min(self.step, self.max_size - prev)
            fresh_k = zeros_like_rows(keys, new_size)
            fresh_v = zeros_like_rows(values, new_size)
            if self._keys is None:
                self._keys, self._values = fresh_k, fresh_v
            else:
                self._keys, self._values = tree_map(
                    lambda a, b: mx.concatenate([a, b], axis=2),
                    (self._keys, self._values),
                    (fresh_k, fresh_v),
                )
            self._idx = prev

        trim_size = tree_length(self._keys) - self.max_size
        if trim_size > 0:
            self._keys = self._trim(trim_size, self._keys)
            self._values = self._trim(trim_size, self._values)
            self._idx = self.max_size

        if self._idx == self.max_size:  # wrap to just after the sink tokens
            self._idx = self.keep

        for buf, new in zip(row_leaves((self._keys, self._values)), row_leaves((keys, values))):
            buf[..., self._idx : self._idx + num_steps, :] = new
        self.offset += num_steps
        self._idx += num_steps
        self._written_to(self._idx)
        return self.keys_and_values()

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Tree, Tree]:
        num_steps = keys.shape[2]
        new_keys, new_values = self._encode_pair(keys, values)
        # A round rolled all the way back leaves a wrapped ring one row short of its
        # window (issue 16): the next token is appended, not written in place.
        short = (
            self._keys is not None
            and self.offset >= self.max_size
            and tree_length(self._keys) < self.max_size
        )
        if num_steps == 1 and not short:
            stored = self._update_in_place(new_keys, new_values, num_steps)
        else:
            stored = self._update_concat(new_keys, new_values, num_steps)
        return self._present(*stored)

    def keys_and_values(self) -> tuple[Tree, Tree]:
        """The stored rows in ring order (not temporal order), padding sliced off."""
        assert self._keys is not None and self._values is not None
        if self.offset < tree_length(self._keys):
            return tree_map(lambda a: a[..., : self.offset, :], (self._keys, self._values))
        return self._keys, self._values

    def temporal_keys_and_values(self) -> tuple[Tree, Tree]:
        """The stored rows in temporal order: ``keep`` sinks, then oldest to newest."""
        assert self._keys is not None and self._values is not None
        return self._temporal_order(self._keys), self._temporal_order(self._values)

    def size(self) -> int:
        return min(self.offset, self.max_size)

    def is_trimmable(self) -> bool:
        return self.offset < self.max_size

    def trim(self, n: int) -> int:
        if not self.is_trimmable():
            raise CapabilityError(
                f"[{self.signature()}] cannot trim after the window wrapped "
                f"(offset {self.offset} >= max_size {self.max_size}): the tokens "
                f"before the window are gone. Check can_trim(cache) first.",
                offset=self.offset,
                max_size=self.max_size,
            )
        n = min(self.offset, n)
        self.offset -= n
        self._idx -= n
        return n

    def _drop_newest(self, n: int) -> None:
        """Take back the ``n`` newest rows of a round (issue 16). A verify forward of
        several tokens leaves the ring in temporal order with its new rows last
        (:meth:`_update_concat`), so they are cut off even past the window."""
        if self.is_trimmable():
            self.trim(n)
            return
        if self._keys is None or self._idx != tree_length(self._keys) or n > self._idx - self.keep:
            raise CapabilityError(
                f"[{self.signature()}] A wrapped window takes back only the rows of one "
                f"multi-token forward; received n={n} at offset {self.offset}.",
                offset=self.offset,
            )
        cut = self._idx - n
        self._keys, self._values = tree_map(lambda a: a[..., :cut, :], (self._keys, self._values))
        self.offset -= n
        self._idx = cut

    def make_mask(
        self, N: int, window_size: int | None = None, return_array: bool = False
    ) -> mx.array | str | None:
        if N > 1:
            window_size = window_size or self.max_size
            offset = min(self.max_size - 1, self.offset)
            if offset + N > window_size or return_array:
                return create_causal_mask(N, offset, window_size=window_size)
            return "causal"
        if window_size is None:
            return None
        # A window narrower than the ring needs an explicit mask.
        if self.offset >= window_size and self.max_size > window_size:
            idx = self._idx
            if idx >= self.max_size:
                idx = 0
            mask_size = self.offset + 1 if self.offset < self.max_size else self.max_size
            mask = mx.arange(mask_size) >= (mask_size - window_size)
            return mx.roll(mask, idx + 1)
        return None


class RotatingKVCache(Batchable, RingKVCache):
    """Raw rows in a sliding window (mlx-lm ``RotatingKVCache``: same name and state)."""

    family = ROTATING_PLAIN_FAMILY

    def signature(self) -> str:
        return self.family.kind

    @property
    def state(self) -> tuple[Any, Any, int, int, int, int]:
        return self.keys, self.values, self.offset, self.keep, self.max_size, self._idx

    @state.setter
    def state(self, v: tuple[Any, Any, int, int, int, int]) -> None:
        self.keys, self.values, self.offset, self.keep, self.max_size, self._idx = v

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> RotatingQuantizedKVCache:
        """This ring affine-quantized in place of its rows (mlx-lm raises here)."""
        quant = RotatingQuantizedKVCache(self.max_size, self.keep, group_size, bits)
        quant.offset, quant._idx = self.offset, self._idx
        if self.keys is not None and self.values is not None:
            sig = parse_signature(quant.signature())
            quant.keys = quantize_rows(self.keys, sig)
            quant.values = quantize_rows(self.values, sig)
        return quant


class RotatingQuantizedKVCache(Batchable, AffineRows, RingKVCache):
    """Affine rows in a sliding window with ``keep`` sink tokens (new: mlx-lm has none)."""

    family = ROTATING_QUANT_FAMILY

    def __init__(self, max_size: int, keep: int = 0, group_size: int = 64, bits: int = 8) -> None:
        RingKVCache.__init__(self, max_size, keep)
        self._init_affine(group_size, bits)

    @property
    def state(self) -> tuple[Any, ...]:
        return (
            self.keys,
            self.values,
            self.offset,
            self.keep,
            self.max_size,
            self._idx,
            self.group_size,
            self.bits,
        )

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        (
            self.keys,
            self.values,
            self.offset,
            self.keep,
            self.max_size,
            self._idx,
            group_size,
            bits,
        ) = v
        self._init_affine(int(group_size), int(bits))
