"""TurboQuant's whole encode and whole decode, each one CUDA kernel (RHT, one round).

Through MLX ops an encode is a dozen kernels or more (norm, signs, Hadamard
transform, the cell compares, scale, the packing's shifts and sums) and a
decode half as many after :mod:`~kvstore.turboquant.cuda_decode`'s kernel (the
inverse transform, signs, cast): on an H200 one llama-8B layer of 4096 tokens
took 7.5 ms to encode and 2.9 ms to decode, against 0.11 and 0.07 ms for
``mx.quantize``/``mx.dequantize`` 4-bit g64 of the same rows
(``tools/bench/results/gpu/probe.log``). Here one warp holds one vector, each
of its 32 lanes ``D/32`` consecutive coordinates, and does every step in
registers:

* encode: the squared norm (a warp sum), the signs, the Walsh-Hadamard
  butterflies (strides inside a lane first, then across lanes by shuffles, the
  natural Sylvester order ``mx.hadamard_transform`` computes), ``1/sqrt(D)``,
  each coordinate's cell (``#{k : t_k < z}``, ties to the lower cell), the
  row's scale (``l2``, ``matched`` or ``ls``: warp sums) and the codes, packed
  into the little-endian stream of :mod:`~kvstore.turboquant.packing` through
  the warp's shared words;
* decode: each value's bits read from its words, ``centroid * factor``, the
  same butterflies, ``1/sqrt(D)``, the signs, the cast to the wanted dtype.

The butterflies add in another order than MLX's transform, so the results are
not bit for bit the ops': a coordinate within float32 rounding of a threshold
may land in the neighbouring cell, and a decoded value may round to the
neighbouring bfloat16 (the spec asks CPU and GPU decodes to agree within one
ulp; they never were bit-identical, MLX's CPU and CUDA transforms differ too).
Each kernel is proven once per process and shape against the ops on vectors of
its own before it is used (:func:`_proven`): decodes within ``1e-5`` of the
largest value (and one ulp of a narrower output); encodes with the same checks'
verdicts, every cell the ops' unless the coordinate lies within ``1e-5`` of a
threshold (then a neighbour), and the scale of every row whose cells all agree
within ``1e-5``. A kernel
that does not build or is not proven leaves the ops in place.

A layer's keys and values are encoded by one launch (:func:`encoded_together`) and
decoded by one (:func:`decoded_together`): each tensor's row encode (decode) is a device
function of the kernel's header, and the pair is proven as a pair, on trial rows of
each tensor's own.

On by default on a CUDA GPU; ``KVSTORE_TQ_RHT_KERNEL=0`` turns both off.
Rotations other than one-round RHT (dense matrices for head dims that are not
powers of two, two rounds), and head dims outside 32..1024, take the ops.
"""

from __future__ import annotations

import functools
import math
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import mlx.core as mx
import numpy as np

from kvstore.cuda_kernel import cuda_kernel
from kvstore.knobs import switch_from_env
from kvstore.turboquant.codebook import codebook
from kvstore.turboquant.kernel_switch import switched_on
from kvstore.turboquant.packing import pack_indices, packed_words, unpack_indices
from kvstore.turboquant.verdict import FINE, NOT_FINITE, WIDE_SCALE

__all__ = [
    "ENV",
    "TOGETHER",
    "decode_parts",
    "decoded",
    "decoded_together",
    "enabled",
    "encode_parts",
    "encoded",
    "encoded_together",
    "usable",
]

#: The switch (``"0"``: never use the kernels; anything else: use them where proven).
ENV = "KVSTORE_TQ_RHT_KERNEL"
#: Threads per block: 8 warps, 8 vectors.
_BLOCK = 256
_MODES = {"l2": 0, "matched": 1, "ls": 2}

#: Shared by both kernels: ``v`` holds lane ``lane``'s ``V`` coordinates
#: (``j = lane * V + i``); the butterflies pair ``j`` with ``j ^ h`` for every
#: stride ``h``: in a lane for ``h < V``, across lanes (mask ``h / V``) above.
_BUTTERFLIES = """
    #pragma unroll
    for (int h = 1; h < V; h <<= 1) {
        #pragma unroll
        for (int i = 0; i < V; ++i) {
            if ((i & h) == 0) { float a = v[i], b = v[i + h]; v[i] = a + b; v[i + h] = a - b; }
        }
    }
    #pragma unroll
    for (unsigned int m = 1; m < 32; m <<= 1) {
        #pragma unroll
        for (int i = 0; i < V; ++i) {
            float o = __shfl_xor_sync(0xffffffffu, v[i], m);
            v[i] = (lane & m) ? (o - v[i]) : (v[i] + o);
        }
    }
"""


