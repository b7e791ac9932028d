"""``kv:turboquant:{kbits}:{vbits}`` and ``kv:rotating-turboquant:{kbits}:{vbits}``.

Keys and values are held TurboQuant-encoded (``specs/turboquant.md``): packed
uint32 codes ``[B, H, T, ceil(D*b/32)]`` and one scale per vector. Attention
gets decoded rows in the cache's dtype through plain SDPA (dequant-on-fetch):
the classes deliberately have no ``bits``/``group_size``, which would make
mlx-lm route them into affine attention.

Each row tree is ``(codes, scales [B, H, T, 1], decoded [B, H, T, D])``: the
decoded rows ride along in the same tree, so the growing buffer and the ring
(grow, trim, wrap, temporal reordering) move them in step with the codes,
and each update decodes only the rows it adds. Only codes and scales count as
stored bytes; ``state`` carries them (scales as ``[B, H, T]``) and
``from_state`` rebuilds the decoded rows from them.
"""

from __future__ import annotations

from typing import Any, ClassVar

import mlx.core as mx

from kvstore.caches.base import GrowingKVCache, Tree, row_leaves
from kvstore.caches.rotating import RingKVCache
from kvstore.family import Family, ParamSpec
from kvstore.turboquant.quantizer import (
    DEFAULT_SCALE_MODE,
    SCALE_MODES,
    TQ_BITS,
    ScaleMode,
    TurboQuantizer,
    decode_many,
    encode_many,
    quantizer_for,
)
from kvstore.turboquant.rotation import Rotation, rotation_for

__all__ = [
    "TURBOQUANT_FAMILY",
    "ROTATING_TURBOQUANT_FAMILY",
    "CENTER_PREFIX_TOKENS",
    "RotatingTurboQuantKVCache",
    "TurboQuantKVCache",
    "TurboQuantRows",
    "stored_rows",
]

#: Key mean-centering estimates mu from at most this many prefill tokens (spec option).
CENTER_PREFIX_TOKENS = 512

_TQ_PARAMS = (ParamSpec("kbits", TQ_BITS), ParamSpec("vbits", TQ_BITS))

TURBOQUANT_FAMILY = Family(
    kind="kv:turboquant",
    description="TurboQuant rows (rotation + Lloyd-Max codes, one scale per vector), growing",
    params=_TQ_PARAMS,
    lossy=True,
    storage_policy=True,
    factory=lambda sig, window, keep: TurboQuantKVCache(sig.param("kbits"), sig.param("vbits")),
)

ROTATING_TURBOQUANT_FAMILY = Family(
    kind="kv:rotating-turboquant",
    description="TurboQuant rows in a sliding window",
    params=_TQ_PARAMS,
    window_of=TURBOQUANT_FAMILY.kind,
    lossy=True,
    factory=lambda sig, window, keep: RotatingTurboQuantKVCache(
        window, keep, kbits=sig.param("kbits"), vbits=sig.param("vbits")
    ),
)


