"""TurboQuant-mse v1 encode/decode of vectors along the last axis (spec §"tq v1").

Encode: ``n = ||x||``, ``y = R(x)``, ``z = y * sqrt(D) / n``, each coordinate
quantized to the index of its cell in the unit-variance Lloyd-Max table
(ties to the lower cell), one scale per vector. Decode:
``R^-1(scale * c[idx])``. All arithmetic is float32.

The scale mode only changes the scale, never the decode, so every mode
decodes with one function:

- ``l2``: ``n / sqrt(D)`` (the paper's);
- ``matched``: ``n / ||c[idx]||``, the decoded vector keeps the input's norm;
- ``ls``: ``<y, c[idx]> / ||c[idx]||^2``, the least-squares fit.

Optional key mean-centering encodes ``x - mu`` and adds ``mu`` back on decode
(spec appendix: attention ignores ``q . mu``, so quantizing it only adds error).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import mlx.core as mx
import numpy as np

from kvstore.cpu_streams import evaluated_in_waves, stream_count
from kvstore.errors import EncodingError
from kvstore.turboquant import cuda_decode, cuda_rht
from kvstore.turboquant.codebook import codebook
from kvstore.turboquant.packing import pack_indices, packed_words, unpack_indices
from kvstore.turboquant.rotation import Rotation, rotation_for
from kvstore.turboquant.verdict import FINE, NOT_FINITE, WIDE_SCALE

__all__ = [
    "DEFAULT_SCALE_MODE",
    "FLOAT16_SCALE_LIMIT",
    "SCALE_MODES",
    "TQ_BITS",
    "ScaleMode",
    "TurboQuantizer",
    "bits_per_value",
    "cell_indices",
    "decode_many",
    "encode_many",
    "lookup",
    "quantizer_for",
]

ScaleMode = Literal["l2", "matched", "ls"]
SCALE_MODES: tuple[str, ...] = ("l2", "matched", "ls")
#: The spec's defaults: keys keep their norm, values take the least-squares scale.
DEFAULT_SCALE_MODE: dict[str, ScaleMode] = {"k": "matched", "v": "ls"}
#: Scales beyond this (or non-finite) make the encoder store float32 scales.
FLOAT16_SCALE_LIMIT = 60000.0
#: Bit widths a TurboQuant code may use: the spec's 2 to 4, and 5 (issue 17; the
#: codebook's own table, packed exactly like the others).
TQ_BITS: tuple[int, ...] = (2, 3, 4, 5)
#: On the CPU, encode and decode work on blocks of rows holding about this many values
#: (1 MiB of float32), a block per core at once (cpu_streams): every pass over a block
#: then stays in its core's cache (2 MiB of L2 on the VM), which made a large prefill
#: ~1.7x faster than one pass per op over the whole tensor; with two cores busy,
#: blocks of 2 MiB measured slower than these on half the P11 sizes. On a GPU the
#: whole tensor is one block: there a block's evaluation and its host round trip
#: cost more than the pass (an H200 encoded a 4096-token layer in 7.5 ms in blocks).
BLOCK_VALUES = 1 << 18
#: A CPU encode or decode of fewer values than a block per core still splits into a
#: block per core, down to blocks of this many values: below it, MLX's per-op cost on
#: a second stream outweighs the core (qwen0.5b's 512-token layer, 64K values, encoded
#: 1.5x slower split in two).
MIN_BLOCK_VALUES = 1 << 17


def _row_blocks(rows: int, dim: int) -> list[slice]:
    rows = max(rows, 1)
    if mx.default_device() == mx.gpu:
        return [slice(0, rows)]
    values = rows * dim
    count = max(-(-values // BLOCK_VALUES), min(stream_count(), values // MIN_BLOCK_VALUES))
    step = -(-rows // count)
    return [slice(i, i + step) for i in range(0, rows, step)]


def _compiling(rows: int) -> bool:
    """Whether a block of ``rows`` rows runs its ops compiled.

    On the CPU, where it was measured; elsewhere these ops run only where the CUDA
    kernels cannot, and a GPU's compiled kernels are built by a JIT whose cost per new
    shape was not. And for a power-of-two row count only: MLX keeps a compiled trace per
    input shape for the process's life, and a server's prompts would otherwise leave one
    per remainder; powers of two cover full blocks, a 256-token record of 1-16 heads and
    a decode step's batch x heads, at ~12 traces a function.
    """
    return mx.default_device() == mx.cpu and rows > 0 and rows & (rows - 1) == 0


def _join(parts: list[mx.array]) -> mx.array:
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)


def bits_per_value(bits: int, dim: int, scale_bytes: int = 2) -> float:
    """Stored bits per value: the packed words plus one scale per vector (b + 16/D
    for float16 scales and exact packing)."""
    return (packed_words(dim, bits) * 32 + 8 * scale_bytes) / dim


@functools.cache
def _cell_kernel(thresholds: tuple[float, ...]) -> Callable[[mx.array, mx.array], mx.array]:
    def cells(y: mx.array, inv: mx.array) -> mx.array:
        z = y * inv
        # #{k : t_k < z}: strict, so a tie lands in the lower cell. Unrolled
        # compares fuse into one pass under mx.compile (a gather per element is slower).
        idx = (z > thresholds[0]).astype(mx.uint8)
        for t in thresholds[1:]:
            idx = idx + (z > t).astype(mx.uint8)
        return idx

    return mx.compile(cells, shapeless=True)


@functools.cache
def _mirrored_cell_kernel(
    thresholds: tuple[float, ...],
) -> Callable[[mx.array, mx.array], mx.array]:
    """The cells of :func:`_cell_kernel` with half the compares, for a table whose
    thresholds are mirrored about a middle 0 (every Lloyd-Max table for the Gaussian
    is, exactly in float32; :func:`cell_indices` checks).

    With ``H`` cells on each side and ``p_j`` the positive thresholds: ``z > 0`` lies in
    cell ``H + #{p_j < |z|}``; ``z <= 0`` in ``H - 1 - #{p_j <= |z|}`` (``t < z`` is
    ``p > |z|`` there). Both counts compare the bits of ``|z|`` as an int32 (ordered as
    the non-negative floats are), ``<=`` being ``<`` after adding one to ``|z|``'s bits.
    """
    middle = len(thresholds) // 2
    positive = np.array(thresholds[middle + 1 :], np.float32).view(np.int32).tolist()
    half = middle + 1

    def cells(y: mx.array, inv: mx.array) -> mx.array:
        z = y * inv
        low = z <= 0
        bits = mx.view(mx.abs(z), mx.int32) + low.astype(mx.int32)
        count = (bits > positive[0]).astype(mx.uint8)
        for p in positive[1:]:
            count = count + (bits > p).astype(mx.uint8)
        return mx.where(low, half - 1 - count, half + count).astype(mx.uint8)

    # Not shapeless: MLX cannot trace a view's shape without one (a new shape only
    # retraces, ~0.3 ms; the fused kernel is kept).
    return mx.compile(cells)


#: Widths whose cells use the mirrored count (a 4096x128 block, one scale per row, on
#: the 2-core VM): 4 bits 1.82 -> 1.17 ms, 3 bits 0.85 -> 0.83 ms; at 2 bits (one
#: compare saved) and 5 (3.4 -> 4.8 ms with one scale) it does not pay.
MIRRORED_BITS = (3, 4)


def cell_indices(z: mx.array, bits: int, scale: mx.array | float = 1.0) -> mx.array:
    """The cell of each coordinate ``z * scale`` in the unit-variance ``bits`` table
    (uint8): ``#{k : t_k < z * scale}``, ties to the lower cell."""
    thresholds = codebook(bits).thresholds.astype(np.float32)
    key = tuple(float(t) for t in thresholds)
    mirrored = bits in MIRRORED_BITS and np.array_equal(thresholds, -thresholds[::-1])
    kernel = _mirrored_cell_kernel(key) if mirrored else _cell_kernel(key)
    return kernel(z, mx.array(scale, mx.float32))