def _chunked_copy(dst: str, src: str, address: str) -> str:
    """CUDA copying ``raw`` (``alignas(16) unsigned char[NB]``) between a lane's ``V``
    consecutive values at ``dst``/``src``, in the widest stores (loads) their address
    allows: a lane's values are adjacent, so 16-byte accesses make a warp's 32 one
    contiguous transaction where 2-byte ones touched each of its segments ``V`` times.
    ``NB`` (the byte count) is a compile-time constant; the branch on the address is
    the same across a warp's lanes for any row-aligned array."""
    lines = ["    {", f"    const auto at = reinterpret_cast<unsigned long long>({address});"]
    for width, vec in ((16, "uint4"), (8, "uint2"), (4, "unsigned int")):
        cond = "if" if width == 16 else "} else if"
        lines += [
            f"    {cond} (NB % {width} == 0 && (at & {width - 1}ull) == 0) {{",
            "        #pragma unroll",
            f"        for (int c = 0; c < NB / {width}; ++c) reinterpret_cast<{vec}*>({dst})[c] = "
            f"reinterpret_cast<const {vec}*>({src})[c];",
        ]
    lines += [
        "    } else {",
        "        #pragma unroll",
        f"        for (int c = 0; c < NB / 2; ++c) reinterpret_cast<unsigned short*>({dst})[c] = "
        f"reinterpret_cast<const unsigned short*>({src})[c];",
        "    }",
        "    }",
    ]
    return "\n".join(lines) + "\n"


#: The encode of row ``row`` of ``x`` ``[N, D]`` by the calling warp, a device function
#: (``ROW_FN``, of rows of type ``ROW_T``) in the kernel's header: one per tensor a kernel
#: encodes (:func:`encode_parts`). Writes ``codes`` ``[N, WORDS]`` uint32, ``scale``
#: ``[N]`` float32, the same scales rounded to float16 (``scale16``, what is stored unless
#: a check says otherwise: no cast after the kernel) and ``verdicts`` ``[N]`` uint8, each
#: row's :mod:`~kvstore.turboquant.verdict`: ``NOT_FINITE`` where the norm is not finite,
#: else ``WIDE_SCALE`` where the scale's magnitude passes ``SCALE_LIMIT``, else ``FINE``.
_ENCODE = (
    """
__device__ __forceinline__ void ROW_FN(
    const ROW_T* x, const unsigned long long row, const unsigned int lane,
    const unsigned int warp, const float* signs, const float* thresholds,
    const float* centroids, unsigned int* codes, float* scale, __half* scale16,
    unsigned char* verdicts) {
    constexpr int V = DIM / 32;
    constexpr int NB = V * (int)sizeof(x[0]);
    __shared__ unsigned int packed[WARPS][WORDS];
    const auto* src = x + row * DIM + lane * V;
    alignas(16) unsigned char raw[NB];
"""
    + _chunked_copy("raw", "src", "src")
    + """
    const auto* t = reinterpret_cast<decltype(src)>(raw);
    float v[V];
    float ss = 0.0f;
    #pragma unroll
    for (int i = 0; i < V; ++i) {
        v[i] = static_cast<float>(t[i]);
        ss += v[i] * v[i];
    }
    #pragma unroll
    for (unsigned int m = 16; m >= 1; m >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, m);
    const float n = sqrtf(ss);
    #pragma unroll
    for (int i = 0; i < V; ++i) v[i] *= signs[lane * V + i];
"""
    + _BUTTERFLIES
    + """
    const float inv = n > 0.0f ? ROOT_D / n : 0.0f;
    unsigned int idx[V];
    float cc = 0.0f, yc = 0.0f;
    #pragma unroll
    for (int i = 0; i < V; ++i) {
        const float y = v[i] * INV_ROOT_D;
        const float z = y * inv;
        unsigned int c = 0;
        #pragma unroll
        for (int k = 0; k < CELLS - 1; ++k) c += (z > thresholds[k]) ? 1u : 0u;
        idx[i] = c;
        const float e = centroids[c];
        cc += e * e;
        yc += y * e;
    }
    float s;
    if (MODE == 0) {
        s = n / ROOT_D;
    } else {
        #pragma unroll
        for (unsigned int m = 16; m >= 1; m >>= 1) {
            cc += __shfl_xor_sync(0xffffffffu, cc, m);
            yc += __shfl_xor_sync(0xffffffffu, yc, m);
        }
        s = MODE == 1 ? n / sqrtf(cc) : yc / cc;
    }
    for (unsigned int w = lane; w < WORDS; w += 32) packed[warp][w] = 0u;
    __syncwarp();
    #pragma unroll
    for (int i = 0; i < V; ++i) {
        const unsigned int bit = (lane * V + i) * BITS, w = bit >> 5, o = bit & 31u;
        atomicOr(&packed[warp][w], idx[i] << o);
        if (o + BITS > 32) atomicOr(&packed[warp][w + 1], idx[i] >> (32 - o));
    }
    __syncwarp();
    for (unsigned int w = lane; w < WORDS; w += 32) codes[row * WORDS + w] = packed[warp][w];
    if (lane == 0) {
        scale[row] = s;
        scale16[row] = __float2half_rn(s);
        // n - n is 0 for a finite n, NaN for inf or NaN (no library call; no fast math).
        // One byte, the larger the worse (encode_many's verdicts): a maximum of them all
        // is the tensor's.
        verdicts[row] = (n - n == 0.0f) ? (fabsf(s) > SCALE_LIMIT ? WIDE_SCALE : FINE) : NOT_FINITE;
    }
}
"""
)

