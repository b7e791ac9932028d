"""b-bit indices in uint32 words, bit-identical to MLX's affine packing.

Index j of a row occupies bits ``[j*b, (j+1)*b)`` of a little-endian stream
of uint32 words; a value crossing a word boundary puts its low bits in word
``w`` and its high bits in word ``w + 1``; padding bits are 0. Because this is
exactly the layout ``mx.quantize`` writes, ``mx.dequantize`` with scale 1 and
bias 0 unpacks it into exact small integers (rows whose length is a multiple
of 32). Packing works on blocks of 32 values (exactly b words) with a static
bit map; unpacking reads groups of 8 values (exactly b bytes), which is faster
on CPU than ``mx.dequantize`` and gives integers directly.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

__all__ = [
    "packed_words",
    "pack_indices",
    "unpack_indices",
    "unpack_indices_dequantize",
    "unpack_indices_reference",
]

_BLOCK = 32  # values per block; a block of b-bit values is exactly b words


def packed_words(dim: int, bits: int) -> int:
    """uint32 words per packed row: ``ceil(dim * bits / 32)``."""
    return (dim * bits + 31) // 32


@functools.cache
def _word_plan(bits: int) -> tuple[tuple[int, int, mx.array, mx.array], ...]:
    """For each of the ``bits`` words of a block: the range ``[j0, j1)`` of values
    touching it, and per value the left and right shifts that put its bits in place
    (a value carried over from the previous word has a negative offset, so it is
    shifted right; one spilling into the next word loses its high bits to uint32)."""
    start = np.arange(_BLOCK) * bits
    plan = []
    for w in range(bits):
        js = np.nonzero((start < 32 * (w + 1)) & (start + bits > 32 * w))[0]
        shift = start[js] - 32 * w
        left = mx.array(np.maximum(shift, 0).astype(np.uint32))
        right = mx.array(np.maximum(-shift, 0).astype(np.uint32))
        plan.append((int(js[0]), int(js[-1]) + 1, left, right))
    return tuple(plan)


@functools.cache
def _value_plan(bits: int) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """For each of the 32 values of a block: its low word, the word after it, and the
    shifts that read its bits from the pair (the inverse of :func:`_word_plan`)."""
    start = np.arange(_BLOCK) * bits
    word, offset = start // 32, start % 32
    # Read as a 64-bit span, the next word lands at bit 32 - offset: above the value's
    # mask unless the value crosses into it (the last word has no next: reuse it).
    high_shift = (32 - offset).astype(np.uint64)
    return (
        mx.array(word.astype(np.int32)),
        mx.array(np.minimum(word + 1, bits - 1).astype(np.int32)),
        mx.array(offset.astype(np.uint64)),
        mx.array(high_shift),
    )


def _to_blocks(a: mx.array, length: int) -> mx.array:
    """Zero-pad the last axis of ``a`` to a multiple of ``length``, then split it into blocks."""
    pad = -a.shape[-1] % length
    if pad:
        a = mx.concatenate([a, mx.zeros((*a.shape[:-1], pad), a.dtype)], axis=-1)
    return a.reshape(*a.shape[:-1], -1, length)


@functools.cache
def _byte_plan(bits: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """For each of the ``bits`` bytes a group of 8 values fills: ``(value, shift)`` of
    every value touching it; a positive shift moves the value left (bits the byte cannot
    hold fall off its top), a negative one right (the bits already in the byte before)."""
    return tuple(
        tuple((i, i * bits - 8 * p) for i in range(8) if 8 * p - bits < i * bits < 8 * p + 8)
        for p in range(bits)
    )


def _pack_bytes(idx: mx.array, bits: int) -> mx.array:
    """Pack through bytes: 8 values of b bits fill exactly b bytes of the little-endian
    stream, built with uint8 shifts (a quarter of uint32 traffic) and viewed as words."""
    lead = idx.shape[:-1]
    if 8 % bits == 0:
        # Whole values per byte (1, 2 or 4 bits): each byte is its own run of 8 // bits
        # values ORed, written in order, no stack of strided bytes. The 2-core CPU, 4
        # bits, 1024 rows of 64 compiled with the rest of an encode: 158 -> 31-106 us;
        # 4096 rows of 128: 388 -> 250 (2 bits alike; 1 bit was this already).
        per = 8 // bits
        runs = idx.astype(mx.uint8).reshape(*lead, -1, per)
        byte = runs[..., 0]
        for i in range(1, per):
            byte = byte | (runs[..., i] << (i * bits))
        return byte.reshape(*lead, -1).view(mx.uint32)
    groups = idx.astype(mx.uint8).reshape(*lead, -1, 8)
    values = [groups[..., i] for i in range(8)]
    stream = []
    for touching in _byte_plan(bits):
        parts = [values[i] << s if s >= 0 else values[i] >> -s for i, s in touching]
        byte = parts[0]
        for part in parts[1:]:
            byte = byte | part
        stream.append(byte)
    return mx.stack(stream, axis=-1).reshape(*lead, -1).view(mx.uint32)


def pack_indices(idx: mx.array, bits: int) -> mx.array:
    """Pack integer indices ``[..., D]`` (each < 2**bits) into uint32 ``[..., ceil(D*bits/32)]``.

    Rows of whole bytes and words (``bits <= 4``, ``D % 8 == 0``, ``D*bits % 32 == 0``:
    every head_dim of a real model) pack through bytes, about 2-4x faster on CPU than
    through words; both paths write the same bits (tests hold them to the spec's stream).
    """
    dim = idx.shape[-1]
    if bits <= 4 and dim % 8 == 0 and dim * bits % 32 == 0:
        return _pack_bytes(idx, bits)
    return _pack_words(idx, bits)


def _pack_words(idx: mx.array, bits: int) -> mx.array:
    """Pack through uint32 blocks of 32 values (any bits and D)."""
    dim = idx.shape[-1]
    blocks = _to_blocks(idx.astype(mx.uint32), _BLOCK)
    # Bit ranges never overlap, so summing the shifted values is a bitwise OR.
    if 32 % bits == 0:  # no value crosses a word: one word per 32/bits values
        per_word = blocks.reshape(*blocks.shape[:-1], bits, 32 // bits)
        words = (per_word << mx.arange(0, 32, bits, dtype=mx.uint32)).sum(-1)
    else:
        words = mx.stack(
            [
                ((blocks[..., j0:j1] << left) >> right).sum(-1)
                for j0, j1, left, right in _word_plan(bits)
            ],
            axis=-1,
        )
    words = words.astype(mx.uint32)
    return words.reshape(*words.shape[:-2], -1)[..., : packed_words(dim, bits)]


def unpack_indices_reference(codes: mx.array, bits: int, dim: int) -> mx.array:
    """The integer indices (uint32 ``[..., dim]``) of packed rows, any ``dim``."""
    low, high, offset, high_shift = _value_plan(bits)
    blocks = _to_blocks(codes.astype(mx.uint64), bits)  # [..., n, bits]
    lo = mx.take(blocks, low, axis=-1)
    hi = mx.take(blocks, high, axis=-1)
    span = (lo >> offset) | (hi << high_shift)
    values = span & ((1 << bits) - 1)
    return values.reshape(*values.shape[:-2], -1)[..., :dim].astype(mx.uint32)


def _unpack_byte_groups(codes: mx.array, bits: int, dim: int) -> mx.array:
    """Unpack ``bits <= 4`` through bytes: 8 values of b bits fill exactly b bytes of
    the little-endian stream, so each group of b bytes is one small integer holding
    8 values. Few full-size passes, integer results (no float round trip)."""
    lead = codes.shape[:-1]
    groups = -(-dim // 8)
    stream = codes.view(mx.uint8)  # the words' little-endian bytes are the bitstream
    if stream.shape[-1] < groups * bits:  # a tail group reaching past the last word
        pad = groups * bits - stream.shape[-1]
        stream = mx.concatenate([stream, mx.zeros((*lead, pad), mx.uint8)], axis=-1)
    by = stream[..., : groups * bits].reshape(*lead, groups, bits).astype(mx.uint32)
    word = by[..., 0]
    for i in range(1, bits):
        word = word | (by[..., i] << (8 * i))
    values = (word[..., None] >> mx.arange(0, 8 * bits, bits, dtype=mx.uint32)) & ((1 << bits) - 1)
    return values.reshape(*lead, -1)[..., :dim]


def _unpack_whole_bytes(codes: mx.array, bits: int, dim: int) -> mx.array:
    """Unpack ``bits`` dividing 8: each byte of the little-endian stream holds
    ``8 // bits`` whole values, lowest first, so one shift per value slot and one mask
    read them all. On a GPU each element-wise step is a kernel: 4-bit rows unpack in
    3 full-size passes (shift, mask, widen) here against 9 through byte groups (H200:
    64 tensors of [1, 8, 4096, 128] took 9.9 ms that way,
    ``tools/bench/results/gpu/08c4ce0/decode-probe.txt``). On the 2-core CPU it is
    no faster: a TurboQuant 4/4 decode of 8192 rows took 0.5-3% longer this way (head
    dims 64-256, alternating runs), 2-bit rows unpacked 20% slower (byte groups take
    5 passes there). So :func:`unpack_indices` takes it for 4 bits on a GPU only."""
    stream = codes.view(mx.uint8)  # the words' little-endian bytes are the bitstream
    shifts = mx.arange(0, 8, bits, dtype=mx.uint8)
    values = (stream[..., None] >> shifts) & ((1 << bits) - 1)
    return values.reshape(*codes.shape[:-1], -1)[..., :dim].astype(mx.uint32)


def unpack_indices_dequantize(codes: mx.array, bits: int, dim: int) -> mx.array:
    """The spec's conformant unpacker: ``mx.dequantize`` with scale 1 and bias 0
    (needs ``dim % 32 == 0``); float32 exact small integers."""
    if dim % _BLOCK:
        raise ValueError(
            f"[turboquant.packing] mx.dequantize unpacks rows of a multiple of 32 values; "
            f"received dim {dim}. Use unpack_indices."
        )
    lead = codes.shape[:-1]
    rows = codes.reshape(-1, codes.shape[-1])  # mx.dequantize wants a matrix
    groups = (rows.shape[0], dim // _BLOCK)
    one = mx.broadcast_to(mx.array(1.0, mx.float32), groups)
    zero = mx.broadcast_to(mx.array(0.0, mx.float32), groups)
    return mx.dequantize(rows, one, zero, group_size=_BLOCK, bits=bits).reshape(*lead, dim)


def unpack_indices(codes: mx.array, bits: int, dim: int) -> mx.array:
    """The indices (uint32 ``[..., dim]``) of packed rows, by the fastest exact path:
    on a GPU whole bytes for 4 bits (fewer kernels), else byte groups for
    ``bits <= 4`` (on CPU 2-12x faster than ``mx.dequantize``, which is slowest at 3
    bits), otherwise :func:`unpack_indices_reference`. All paths are bit-identical;
    tests hold them to each other and to ``mx.dequantize``."""
    if bits == 4 and mx.default_device() == mx.gpu:
        return _unpack_whole_bytes(codes, bits, dim)
    if bits <= 4:
        return _unpack_byte_groups(codes, bits, dim)
    return unpack_indices_reference(codes, bits, dim)
