"""TurboQuant's decode core as one CUDA kernel: unpack, centroid lookup and scale.

On an H200 a TurboQuant 4/4 decode of a 4096-token llama-8B restore's 64 tensors took
19.4 ms through MLX ops, 15.3 of it unpacking the indices and looking them up (a dozen
element-wise kernels a tensor), against 1.7 ms for ``mx.dequantize`` of the same rows
at q8 (``tools/bench/results/gpu/08c4ce0/decode-probe.txt``). Here one kernel does
those steps: each thread reads its value's bits from the packed words (the
little-endian stream of :mod:`~kvstore.turboquant.packing`), looks its centroid up
and multiplies it by its row's scale, the same float32 multiply of the same operands
as the ops it replaces. Bit-identity is proven once per process and width on rows of
its own before the kernel is used (:func:`_proven`); a difference, or a kernel that
does not build, leaves the MLX ops in place.

On by default: on the H200 the kernel decodes those 64 tensors in 2.66 ms against
11.25 ms through the ops, and a TurboQuant 4/4 restore took 40.8 ms against 52.4
(``tools/bench/results/gpu/7837ba3/``). ``KVSTORE_TQ_DECODE_KERNEL=0`` turns it off.
"""

from __future__ import annotations

import functools
import math
import threading
from typing import Any

import mlx.core as mx
import numpy as np

from kvstore.cuda_kernel import cuda_kernel
from kvstore.turboquant.kernel_switch import switched_on
from kvstore.turboquant.packing import pack_indices, unpack_indices

__all__ = ["ENV", "decoded", "enabled"]

#: The switch (``"0"``: never use the kernel; anything else: use it where it is proven).
ENV = "KVSTORE_TQ_DECODE_KERNEL"
_BLOCK = 256

#: One thread per output value. ``count``: the rows; ``codes`` ``[count, WORDS]`` uint32,
#: ``factors`` ``[count]`` and ``table`` (the centroids) float32; ``out`` ``[count, DIM]``.
#: A value crossing a word boundary takes its high bits from the next word.
_SOURCE = """
    unsigned long long e = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= (unsigned long long)count[0] * DIM) return;
    unsigned long long n = e / DIM;
    unsigned int j = (unsigned int)(e - n * DIM);
    unsigned int bit = j * BITS, w = bit >> 5, o = bit & 31;
    const unsigned int* row = codes + n * WORDS;
    unsigned int v = row[w] >> o;
    if (o + BITS > 32) v |= row[w + 1] << (32 - o);
    out[e] = table[v & MASK] * factors[n];
"""


def enabled() -> bool:
    """Whether decodes may use the kernel: not switched off, and the default device a CUDA GPU."""
    return switched_on(ENV)


def decoded(
    rows: mx.array, factors: mx.array, table: mx.array, bits: int, dim: int
) -> mx.array | None:
    """``table[index] * factor`` (float32 ``[N, dim]``) of packed ``rows`` (uint32
    ``[N, words]``) and their ``factors`` (float32 ``[N, 1]``), lazily, by the kernel;
    ``None`` where it is not to be used (:func:`enabled`, :func:`_proven`)."""
    if not rows.shape[0] or not enabled() or not _proven(bits, dim, int(rows.shape[-1])):
        return None
    return _launch(rows, factors, table, bits, dim)


def source(bits: int, dim: int, words: int) -> str:
    """The kernel's body for these constants (what :func:`_kernel` compiles)."""
    return (
        _SOURCE.replace("BITS", str(bits))
        .replace("DIM", str(dim))
        .replace("WORDS", str(words))
        .replace("MASK", str((1 << bits) - 1))
    )


@functools.cache
def _kernel(bits: int, dim: int, words: int) -> Any:
    return cuda_kernel(
        name=f"kvstore_tq_decode_{bits}_{dim}",
        input_names=["codes", "factors", "table", "count"],
        output_names=["out"],
        source=source(bits, dim, words),
    )


def _launch(rows: mx.array, factors: mx.array, table: mx.array, bits: int, dim: int) -> mx.array:
    count = int(rows.shape[0])
    threads = max(1, math.ceil(count * dim / _BLOCK)) * _BLOCK
    (out,) = _kernel(bits, dim, int(rows.shape[-1]))(
        inputs=[
            rows.astype(mx.uint32),
            factors.reshape(-1).astype(mx.float32),
            table.astype(mx.float32),
            mx.array(np.array([count], np.uint32)),
        ],
        output_shapes=[(count, dim)],
        output_dtypes=[mx.float32],
        grid=(threads, 1, 1),
        threadgroup=(_BLOCK, 1, 1),
    )
    return out


_LOCK = threading.Lock()
_PROVEN: dict[tuple[int, int, int], bool] = {}


def _proven(bits: int, dim: int, words: int) -> bool:
    """Whether the kernel builds here and gives, bit for bit, what the MLX ops give, on
    rows of its own (every index value, a value crossing each word boundary), once per
    process and ``(bits, dim, words)``."""
    key = (bits, dim, words)
    with _LOCK:
        if key not in _PROVEN:
            _PROVEN[key] = _try(bits, dim, words)
        return _PROVEN[key]


def _try(bits: int, dim: int, words: int) -> bool:
    rng = np.random.default_rng(bits * 1000 + dim)
    index = rng.integers(0, 1 << bits, (67, dim)).astype(np.uint8)
    index[0] = np.arange(dim) % (1 << bits)
    codes = pack_indices(mx.array(index), bits)
    if int(codes.shape[-1]) != words:
        return False
    factors = mx.array(rng.standard_normal((67, 1)).astype(np.float32))
    table = mx.array(np.sort(rng.standard_normal(1 << bits)).astype(np.float32))
    want = mx.take(table, unpack_indices(codes, bits, dim)) * factors  # a gather is exact
    try:
        got = _launch(codes, factors, table, bits, dim)
        same = np.array_equal(np.array(got).view(np.uint32), np.array(want).view(np.uint32))
    except Exception:  # noqa: BLE001 - a kernel that does not build or run: the ops stay
        return False
    return bool(same)