def lookup(table: mx.array, idx: mx.array) -> mx.array:
    """``table[idx]`` elementwise for a small 1-D ``table``.

    ``take_along_axis`` over a broadcast table is ~10x faster on CPU than
    ``mx.take`` with the same result.
    """
    rows = mx.broadcast_to(table, (*idx.shape[:-1], table.shape[0]))
    return mx.take_along_axis(rows, idx, axis=-1)


class TurboQuantizer:
    """Encodes and decodes ``[..., D]`` vectors of one kind (keys or values).

    Args:
        bits: index width, one of :data:`TQ_BITS` (2 to 5).
        dim: the vector length D (head_dim).
        kind: ``"k"`` or ``"v"``; selects the rotation's sign stream and the
            default scale mode.
        seed: the rotation seed (uint64).
        rounds: RHT rounds, 1 or 2 (power-of-two D only).
        scale_mode: ``"l2"``, ``"matched"`` or ``"ls"``; the kind's default if None.
        rotation: a stored rotation to use instead of generating one (a reader's path).
        scale_dtype: ``"float16"`` (spec default; float32 anyway when a scale
            needs it) or ``"float32"`` (always).

    Raises:
        ValueError: a parameter outside the values above.
    """

    def __init__(
        self,
        bits: int,
        dim: int,
        kind: str = "k",
        seed: int = 0,
        rounds: int = 1,
        scale_mode: ScaleMode | None = None,
        rotation: Rotation | None = None,
        scale_dtype: str = "float16",
    ) -> None:
        if bits not in TQ_BITS:
            raise ValueError(
                f"[turboquant] bits must be one of {', '.join(map(str, TQ_BITS))}; "
                f"received {bits!r}."
            )
        mode = DEFAULT_SCALE_MODE.get(kind, "l2") if scale_mode is None else scale_mode
        if mode not in SCALE_MODES:
            raise ValueError(
                f"[turboquant] scale_mode must be one of {', '.join(SCALE_MODES)}; "
                f"received {scale_mode!r}."
            )
        self.rotation = rotation if rotation is not None else rotation_for(dim, kind, seed, rounds)
        if self.rotation.dim != dim:
            raise ValueError(
                f"[turboquant] the rotation is for D={self.rotation.dim}; received dim {dim}."
            )
        self.bits, self.dim, self.kind, self.seed = bits, dim, kind, seed
        self.scale_mode: ScaleMode = mode
        if scale_dtype not in ("float16", "float32"):
            raise ValueError(
                f"[turboquant] scale_dtype must be 'float16' or 'float32'; "
                f"received {scale_dtype!r}."
            )
        self.scale_dtype = scale_dtype
        table = codebook(bits)
        self.centroids = mx.array(table.centroids.astype(np.float32))
        self.squared_centroids = self.centroids * self.centroids
        # Quantizers are shared across threads (quantizer_for caches them, a writer thread
        # may build one first); MLX evaluates a graph only on the thread that built it.
        mx.eval(self.squared_centroids)
        self.words = packed_words(dim, bits)

    def __repr__(self) -> str:
        return (
            f"TurboQuantizer(bits={self.bits}, dim={self.dim}, kind={self.kind!r}, "
            f"scale_mode={self.scale_mode!r}, rotation={self.rotation.method})"
        )

    # -- encode ------------------------------------------------------------------
    def quantize(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """The lazy core of :meth:`encode`: ``(idx uint8 [..., D], scale [...], norm [...])``
        in float32.

        No checks and no rounding of the scale; callers that store the result
        go through :meth:`encode`.
        """
        x = x.astype(mx.float32)
        n = mx.sqrt((x * x).sum(axis=-1, keepdims=True))
        y = self.rotation.forward(x)
        inv = mx.where(n > 0, math.sqrt(self.dim) / mx.where(n > 0, n, 1), 0)
        idx = cell_indices(y, self.bits, inv)  # z = y * sqrt(D) / n, fused into the compares
        n = n[..., 0]
        if self.scale_mode == "l2":
            return idx, n / math.sqrt(self.dim), n
        if self.scale_mode == "matched":
            return idx, n / mx.sqrt(lookup(self.squared_centroids, idx).sum(axis=-1)), n
        c = lookup(self.centroids, idx)
        return idx, (y * c).sum(axis=-1) / (c * c).sum(axis=-1), n

    def encode(self, x: mx.array, mu: mx.array | None = None) -> tuple[mx.array, mx.array]:
        """``(codes uint32 [..., W], scales [...])`` for vectors ``x [..., D]``.

        Scales are float16 unless one exceeds :data:`FLOAT16_SCALE_LIMIT` in
        magnitude or is not finite (or ``scale_dtype`` is float32); then all are
        float32. ``mu`` (broadcastable to ``x``) is subtracted first (key
        mean-centering). :func:`encode_many` encodes several tensors at once.

        Raises:
            EncodingError: ``x`` has NaN or Inf (seen as a non-finite norm, which
                also catches float32 overflow), or its last axis is not D.
        """
        return encode_many([(self, x, mu)])[0]

    def _block_encoded(self, rows: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """``(codes, scale float32, scale float16, verdict)`` of ``rows [N, D]``, lazily
        (the worst :mod:`~kvstore.turboquant.verdict` of its rows, an integer scalar)."""
        # One kernel on a CUDA GPU unless switched off, once proven (cuda_rht).
        fused = cuda_rht.encoded(rows, self, FLOAT16_SCALE_LIMIT)
        if fused is None:
            ops = self._compiled_ops_encode if _compiling(rows.shape[0]) else self._ops_encoded
            return ops(rows)
        return fused

    def _ops_encoded(self, rows: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        idx, scale, norm = self.quantize(rows)
        # Each row's verdict as the CUDA kernel writes it, then the worst.
        wide = mx.where(mx.abs(scale) > FLOAT16_SCALE_LIMIT, WIDE_SCALE, FINE)
        verdict = mx.where(mx.isfinite(norm), wide, NOT_FINITE).max()
        # The float16 scales too, with the block: what is stored unless a check says
        # otherwise (no pass after the blocks; on a small layer that pass and its
        # evaluation cost more than the rounding).
        return pack_indices(idx, self.bits), scale, scale.astype(mx.float16), verdict

    @functools.cached_property
    def _compiled_ops_encode(self) -> Callable[[mx.array], Any]:
        # Compiled, a block's ~60 ops become fewer, fused kernels: MLX's CPU cost per op
        # (~10-20 us to dispatch) dominated small blocks. On the 2-core VM one 4-bit block
        # of keys: 8 rows 265 -> 96 us, 256 rows 915 -> 601 us, 2048 rows 3.35 -> 2.94 ms.
        # Not shapeless (the cell search's bit view cannot be): a new row count retraces.
        return mx.compile(self._ops_encoded)

    # -- decode ------------------------------------------------------------------
    def decode(
        self,
        codes: mx.array,
        scales: mx.array,
        dtype: mx.Dtype = mx.float32,
        mu: mx.array | None = None,
    ) -> mx.array:
        """``R^-1(scale * c[idx]) (+ mu)`` in float32, cast to ``dtype``: ``[..., D]``.

        Raises:
            EncodingError: ``codes`` is not ``[..., W]`` for this D and bits.
        """
        self._check_codes(codes, scales)
        lead = codes.shape[:-1]
        rows = codes.reshape(-1, self.words)
        # The whole decode as one kernel on a CUDA GPU, once proven (cuda_rht).
        fused = cuda_rht.decoded(rows, scales, self, dtype if mu is None else mx.float32)
        if fused is not None:
            return _decoded_as(fused, lead, dtype, mu)
        flat_scales = scales.reshape(-1)

        def decoded(b: slice) -> mx.array:
            codes, factors = rows[b], flat_scales[b, None].astype(mx.float32)
            # One kernel on a CUDA GPU unless switched off, once proven (cuda_decode).
            y = cuda_decode.decoded(codes, factors, self.centroids, self.bits, self.dim)
            if y is not None:
                return self.rotation.inverse(y)
            compiled = _compiling(codes.shape[0])
            return (self._compiled_ops_decode if compiled else self._ops_decoded)(codes, factors)

        blocks = _row_blocks(rows.shape[0], self.dim)
        # Small decodes stay lazy; larger ones finish each cache-sized block, a block
        # per core on the CPU (cpu_streams).
        parts = [decoded(blocks[0])] if len(blocks) == 1 else evaluated_in_waves(blocks, decoded)
        x = _join(parts).reshape(*lead, self.dim)
        if mu is not None:
            x = x + mu
        return x.astype(dtype)

    def _check_codes(self, codes: mx.array, scales: mx.array) -> None:
        if codes.shape[-1] != self.words or codes.shape[:-1] != scales.shape:
            raise EncodingError(
                f"[turboquant.decode] codes must be [..., {self.words}] uint32 with scales "
                f"matching their leading axes (D={self.dim}, bits={self.bits}); received codes "
                f"{tuple(codes.shape)}, scales {tuple(scales.shape)}.",
                codes_shape=tuple(codes.shape),
                scales_shape=tuple(scales.shape),
            )

    def _ops_decoded(self, codes: mx.array, factors: mx.array) -> mx.array:
        y = lookup(self.centroids, unpack_indices(codes, self.bits, self.dim))
        return self.rotation.inverse(y * factors)

    @functools.cached_property
    def _compiled_ops_decode(self) -> Callable[[mx.array, mx.array], Any]:
        # As the encode's: fewer, fused kernels for a block's ops.
        return mx.compile(self._ops_decoded)

    def _check_dim(self, dim: int, op: str) -> None:
        if dim != self.dim:
            raise EncodingError(
                f"[turboquant.{op}] vectors must have D={self.dim} (this quantizer's head_dim); "
                f"received {dim}. Build a TurboQuantizer for D={dim}.",
                found=dim,
                expected=self.dim,
            )


def encode_many(
    items: Sequence[tuple[TurboQuantizer, mx.array, mx.array | None]],
) -> list[tuple[mx.array, mx.array]]:
    """:meth:`TurboQuantizer.encode` of each ``(quantizer, x, mu)``, done together: on a
    CUDA GPU a layer's keys and values in one kernel launch (:func:`cuda_rht.encoded_together`),
    elsewhere the blocks of every tensor sharing the waves (on the CPU a core each, so a
    layer's keys and values too small to split run side by side); one evaluation in all
    on a GPU, one per wave on the CPU, where encoding them one by one waits for each (on
    a GPU a host round trip per tensor).

    Raises:
        EncodingError: as :meth:`TurboQuantizer.encode`, for the first tensor at fault.
    """
    tensors: list[_Tensor] = []
    for q, x, mu in items:
        q._check_dim(x.shape[-1], "encode")
        if mu is not None:
            x = x.astype(mx.float32) - mu
        tensors.append((q, tuple(x.shape), x))
    encoded = _encoded_together(tensors) or _encoded_in_blocks(tensors)
    out = []
    for (q, shape, _), (codes, scale, scale16, worst) in zip(tensors, encoded, strict=True):
        if worst == NOT_FINITE:
            raise EncodingError(
                f"[turboquant.encode] {q.kind} vectors must be finite; received NaN or Inf "
                f"(or a norm beyond float32) in a {shape} tensor. Find where the "
                f"model produced it; TurboQuant cannot encode it.",
                shape=shape,
            )
        wide_scale = q.scale_dtype == "float32" or worst == WIDE_SCALE
        out.append((codes, scale if wide_scale else scale16))
    return out


def decode_many(
    items: Sequence[tuple[TurboQuantizer, mx.array, mx.array, mx.Dtype, mx.array | None]],
) -> list[mx.array]:
    """:meth:`TurboQuantizer.decode` of each ``(quantizer, codes, scales, dtype, mu)``:
    on a CUDA GPU a layer's keys and values in one kernel launch
    (:func:`cuda_rht.decoded_together`), elsewhere one by one. Lazy, as ``decode``.

    Raises:
        EncodingError: as :meth:`TurboQuantizer.decode`, for the first tensor at fault.
    """
    for q, codes, scales, _, _ in items:
        q._check_codes(codes, scales)
    fused = cuda_rht.decoded_together(
        [
            (codes.reshape(-1, q.words), scales, q, dtype if mu is None else mx.float32)
            for q, codes, scales, dtype, mu in items
        ]
    )
    if fused is None:
        return [q.decode(codes, scales, dtype, mu=mu) for q, codes, scales, dtype, mu in items]
    return [
        _decoded_as(x, codes.shape[:-1], dtype, mu)
        for x, (_, codes, _, dtype, mu) in zip(fused, items, strict=True)
    ]


def _decoded_as(
    rows: mx.array, lead: Sequence[int], dtype: mx.Dtype, mu: mx.array | None
) -> mx.array:
    """A kernel's decoded ``rows`` ``[N, D]`` in the codes' leading axes, ``mu`` added
    (the kernel decoded to float32 then) and cast to ``dtype``."""
    x = rows.reshape(*lead, rows.shape[-1])
    return x if mu is None else (x + mu).astype(dtype)


#: A tensor to encode: ``(quantizer, its shape, its vectors [..., D])``.
_Tensor = tuple[TurboQuantizer, tuple[int, ...], mx.array]
#: A tensor encoded and evaluated: ``(codes, scale float32, scale float16, its verdict)``,
#: each array shaped as the tensor's leading axes.
_Encoded = tuple[mx.array, mx.array, mx.array, int]


def _encoded_together(tensors: list[_Tensor]) -> list[_Encoded] | None:
    """Every tensor encoded by :func:`cuda_rht.encoded_together` (a CUDA GPU's kernels,
    a launch per layer's keys and values), evaluated at once, the verdict of them all read
    back (per tensor only when it is not fine); ``None`` where the kernels are not used."""
    together = cuda_rht.encoded_together([(x, q) for q, _, x in tensors], FLOAT16_SCALE_LIMIT)
    if together is None:
        return None
    made, verdicts = together  # made in the tensors' shapes
    worst = mx.max(verdicts)
    mx.eval(made, worst)
    if worst.item() == FINE:
        return [(*arrays, FINE) for arrays in made]
    each, start = np.array(verdicts), 0  # a rare case: which tensor is it?
    out = []
    for (_, shape, _), arrays in zip(tensors, made, strict=True):
        count = math.prod(shape[:-1])
        out.append((*arrays, int(each[start : start + count].max())))
        start += count
    return out


def _encoded_in_blocks(tensors: list[_Tensor]) -> list[_Encoded]:
    """Every tensor encoded block by block (:func:`_row_blocks`), the blocks of all of
    them sharing :func:`evaluated_in_waves`."""
    jobs, blocks = [], []
    for q, shape, x in tensors:
        rows = x.reshape(-1, q.dim)
        slices = _row_blocks(rows.shape[0], q.dim)
        # A tensor of one block gets its final shapes in the evaluation: a reshape after
        # it would be an evaluation of its own for the caller (on a GPU a host round trip).
        whole = shape[:-1] if len(slices) == 1 else None
        jobs.append((q, shape, len(slices)))
        blocks += [(q, rows, b, whole) for b in slices]
    encoded_blocks, verdicts = _encoded(blocks)
    done = iter(zip(encoded_blocks, verdicts))
    out: list[_Encoded] = []
    for q, shape, count in jobs:
        encoded = [next(done) for _ in range(count)]
        codes, scale, scale16 = (_join([block[k] for block, _ in encoded]) for k in range(3))
        if count > 1:
            lead = shape[:-1]
            codes = codes.reshape(*lead, q.words)
            scale, scale16 = scale.reshape(lead), scale16.reshape(lead)
        out.append((codes, scale, scale16, max(verdict for _, verdict in encoded)))
    return out


#: ``(quantizer, rows, the block's slice of them, its tensor's leading axes or None)``.
_Block = tuple[TurboQuantizer, mx.array, slice, "tuple[int, ...] | None"]


def _encoded_block(block: _Block) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """A block's ``(codes, scale float32, scale float16, verdict)``, lazily; shaped as
    its tensor's leading axes where the block is the whole tensor."""
    q, rows, b, whole = block
    # Sliced here, on the block's own stream, as every op of the block is (a block of
    # every row is the rows: a slice of them all would be one more node to evaluate).
    codes, scale, scale16, verdict = q._block_encoded(rows if whole is not None else rows[b])
    if whole is None:
        return codes, scale, scale16, verdict
    return codes.reshape(*whole, q.words), scale.reshape(whole), scale16.reshape(whole), verdict


def _encoded(blocks: list[_Block]) -> tuple[list[Any], list[Any]]:
    """Every block encoded and evaluated (on the CPU a wave at a time: its passes stay in
    cache; on a GPU all at once, one host round trip), and each block's verdict read back
    (it decides the error and the scale dtype). Reading an evaluated byte costs ~0.6 us
    on an H200 (``tools/bench/gpu/floor_probe.py``): no need to join them."""
    done = evaluated_in_waves(blocks, _encoded_block)
    return done, [int(block[3].item()) for block in done]


@functools.lru_cache(maxsize=128)
def quantizer_for(
    bits: int,
    dim: int,
    kind: str = "k",
    seed: int = 0,
    scale_mode: ScaleMode | None = None,
    rotation: Rotation | None = None,
) -> TurboQuantizer:
    """A shared :class:`TurboQuantizer` (they are immutable; one per configuration).

    ``rotation`` (compared by identity) replaces the seed's one-round rotation."""
    return TurboQuantizer(bits, dim, kind=kind, seed=seed, scale_mode=scale_mode, rotation=rotation)