class TurboQuantRows:
    """Row encoding shared by the growing and the windowed TurboQuant caches."""

    family: ClassVar[Family] = TURBOQUANT_FAMILY
    keys: Tree | None
    values: Tree | None
    kbits: int
    vbits: int
    seed: int
    key_scale_mode: ScaleMode
    value_scale_mode: ScaleMode
    center: bool
    mu: mx.array | None
    head_dim: int | None
    rounds: int
    _rotations: dict[str, Rotation] | None
    _dtype_name: str | None  # a name, not an mx.Dtype: those cannot be deep-copied

    def _init_tq(
        self,
        kbits: int,
        vbits: int,
        seed: int = 0,
        key_scale_mode: ScaleMode = DEFAULT_SCALE_MODE["k"],
        value_scale_mode: ScaleMode = DEFAULT_SCALE_MODE["v"],
        center: bool = False,
        mu: mx.array | None = None,
        dtype_name: str | None = None,
        head_dim: int | None = None,
        rounds: int = 1,
    ) -> None:
        self.family.check((kbits, vbits))  # ValueError naming the allowed values
        if rounds not in (1, 2):
            raise ValueError(f"[{self.kind}] rounds must be 1 or 2; received {rounds!r}.")
        for name, mode in (
            ("key_scale_mode", key_scale_mode),
            ("value_scale_mode", value_scale_mode),
        ):
            if mode not in SCALE_MODES:
                raise ValueError(
                    f"[{self.kind}] {name} must be one of {', '.join(SCALE_MODES)}; "
                    f"received {mode!r}."
                )
        if not (isinstance(seed, int) and 0 <= seed < 1 << 64):
            raise ValueError(f"[{self.kind}] seed must be a uint64 int; received {seed!r}.")
        self.kbits, self.vbits, self.seed = kbits, vbits, seed
        self.key_scale_mode, self.value_scale_mode = key_scale_mode, value_scale_mode
        self.center = bool(center or mu is not None)
        self.mu = mu
        self._dtype_name = dtype_name
        self.head_dim = head_dim
        self.rounds = rounds
        self._rotations = None

    @property
    def kind(self) -> str:
        return self.family.kind

    def signature(self) -> str:
        return f"{self.family.kind}:{self.kbits}:{self.vbits}"

    @property
    def dtype(self) -> mx.Dtype | None:
        """The dtype of the rows attention gets (the model's), once known."""
        return None if self._dtype_name is None else getattr(mx, self._dtype_name)

    def rotation(self, kind: str, head_dim: int) -> Rotation:
        """The rotation of keys (``kind="k"``) or values (``"v"``) at ``head_dim``:
        the stored one after :meth:`use_rotations`, else the seed's."""
        if self._rotations is not None:
            return self._rotations[kind]
        return rotation_for(head_dim, kind, self.seed, self.rounds)

    def use_rotations(self, keys: Rotation, values: Rotation) -> None:
        """Decode and encode with these rotations instead of the seed's (a reader's
        path: the spec makes a stored dense matrix normative, never a regenerated one).

        Raises:
            ValueError: the two rotations differ in dimension.
        """
        if keys.dim != values.dim:
            raise ValueError(
                f"[{self.kind}] key and value rotations must have one dimension; "
                f"received {keys.dim} and {values.dim}."
            )
        self._rotations = {"k": keys, "v": values}

    def quantizers(self, head_dim: int) -> tuple[TurboQuantizer, TurboQuantizer]:
        """The key and value quantizers this cache uses at ``head_dim``."""
        return (
            quantizer_for(
                self.kbits,
                head_dim,
                "k",
                self.seed,
                self.key_scale_mode,
                rotation=self.rotation("k", head_dim),
            ),
            quantizer_for(
                self.vbits,
                head_dim,
                "v",
                self.seed,
                self.value_scale_mode,
                rotation=self.rotation("v", head_dim),
            ),
        )

    # -- the hooks of the buffer/ring arithmetic ---------------------------------------
    def _encode_pair(self, keys: mx.array, values: mx.array) -> tuple[Tree, Tree]:
        if self._dtype_name is None:
            self._dtype_name = str(keys.dtype).removeprefix("mlx.core.")
            self.head_dim = keys.shape[-1]
        dtype = self.dtype
        assert dtype is not None
        if self.center and self.mu is None:
            head = keys[..., :CENTER_PREFIX_TOKENS, :].astype(mx.float32)
            self.mu = head.mean(axis=(0, 2))  # [H, D]
        kq, vq = self.quantizers(keys.shape[-1])
        mu = None if self.mu is None else self.mu[:, None, :]
        # Together: one evaluation (on a GPU, one host round trip) for both sides.
        stored_keys, stored_values = encode_many([(kq, keys, mu), (vq, values, None)])
        new_keys, new_values = _with_decoded((kq, vq), (stored_keys, stored_values), dtype, mu)
        if self.keys is not None:
            self.keys, new_keys = _same_scale_dtype(self.keys, new_keys)
            self.values, new_values = _same_scale_dtype(self.values, new_values)
        return new_keys, new_values

    def _present(self, keys: Tree, values: Tree) -> tuple[mx.array, mx.array]:
        return keys[2], values[2]

    # -- what is stored --------------------------------------------------------------
    def encoded_rows(self) -> tuple[tuple[mx.array, mx.array], tuple[mx.array, mx.array]]:
        """``((codes, scales), (codes, scales))`` for keys and values, the whole
        buffer (capacity padding and ring order included), scales ``[B, H, T]``."""
        assert self.keys is not None and self.values is not None
        return stored_rows(self.keys), stored_rows(self.values)

    @property
    def nbytes(self) -> int:
        """Encoded bytes allocated (codes and scales), capacity padding included."""
        if self.keys is None:
            return 0
        return sum(leaf.nbytes for leaf in row_leaves(self.encoded_rows()))

    def bytes_per_token(self) -> int:
        """Encoded bytes one more token costs: ``(b + 16/D) * D / 8`` per head and
        kind with float16 scales. The decoded rows are a working copy, not storage."""
        if self.keys is None:
            return 0
        return sum(leaf.nbytes // leaf.shape[2] for leaf in row_leaves(self.encoded_rows()))

    def _options(self) -> tuple[Any, ...]:
        return (
            self.kbits,
            self.vbits,
            self.seed,
            self.key_scale_mode,
            self.value_scale_mode,
            self.center,
            self._dtype_name,
            self.head_dim,
            self.mu,
            self.rounds,
        )

    def _restore(self, keys: Any, values: Any, options: tuple[Any, ...]) -> None:
        kbits, vbits, seed, kmode, vmode, center, dtype, head_dim, mu, rounds = options
        self._init_tq(
            int(kbits),
            int(vbits),
            int(seed),
            kmode,
            vmode,
            bool(center),
            mu=mu,
            dtype_name=dtype,
            head_dim=None if head_dim is None else int(head_dim),
            rounds=int(rounds),
        )
        self.keys = self.values = None
        if keys is not None:
            assert self.head_dim is not None
            self._hold(keys, values)

    def load_encoded(
        self,
        keys: tuple[mx.array, mx.array],
        values: tuple[mx.array, mx.array],
        *,
        dtype_name: str,
        head_dim: int,
        mu: mx.array | None = None,
        rotations: tuple[Rotation, Rotation] | None = None,
        rows: int | None = None,
    ) -> None:
        """Hold stored ``(codes, scales [B, H, T])`` key and value rows (a reader's path).

        The rows must have been encoded with this cache's bits and scale modes,
        ``rotations`` (default: the seed's) and key mean ``mu``. Only the first
        ``rows`` buffer rows (default: all) are decoded for attention; the rest of
        the buffer is capacity, decoded as zeros.
        """
        self._dtype_name, self.head_dim = dtype_name, head_dim
        self.mu, self.center = mu, self.center or mu is not None
        if rotations is not None:
            self.use_rotations(*rotations)
        self._hold(keys, values, rows)

    def _hold(self, keys: Any, values: Any, rows: int | None = None) -> None:
        dtype = self.dtype
        assert dtype is not None and self.head_dim is not None
        kq, vq = self.quantizers(self.head_dim)
        mu = None if self.mu is None else self.mu[:, None, :]
        self.keys, self.values = _with_decoded((kq, vq), (keys, values), dtype, mu, rows)


def _with_decoded(
    quantizers: tuple[TurboQuantizer, TurboQuantizer],
    stored: tuple[Any, Any],
    dtype: mx.Dtype,
    mu: mx.array | None,
    rows: int | None = None,
) -> tuple[Tree, Tree]:
    """The key and value row trees ``(codes, scales [B, H, T, 1], decoded)`` of stored
    ``(codes, scales)`` keys and values, decoded together (:func:`decode_many`: on a CUDA
    GPU one launch); only the first ``rows`` buffer rows are decoded, the rest zeros."""
    total = stored[0][0].shape[2]
    held = None if rows is None or rows >= total else rows
    wanted = stored if held is None else [(c[:, :, :held], s[:, :, :held]) for c, s in stored]
    decoded = decode_many(
        [
            (q, codes, scales, dtype, m)
            for q, (codes, scales), m in zip(quantizers, wanted, (mu, None), strict=True)
        ]
    )
    out = []
    for (codes, scales), x in zip(stored, decoded, strict=True):
        if held is not None:
            pad = mx.zeros((*x.shape[:2], total - held, x.shape[3]), dtype)
            x = mx.concatenate([x, pad], axis=2)
        out.append((codes, scales[..., None], x))
    return out[0], out[1]


def stored_rows(tree: Tree) -> tuple[mx.array, mx.array]:
    """The stored part of a TurboQuant row tree: ``(codes, scales [B, H, T])``."""
    codes, scales, _ = tree
    return codes, scales[..., 0]


def _same_scale_dtype(stored: Tree, new: Tree) -> tuple[Tree, Tree]:
    """Widen float16 scales to float32 on whichever side has them, so a chunk whose
    scales needed float32 never gets squeezed into a float16 buffer."""
    if stored[1].dtype == new[1].dtype:
        return stored, new
    widen = lambda t: (t[0], t[1].astype(mx.float32), t[2])  # noqa: E731
    return widen(stored), widen(new)


class TurboQuantKVCache(TurboQuantRows, GrowingKVCache):
    """TurboQuant-encoded rows growing in steps of 256; attention gets decoded rows.

    Args:
        kbits: key index width (2 to 5).
        vbits: value index width (2 to 5).
        seed: rotation seed (uint64); sign vectors per spec SplitMix64.
        key_scale_mode: ``"matched"`` (spec default), ``"l2"`` or ``"ls"``.
        value_scale_mode: ``"ls"`` (spec default), ``"l2"`` or ``"matched"``.
        center: subtract a per-head key mean estimated from the first
            :data:`CENTER_PREFIX_TOKENS` prefill tokens (spec option ``center``).
        rounds: RHT rounds, 1 (spec default) or 2 (power-of-two head_dim; a
            dense rotation has no rounds).

    Raises:
        ValueError: a parameter outside the values above.
    """

    def __init__(
        self,
        kbits: int,
        vbits: int,
        seed: int = 0,
        key_scale_mode: ScaleMode = DEFAULT_SCALE_MODE["k"],
        value_scale_mode: ScaleMode = DEFAULT_SCALE_MODE["v"],
        center: bool = False,
        rounds: int = 1,
    ) -> None:
        GrowingKVCache.__init__(self)
        self._init_tq(kbits, vbits, seed, key_scale_mode, value_scale_mode, center, rounds=rounds)

    @property
    def state(self) -> tuple[Any, ...]:
        """``(keys, values, offset, kbits, vbits, seed, key_scale_mode,
        value_scale_mode, center, dtype, head_dim, mu, rounds)``; keys/values are
        ``(codes, scales)``, dtype a name (``"bfloat16"``), mu the key mean or None.
        Rotations are regenerated from seed and rounds (a stored dense matrix set by
        :meth:`use_rotations` is not part of it)."""
        stored = (None, None) if self.keys is None else self.encoded_rows()
        return (*stored, self.offset, *self._options())

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        keys, values, self.offset, *options = v
        self._restore(keys, values, tuple(options))


class RotatingTurboQuantKVCache(TurboQuantRows, RingKVCache):
    """TurboQuant-encoded rows in a sliding window with ``keep`` sink tokens.

    Args are those of :class:`TurboQuantKVCache` plus the ring's ``max_size``
    (window) and ``keep`` (sink tokens never evicted).
    """

    family = ROTATING_TURBOQUANT_FAMILY

    def __init__(
        self,
        max_size: int,
        keep: int = 0,
        kbits: int = 4,
        vbits: int = 4,
        seed: int = 0,
        key_scale_mode: ScaleMode = DEFAULT_SCALE_MODE["k"],
        value_scale_mode: ScaleMode = DEFAULT_SCALE_MODE["v"],
        center: bool = False,
        rounds: int = 1,
    ) -> None:
        RingKVCache.__init__(self, max_size, keep)
        self._init_tq(kbits, vbits, seed, key_scale_mode, value_scale_mode, center, rounds=rounds)

    @property
    def state(self) -> tuple[Any, ...]:
        """``(keys, values, offset, keep, max_size, idx, kbits, vbits, seed,
        key_scale_mode, value_scale_mode, center, dtype, head_dim, mu, rounds)``."""
        stored = (None, None) if self.keys is None else self.encoded_rows()
        return (*stored, self.offset, self.keep, self.max_size, self._idx, *self._options())

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        keys, values, self.offset, self.keep, self.max_size, self._idx, *options = v
        self._restore(keys, values, tuple(options))
