"""Attention masks, built exactly as mlx-lm builds them (parity depends on it)."""

from __future__ import annotations

import mlx.core as mx

__all__ = ["create_causal_mask", "create_attention_mask"]


def create_causal_mask(
    N: int,
    offset: int = 0,
    window_size: int | None = None,
    left_padding: mx.array | None = None,
) -> mx.array:
    """Boolean ``[N, offset + N]`` mask: query ``i`` sees keys ``<= offset + i``,
    and with ``window_size`` only the last ``window_size`` of them. With
    ``left_padding`` (one count per batch row) it is ``[B, 1, N, offset + N]`` and
    hides each row's padding (mlx-lm's batch caches)."""
    rinds = mx.arange(offset + N)
    linds = mx.arange(offset, offset + N) if offset else rinds
    linds = linds[:, None]
    rinds = rinds[None]
    mask = linds >= rinds
    if window_size is not None:
        mask = mask & (linds < rinds + window_size)
    if left_padding is not None:
        mask = mask & (mx.expand_dims(left_padding, (1, 2, 3)) <= rinds)
    return mask


def create_attention_mask(
    N: int, offset: int, return_array: bool = False, window_size: int | None = None
) -> mx.array | str | None:
    """The mask for ``N`` new tokens after ``offset`` cached ones.

    ``None`` for a single unwindowed token, the string ``"causal"`` where the
    fused kernel can build it, otherwise a boolean array.
    """
    if window_size is not None:
        return create_causal_mask(N, offset, window_size=window_size)
    if N == 1:
        return None
    if return_array:
        return create_causal_mask(N, offset, window_size=window_size)
    return "causal"