#: The decode of row ``row`` of ``codes`` ``[N, WORDS]`` by the calling warp, a device
#: function (``ROW_FN``, scales of type ``SCALE_T``, output of type ``OUT_T``) in the kernel's
#: header: one per tensor a kernel decodes (:func:`decode_parts`). ``factors`` ``[N]`` (the
#: scales, of their stored float type), ``table`` (the centroids) float32; writes ``out``
#: ``[N, D]``.
_DECODE = (
    """
__device__ __forceinline__ void ROW_FN(
    const unsigned int* codes, const unsigned long long row, const unsigned int lane,
    const SCALE_T* factors, const float* table, const float* signs, OUT_T* out) {
    constexpr int V = DIM / 32;
    const unsigned int* words = codes + row * WORDS;
    const float f = static_cast<float>(factors[row]);
    float v[V];
    #pragma unroll
    for (int i = 0; i < V; ++i) {
        const unsigned int bit = (lane * V + i) * BITS, w = bit >> 5, o = bit & 31u;
        unsigned int c = words[w] >> o;
        if (o + BITS > 32) c |= words[w + 1] << (32 - o);
        v[i] = table[c & MASK] * f;
    }
"""
    + _BUTTERFLIES
    + """
    constexpr int NB = V * (int)sizeof(OUT_T);
    alignas(16) unsigned char raw[NB];
    OUT_T* t = reinterpret_cast<OUT_T*>(raw);
    #pragma unroll
    for (int i = 0; i < V; ++i) t[i] = OUT_T(v[i] * INV_ROOT_D * signs[lane * V + i]);
    OUT_T* dst = out + row * DIM + lane * V;
"""
    + _chunked_copy("dst", "raw", "dst")
    + "}\n"
)


class Quantizer(Protocol):
    """What the kernels read of a :class:`~kvstore.turboquant.quantizer.TurboQuantizer`."""

    bits: int
    dim: int
    rotation: Any
    centroids: mx.array

    @property
    def scale_mode(self) -> str: ...

    def quantize(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]: ...


def enabled() -> bool:
    """Whether encodes and decodes may use the kernels: not switched off, and the
    default device a CUDA GPU."""
    return switched_on(ENV)


def usable(q: Quantizer) -> bool:
    """Whether ``q``'s code is one the kernels do: a one-round RHT over a power-of-two
    head dim of 32 to 1024 (whole lanes), and the kernels switched on."""
    return _kernel_code(q) and enabled()


def _kernel_code(q: Quantizer) -> bool:
    """:func:`usable` but for the switch: asked of each tensor of a launch, the switch
    once per launch (each of these checks ~1 us of a layer's ~80 on an H200 host)."""
    rotation = q.rotation
    return (
        32 <= q.dim <= 1024
        and q.dim & (q.dim - 1) == 0
        and getattr(rotation, "method", None) == "rht"
        and rotation.rounds == 1
        and q.scale_mode in _MODES
    )


def encoded(
    rows: mx.array, q: Quantizer, scale_limit: float
) -> tuple[mx.array, mx.array, mx.array, mx.array] | None:
    """``(codes uint32 [N, W], scale float32 [N], scale float16 [N], verdict uint8 [])``
    of ``rows`` ``[N, D]``, lazily, by the kernel: ``verdict`` is the worst of the rows'
    (:mod:`~kvstore.turboquant.verdict`; a scale is wide past ``scale_limit``). ``None``
    where the kernel is not to be used."""
    together = encoded_together([(rows, q)], scale_limit)
    if together is None:
        return None
    ((codes, scale, scale16),), verdicts = together
    # A maximum of every row's byte: on an H200 the kernel with it 51 us a 512-token
    # layer, with the two flags per row ORed by column (mx.any(axis=0)) 68
    # (tools/bench/results/gpu/774ad9e/floor-probe.txt).
    return codes, scale, scale16, mx.max(verdicts)


def encoded_together(
    tensors: Sequence[tuple[mx.array, Quantizer]], scale_limit: float
) -> tuple[list[tuple[mx.array, mx.array, mx.array]], mx.array] | None:
    """Each of ``tensors``' (vectors ``[..., D]`` and their quantizer) ``(codes uint32
    [..., W], scale float32 [...], scale float16 [...])`` and every row's verdict, all
    tensors' rows in order (uint8 ``[sum of rows]``), lazily:
    one kernel launch per :data:`TOGETHER` tensors (a layer's keys and values), where
    each was a launch and a reduction of its own (H200, a 512-token llama-8B layer:
    ``encode_many`` of keys and values 108 us against ``mx.quantize``'s 40,
    ``tools/bench/results/gpu/cdb1083/floor-probe.txt``). ``None`` where the kernels
    are not to be used for every tensor (then for none)."""
    if not tensors or not enabled() or not all(_encodable(x, q) for x, q in tensors):
        return None
    groups = _groups(tensors)
    # A group's kernel proven as it is: a pair's proof checks each tensor against the ops,
    # so its tensors' own kernels are neither built nor proven (each build is ~1 s of a
    # process's first encode). A pair not proven leaves every tensor to its own kernel.
    if not all(
        _proven("encode", group[0][1], group[0][0].dtype, scale_limit)
        if len(group) == 1
        else _proven_together(group, scale_limit)
        for group in groups
    ):
        return None
    outputs: list[tuple[mx.array, mx.array, mx.array]] = []
    verdicts = []
    for group in groups:
        made, rows_verdicts = _encode(group, scale_limit)
        outputs += made
        verdicts.append(rows_verdicts)
    return outputs, verdicts[0] if len(verdicts) == 1 else mx.concatenate(verdicts)


def _encodable(x: mx.array, q: Quantizer) -> bool:
    """Whether vectors ``x`` ``[..., D]`` of ``q`` are of a kind the kernels encode (the
    switch asked apart)."""
    shape = x.shape
    return (
        bool(shape) and shape[-1] == q.dim and x.size > 0 and x.dtype in _CUDA_TYPES
    ) and _kernel_code(q)


def decoded(rows: mx.array, scales: mx.array, q: Quantizer, dtype: mx.Dtype) -> mx.array | None:
    """``R^-1(table[index] * scale)`` as ``dtype`` ``[N, D]`` of packed ``rows``
    (uint32 ``[N, W]``) and their ``scales`` (``[N]``, float16 or float32), lazily,
    by the kernel; ``None`` where it is not to be used."""
    together = decoded_together([(rows, scales, q, dtype)])
    return None if together is None else together[0]


#: A tensor to decode: ``(rows uint32 [N, W], scales [N], quantizer, output dtype)``.
DecodeItem = tuple[mx.array, mx.array, "Quantizer", mx.Dtype]


def decoded_together(tensors: Sequence[DecodeItem]) -> list[mx.array] | None:
    """:func:`decoded` of each of ``tensors``, lazily: one kernel launch per
    :data:`TOGETHER` tensors (a layer's keys and values, or a restore's stacked layers'),
    where each was a launch of its own. ``None`` where the kernels are not to be used for
    every tensor (then for none)."""
    if not tensors or not enabled():
        return None
    if not all(_decodable(rows, q, dtype) for rows, _, q, dtype in tensors):
        return None
    groups = _groups(tensors)
    if not all(
        _proven("decode", group[0][2], group[0][3], group[0][1].dtype)
        if len(group) == 1
        else _proven_decode_together(group)
        for group in groups
    ):
        return None
    return [out for group in groups for out in _decode(group)]


def _groups(tensors: Sequence[Any]) -> list[Sequence[Any]]:
    """``tensors`` in the groups that share a launch: :data:`TOGETHER` each, or one each
    where :data:`TOGETHER_ENV` is ``"0"``."""
    size = TOGETHER if switch_from_env(TOGETHER_ENV) else 1
    return [tensors[i : i + size] for i in range(0, len(tensors), size)]


def _decodable(rows: mx.array, q: Quantizer, dtype: mx.Dtype) -> bool:
    """Whether packed ``rows`` of ``q`` decoded as ``dtype`` are a kind the kernels do
    (the switch asked apart)."""
    return bool(rows.shape[0]) and dtype in _CUDA_TYPES and _kernel_code(q)


def _float(value: float) -> str:
    """A float32 constant as CUDA source: the float32 nearest ``value``, exactly."""
    return f"{float(np.float32(value))!r}f"


def _source(template: str, bits: int, dim: int, mode: str, scale_limit: float) -> str:
    constants = {
        "DIM": str(dim),
        "BITS": str(bits),
        "WORDS": str(packed_words(dim, bits)),
        "CELLS": str(1 << bits),
        "MASK": str((1 << bits) - 1),
        "MODE": str(_MODES[mode]),
        "WARPS": str(_BLOCK // 32),
        "INV_ROOT_D": _float(1.0 / math.sqrt(dim)),
        "ROOT_D": _float(math.sqrt(dim)),
        "SCALE_LIMIT": _float(scale_limit),
        "NOT_FINITE": str(NOT_FINITE),
        "WIDE_SCALE": str(WIDE_SCALE),
        "FINE": str(FINE),
    }
    # Longest names first: ROOT_D is inside INV_ROOT_D.
    for name in sorted(constants, key=len, reverse=True):
        template = template.replace(name, constants[name])
    return template


#: The CUDA type of each row dtype an encode reads.
_CUDA_TYPES = {mx.bfloat16: "__nv_bfloat16", mx.float16: "__half", mx.float32: "float"}
#: At most this many tensors share one encode kernel (a layer's keys and values): each
#: other count is one more kernel to build and prove per configuration.
TOGETHER = 2
#: ``"0"``: each tensor of an :func:`encoded_together` or :func:`decoded_together`
#: launched alone, as before them (for the device's A/B, ``tools/bench/gpu/next.sh
#: together``).
TOGETHER_ENV = "KVSTORE_TQ_TOGETHER"

#: An encode kernel's tensor: ``(bits, head dim, scale mode, rows' dtype name)``.
EncodeConfig = tuple[int, int, str, str]


#: A pair kernel body's first lines: the calling warp's row of all the tensors' rows, its
#: lane, and where the tensor being walked starts and ends among those rows.
_WARP_ROW = (
    "const unsigned long long row = "
    "((unsigned long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;\n"
    "const unsigned int lane = threadIdx.x & 31u;\n"
    "unsigned long long start = 0, end = 0;"
)


def _config(rows: mx.array, q: Quantizer) -> EncodeConfig:
    return (q.bits, q.dim, q.scale_mode, _name(rows.dtype))


def encode_parts(
    configs: Sequence[EncodeConfig], scale_limit: float
) -> tuple[str, list[str], list[str], str, str]:
    """``(name, input names, output names, header, body)`` of the kernel encoding one
    tensor of each of ``configs``: tensor ``s``'s inputs ``x<s>`` (vectors ``[..., D]``),
    ``signs<s>``, ``thresholds<s>``, ``centroids<s>``; its outputs ``codes<s>``,
    ``scale<s>``, ``scale16_<s>``; then ``verdicts``, every tensor's rows in order. One
    warp per row of them all; each tensor's row encode is a device function of the
    header (:data:`_ENCODE`), so that a pair's kernel computes as each one's alone."""
    header, inputs, outputs = [], [], []
    body = [
        _WARP_ROW,
        "const unsigned int warp = threadIdx.x >> 5;",
        "unsigned long long rows = 1;",
    ]
    for s, (bits, dim, mode, dtype) in enumerate(configs):
        fn = f"kvstore_tq_encode_row_{s}"
        ctype = _CUDA_TYPES[getattr(mx, dtype)]
        source = _source(_ENCODE, bits, dim, mode, scale_limit)
        header.append(source.replace("ROW_FN", fn).replace("ROW_T", ctype))
        inputs += [f"x{s}", f"signs{s}", f"thresholds{s}", f"centroids{s}"]
        outputs += [f"codes{s}", f"scale{s}", f"scale16_{s}"]
        body += [
            # Its rows: every axis but the last (MLX hands the array as it is, no reshape).
            f"for (int i = 0; i + 1 < x{s}_ndim; ++i) rows *= (unsigned long long)x{s}_shape[i];",
            "end += rows;",
            f"if (row < end) {{ {fn}(x{s}, row - start, lane, warp, signs{s}, thresholds{s}, "
            f"centroids{s}, codes{s}, scale{s}, scale16_{s}, verdicts + start); return; }}",
            "start = end;",
            "rows = 1;",
        ]
    name = "kvstore_tq_rht_encode_" + "_".join("_".join(map(str, c)) for c in configs)
    return (
        f"{name}_{scale_limit:g}",
        inputs,
        [*outputs, "verdicts"],
        "".join(header),
        "\n".join(body),
    )


@functools.cache
def _encode_kernel(configs: tuple[EncodeConfig, ...], scale_limit: float) -> Any:
    """The kernel of :func:`encode_parts`. Its name says the rows' types: MLX keeps one
    compiled module per kernel name, so each combination of types is named apart."""
    name, inputs, outputs, header, body = encode_parts(configs, scale_limit)
    return cuda_kernel(
        name=name, input_names=inputs, output_names=outputs, source=body, header=header
    )


#: A decode kernel's tensor: ``(bits, head dim, scales' dtype name, output dtype name)``.
DecodeConfig = tuple[int, int, str, str]


def _decode_config(scales: mx.array, q: Quantizer, dtype: mx.Dtype) -> DecodeConfig:
    return (q.bits, q.dim, _name(scales.dtype), _name(dtype))


def decode_parts(configs: Sequence[DecodeConfig]) -> tuple[str, list[str], list[str], str, str]:
    """``(name, input names, output names, header, body)`` of the kernel decoding one
    tensor of each of ``configs``: tensor ``s``'s inputs ``codes<s>`` (``[N, W]``),
    ``factors<s>`` (its scales ``[N]``), ``table<s>`` (the centroids), ``signs<s>``; its
    output ``out<s>`` ``[N, D]``. One warp per row of them all; each tensor's row decode
    is a device function of the header (:data:`_DECODE`), as the encode's are."""
    header, inputs, outputs = [], [], []
    body = [_WARP_ROW]
    for s, (bits, dim, scales, out) in enumerate(configs):
        fn = f"kvstore_tq_decode_row_{s}"
        source = _source(_DECODE, bits, dim, "l2", 0.0).replace("ROW_FN", fn)
        header.append(
            source.replace("SCALE_T", _CUDA_TYPES[getattr(mx, scales)]).replace(
                "OUT_T", _CUDA_TYPES[getattr(mx, out)]
            )
        )
        inputs += [f"codes{s}", f"factors{s}", f"table{s}", f"signs{s}"]
        outputs.append(f"out{s}")
        body += [
            f"end += (unsigned long long)codes{s}_shape[0];",
            f"if (row < end) {{ {fn}(codes{s}, row - start, lane, factors{s}, table{s}, "
            f"signs{s}, out{s}); return; }}",
            "start = end;",
        ]
    name = "kvstore_tq_rht_decode_" + "_".join("_".join(map(str, c)) for c in configs)
    return name, inputs, outputs, "".join(header), "\n".join(body)


@functools.cache
def _decode_kernel(configs: tuple[DecodeConfig, ...]) -> Any:
    """The kernel of :func:`decode_parts` (named by its types, as the encode's)."""
    name, inputs, outputs, header, body = decode_parts(configs)
    return cuda_kernel(
        name=name, input_names=inputs, output_names=outputs, source=body, header=header
    )


def _name(dtype: mx.Dtype) -> str:
    # Looked up: each launch names its tensors' dtypes (str() of one costs ~0.8 us).
    name = _NAMES.get(dtype)
    if name is None:
        name = _NAMES[dtype] = str(dtype).rsplit(".", 1)[-1]
    return name


_NAMES: dict[mx.Dtype, str] = {}


class _Tables:
    """A quantizer's constants in device memory, made once (a fresh ``mx.array`` per
    call is a host-to-device copy per call)."""

    def __init__(self, q: Quantizer) -> None:
        self.signs = mx.array(np.asarray(q.rotation.signs[0], np.float32))
        self.thresholds = mx.array(codebook(q.bits).thresholds.astype(np.float32))
        self.centroids = q.centroids.astype(mx.float32)
        # Quantizers are shared across threads; MLX evaluates a graph only on the
        # thread that built it, so nothing stays lazy here.
        mx.eval(self.signs, self.thresholds, self.centroids)


_TABLES: weakref.WeakKeyDictionary[Any, _Tables] = weakref.WeakKeyDictionary()


def _tables(q: Quantizer) -> _Tables:
    tables = _TABLES.get(q)  # made once: no lock on a launch's way
    if tables is not None:
        return tables
    with _LOCK:
        tables = _TABLES.get(q)
        if tables is None:
            tables = _TABLES[q] = _Tables(q)
        return tables


def _grid(count: int) -> tuple[int, int, int]:
    return (max(1, math.ceil(count * 32 / _BLOCK)) * _BLOCK, 1, 1)


def _encode(
    tensors: Sequence[tuple[mx.array, Quantizer]], scale_limit: float
) -> tuple[list[tuple[mx.array, mx.array, mx.array]], mx.array]:
    """One launch of :func:`_encode_kernel` over ``tensors``' vectors ``x`` ``[..., D]``:
    each one's ``(codes uint32 [..., W], scale float32 [...], scale float16 [...])``, made
    in those shapes (a reshape is a node of the evaluation of its own), and every row's
    verdict ``[sum of rows]``."""
    inputs, shapes, dtypes, total = [], [], [], 0
    for x, q in tensors:
        lead, t = tuple(x.shape[:-1]), _tables(q)
        inputs += [x, t.signs, t.thresholds, t.centroids]
        shapes += [(*lead, packed_words(q.dim, q.bits)), lead, lead]
        dtypes += [mx.uint32, mx.float32, mx.float16]
        total += math.prod(lead)
    kernel = _encode_kernel(tuple(_config(x, q) for x, q in tensors), scale_limit)
    out = kernel(
        inputs=inputs,
        output_shapes=[*shapes, (total,)],
        output_dtypes=[*dtypes, mx.uint8],
        grid=_grid(total),
        threadgroup=(_BLOCK, 1, 1),
    )
    made = [(out[i], out[i + 1], out[i + 2]) for i in range(0, 3 * len(tensors), 3)]
    return made, out[-1]


def _decode(tensors: Sequence[DecodeItem]) -> list[mx.array]:
    """One launch of :func:`_decode_kernel` over ``tensors``: each one's rows ``[N, D]``."""
    inputs, shapes, dtypes, configs, total = [], [], [], [], 0
    for rows, scales, q, dtype in tensors:
        count, t = int(rows.shape[0]), _tables(q)
        # uint32 as the kernel reads them (a no-op for stored codes): the kernel's name
        # does not say the codes' type.
        inputs += [rows.astype(mx.uint32), scales.reshape(-1), t.centroids, t.signs]
        shapes.append((count, q.dim))
        dtypes.append(dtype)
        configs.append(_decode_config(scales, q, dtype))
        total += count
    return list(
        _decode_kernel(tuple(configs))(
            inputs=inputs,
            output_shapes=shapes,
            output_dtypes=dtypes,
            grid=_grid(total),
            threadgroup=(_BLOCK, 1, 1),
        )
    )


_LOCK = threading.RLock()  # a proof makes its quantizer's tables
_PROVEN: dict[tuple[Any, ...], bool] = {}


def _proven(op: str, q: Quantizer, dtype: mx.Dtype, extra: Any) -> bool:
    """Whether kernel ``op`` builds here and agrees with the ops (module docstring) on
    vectors of its own, once per process and kernel: op, width, head dim, and for an
    encode its scale mode, input dtype and scale limit (``extra``), for a decode its
    output dtype and the scales' (``extra``)."""
    mode = q.scale_mode if op == "encode" else ""
    key = (op, q.bits, q.dim, mode, _name(dtype), str(extra))
    return _remembered(key, lambda: _agrees(op, q, dtype, extra))


def _remembered(key: tuple[Any, ...], prove: Callable[[], bool]) -> bool:
    """``prove()`` once per process and ``key`` (a kernel that does not build or run is
    not proven: the ops stay), then what it said: no lock on a launch's way."""
    proven = _PROVEN.get(key)
    if proven is not None:
        return proven
    with _LOCK:
        if key not in _PROVEN:
            try:
                _PROVEN[key] = bool(prove())
            except Exception:  # noqa: BLE001 - a kernel that does not build or run
                _PROVEN[key] = False
        return _PROVEN[key]


def trial_rows(dim: int) -> mx.array:
    """Vectors to prove the kernels on: Gaussian rows at several scales, a zero row,
    a one-hot row and a constant row."""
    rng = np.random.default_rng(dim)
    rows = rng.standard_normal((96, dim)).astype(np.float32)
    rows[:32] *= 1e-3
    rows[32:64] *= 50.0
    rows[64] = 0.0
    rows[65] = 0.0
    rows[65, 3] = 1.0
    rows[66] = 1.0
    return mx.array(rows)


#: A decode's tolerance besides float32's: one ulp of the output dtype, relative.
_ULP = {"float32": 0.0, "bfloat16": 2.0**-7, "float16": 2.0**-10}


def _agrees(op: str, q: Quantizer, dtype: mx.Dtype, extra: Any) -> bool:
    if op == "decode":
        return _decodes_agree([(trial_rows(q.dim), q, dtype, extra)])
    return _encodes_agree([(trial_rows(q.dim).astype(dtype), q)], float(extra))


def _encodes_agree(tensors: Sequence[tuple[mx.array, Quantizer]], scale_limit: float) -> bool:
    """Whether one launch of the encode kernel over ``tensors`` agrees with the ops on
    each (module docstring), its verdicts and float16 scales included."""
    made, verdicts = _encode(tensors, scale_limit)
    start = 0
    for (rows, q), (codes, got_scale, got_scale16) in zip(tensors, made, strict=True):
        count = int(rows.shape[0])
        got_verdicts = verdicts[start : start + count]
        start += count
        idx, scale, norm = q.quantize(rows)  # the ops
        got_idx = unpack_indices(codes, q.bits, q.dim)
        mx.eval(got_idx, got_scale, got_scale16, got_verdicts, idx, scale, norm)
        wide = np.where(np.abs(np.array(scale)) > scale_limit, WIDE_SCALE, FINE)
        want = np.where(np.isfinite(np.array(norm)), wide, NOT_FINITE)
        if not np.array_equal(np.array(got_verdicts), want):
            return False
        # The float16 scales: the kernel's own float32 ones rounded to nearest even, bit
        # for bit.
        rounded = np.array(got_scale).astype(np.float16).view(np.uint16)
        if not np.array_equal(np.array(got_scale16).view(np.uint16), rounded):
            return False
        if not _encode_agrees(
            np.array(rows.astype(mx.float32)),
            np.array(idx).astype(np.int64),
            np.array(scale),
            np.array(norm),
            np.array(got_idx).astype(np.int64),
            np.array(got_scale),
            q,
        ):
            return False
    return True


def _proven_together(group: Sequence[tuple[mx.array, Quantizer]], scale_limit: float) -> bool:
    """Whether the kernel encoding ``group``'s tensors in one launch builds here and
    agrees with the ops on each, once per process and kernel: proven on trial rows of
    each tensor's own, in another order and count per tensor (a row written to another
    tensor's place, or at another's offset, would not agree)."""
    configs = tuple(_config(rows, q) for rows, q in group)

    def prove() -> bool:
        trials = [
            (_trial_rows_of(q.dim, s).astype(rows.dtype), q) for s, (rows, q) in enumerate(group)
        ]
        return _encodes_agree(trials, scale_limit)

    return _remembered(("together", configs, str(scale_limit)), prove)


def _trial_rows_of(dim: int, tensor: int) -> mx.array:
    """:func:`trial_rows`, rolled by 7 rows and 5 fewer for each tensor before it."""
    rows = np.roll(np.array(trial_rows(dim)), 7 * tensor, axis=0)
    return mx.array(rows[: rows.shape[0] - 5 * tensor])


#: A decode's trial: ``(vectors float32 [N, D], quantizer, output dtype, scales' dtype)``.
_DecodeTrial = tuple[mx.array, "Quantizer", mx.Dtype, mx.Dtype]


def _decodes_agree(trials: Sequence[_DecodeTrial]) -> bool:
    """Whether one launch of the decode kernel over ``trials``' vectors, each encoded by
    the ops, agrees with the ops' decode of each: within ``1e-5`` of the largest value,
    and one ulp of a narrower output."""
    made, wanted = [], []
    for rows, q, dtype, scales_dtype in trials:
        if _name(dtype) not in _ULP:
            return False
        idx, scale, _ = q.quantize(rows)
        stored = scale.astype(scales_dtype)
        factors = stored.reshape(-1, 1).astype(mx.float32)
        wanted.append(q.rotation.inverse(mx.take(q.centroids, idx.astype(mx.uint32)) * factors))
        made.append((pack_indices(idx, q.bits), stored, q, dtype))
    got = _decode(made)
    for want, out, (_, _, dtype, _) in zip(wanted, got, trials, strict=True):
        found32 = out.astype(mx.float32)
        mx.eval(want, found32)
        expected, found = np.array(want), np.array(found32)
        top = float(np.abs(expected).max())
        bound = 1e-5 * max(top, 1e-30) + _ULP[_name(dtype)] * np.abs(expected)
        if not (np.abs(found - expected) <= bound).all():
            return False
    return True


def _proven_decode_together(group: Sequence[DecodeItem]) -> bool:
    """Whether the kernel decoding ``group``'s tensors in one launch builds here and
    agrees with the ops on each, once per process and kernel (trial rows of each
    tensor's own, as :func:`_proven_together`'s)."""
    configs = tuple(_decode_config(scales, q, dtype) for _, scales, q, dtype in group)

    def prove() -> bool:
        trials = [
            (_trial_rows_of(q.dim, s), q, dtype, scales.dtype)
            for s, (_, scales, q, dtype) in enumerate(group)
        ]
        return _decodes_agree(trials)

    return _remembered(("decode together", configs), prove)


def _encode_agrees(
    rows: np.ndarray,
    idx: np.ndarray,
    scale: np.ndarray,
    norm: np.ndarray,
    got_idx: np.ndarray,
    got_scale: np.ndarray,
    q: Quantizer,
) -> bool:
    """The encode kernel's proof (module docstring), on numpy copies of both results
    (``norm`` is the ops')."""
    differ = got_idx != idx
    if differ.any():
        if np.abs(got_idx - idx)[differ].max() > 1:
            return False
        # Where they differ, the ops' z must lie within rounding of a threshold.
        rotated = np.array(q.rotation.forward(mx.array(rows)))
        inv = np.where(norm > 0, math.sqrt(q.dim) / np.where(norm > 0, norm, 1), 0)
        z = rotated * inv[:, None]
        thresholds = codebook(q.bits).thresholds.astype(np.float32)
        gap = np.abs(z[..., None] - thresholds).min(axis=-1)
        if (gap[differ] > 1e-5 * np.maximum(1.0, np.abs(z[differ]))).any():
            return False
    agree = ~differ.any(axis=-1)
    return bool(np.allclose(got_scale[agree], scale[agree], rtol=1e-5, atol=1e-30))
