"""Recurrent state: ``rec:gated-delta`` (a Gated-DeltaNet layer) and ``rec:arrays:{slots}``
(mlx-lm's generic ``ArraysCache``, any recurrent layer), and speculative rounds.

A Gated-DeltaNet layer (Qwen3-Next, Qwen3.5) keeps no row per token: it keeps
the last ``K - 1`` inputs of its causal convolution (``[B, K - 1, conv_dim]``,
the model's dtype) and one state matrix per value head
(``[B, Hv, Dv, Dk]``, float32), the same size at any length. The state at a
position is a *checkpoint*: it cannot be cut to an earlier position, only
replaced by an older checkpoint.

:class:`GatedDeltaCache` is indexed like mlx-lm's ``ArraysCache`` (``cache[0]``
the conv window, ``cache[1]`` the state, ``lengths``, ``advance(n)``,
``make_mask(n)``), so mlx-lm's Gated-DeltaNet layers run on it and ours run on
mlx-lm's; unlike ``ArraysCache`` it keeps an ``offset`` (the tokens it has
seen), which is what a prefix store needs to know where its state sits.

Speculative rounds (the seed's ``specRoundBegin/Commit/Rollback``):
:meth:`GatedDeltaCache.begin_round` keeps the state before a verify forward
(free: MLX arrays are immutable, the layer replaces them rather than writing
into them); during each forward of the round the layer hands the cache its conv input
and a ``replay(state, n)`` of its per-token recurrence (:meth:`record_round`);
:meth:`GatedDeltaCache.end_round` keeps all of it, or restores the kept state
and replays exactly the first ``keep`` tokens -- the same step on the same
inputs, so bit-for-bit the state the forward computed at that position.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from kvstore.errors import CapabilityError
from kvstore.family import RECURRENT_STATE, Family, Parameters, ParamSpec

__all__ = [
    "GATED_DELTA_FAMILY",
    "ARRAYS_FAMILY",
    "GatedDeltaCache",
    "ArraysCache",
    "Replay",
]

GATED_DELTA_FAMILY = Family(
    kind="rec:gated-delta",
    description="a Gated-DeltaNet layer's conv window and float32 state, at one position",
    state=RECURRENT_STATE,
    factory=lambda sig, window, keep: GatedDeltaCache(),
)


def _make_arrays(sig: Parameters, window: int, keep: int) -> ArraysCache:
    return ArraysCache(sig.param("slots"))


ARRAYS_FAMILY = Family(
    kind="rec:arrays",
    description="mlx-lm's ArraysCache: any recurrent layer's arrays, at one position",
    params=(ParamSpec("slots", tuple(range(1, 9))),),
    state=RECURRENT_STATE,
    factory=_make_arrays,
)

#: ``replay(state, n) -> state``: the recurrence over the first ``n`` tokens of a
#: recorded forward, from ``state`` (``None``: zeros).
Replay = Callable[[Any, int], mx.array]


@dataclass
class _Round:
    conv: Any
    state: Any
    offset: int
    #: Per forward of the round: (its conv input, its tokens, its replay).
    forwards: list[tuple[mx.array, int, Replay]] = field(default_factory=list)


class _Slots:
    """What both recurrent caches share of mlx-lm's ``ArraysCache`` protocol: state
    arrays indexed as ``cache[i]``, an ``offset``, the batch bookkeeping (``lengths``,
    ``left_padding``; ``None`` for a single sequence), and a state of a fixed size."""

    cache: list[Any]
    offset: int
    lengths: mx.array | None
    left_padding: mx.array | None

    def __getitem__(self, idx: int) -> Any:
        return self.cache[idx]

    def __setitem__(self, idx: int, value: Any) -> None:
        self.cache[idx] = value

    def advance(self, n: int) -> None:
        """``n`` more tokens went through the layer."""
        self.offset += n
        if self.lengths is not None:
            self.lengths -= n
        if self.left_padding is not None:
            self.left_padding -= n

    @property
    def meta_state(self) -> tuple[str]:
        """The offset, as mlx-lm's ``ArraysCache`` and ours save it."""
        return (str(self.offset),)

    @meta_state.setter
    def meta_state(self, v: tuple[str]) -> None:
        self.offset = int(v[0])

    def size(self) -> int:
        return self.offset

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.cache if a is not None)

    def bytes_per_token(self) -> int:
        """0: one more token costs no memory (the state has a fixed size)."""
        return 0

    def bytes_per_checkpoint(self) -> int:
        """Bytes of one checkpoint: every slot's array (the conv window and the state of
        a Gated-DeltaNet layer; 0 while empty)."""
        return self.nbytes

    def is_trimmable(self) -> bool:
        return False

    def make_mask(self, N: int, **_: Any) -> mx.array | None:
        """The padding mask of ``N`` new tokens (mlx-lm ``ArraysCache.make_mask``)."""
        pos = mx.arange(N)
        mask = None
        if self.left_padding is not None:
            mask = pos >= self.left_padding[:, None]
        if self.lengths is not None:
            in_length = pos < self.lengths[:, None]
            mask = in_length if mask is None else (mask & in_length)
        return mask


class GatedDeltaCache(_Slots):
    """Conv window + float32 state of one Gated-DeltaNet layer, with an ``offset``.

    ``family``: :data:`GATED_DELTA_FAMILY`.

    ``cache[0]``: ``[B, K - 1, conv_dim]`` last conv inputs (``None`` before the
    first token); ``cache[1]``: ``[B, Hv, Dv, Dk]`` float32 state.
    """

    def __init__(self) -> None:
        self.cache: list[Any] = [None, None]
        self.offset = 0
        # mlx-lm's batch bookkeeping; a single sequence keeps both None.
        self.lengths: mx.array | None = None
        self.left_padding: mx.array | None = None
        self._round: _Round | None = None

    family = GATED_DELTA_FAMILY

    # -- mlx-lm ArraysCache protocol ----------------------------------------------------
    # -- kvstore cache interface ----------------------------------------------------------
    def signature(self) -> str:
        return "rec:gated-delta"

    @property
    def conv_state(self) -> mx.array | None:
        return self.cache[0]

    @property
    def ssm_state(self) -> mx.array | None:
        return self.cache[1]

    @property
    def state(self) -> tuple[Any, Any]:
        return self.cache[0], self.cache[1]

    @state.setter
    def state(self, v: tuple[Any, Any]) -> None:
        self.cache = [v[0], v[1]]

    @classmethod
    def from_state(cls, state: tuple[Any, Any], offset: int = 0) -> GatedDeltaCache:
        cache = cls()
        cache.state = state
        cache.offset = offset
        return cache

    def empty(self) -> bool:
        return self.cache[0] is None and self.cache[1] is None

    # -- speculative rounds -------------------------------------------------------------------
    @property
    def in_round(self) -> bool:
        """A round is open: the layer should hand its step inputs to :meth:`record_round`."""
        return self._round is not None

    def begin_round(self) -> None:
        """Keep the state as it is now; the next forward is a verify forward."""
        self._round = _Round(self.cache[0], self.cache[1], self.offset)

    def record_round(self, conv_input: mx.array, tokens: int, replay: Replay) -> None:
        """What the layer computed in one forward of the round: its conv input
        ``[B, K - 1 + tokens, conv_dim]`` and the recurrence over its ``tokens``."""
        if self._round is not None:
            self._round.forwards.append((conv_input, tokens, replay))

    def end_round(self, keep: int) -> None:
        """Keep the first ``keep`` tokens of the round, forget the rest.

        ``keep`` equal to the tokens the round processed commits it; fewer
        restore the state kept by :meth:`begin_round` and replay exactly the
        first ``keep`` tokens through the recorded forwards, in order (a draft
        model's round is one forward per token; a verify forward's is one).

        Raises:
            CapabilityError: no round is open, ``keep`` is outside
                ``[0, tokens processed]``, or a forward of the round was not
                recorded (a layer that does not record ran on this cache).
        """
        r = self._round
        if r is None:
            raise CapabilityError(
                "[rec:gated-delta] end_round without begin_round; open a round before "
                "the verify forward.",
            )
        self._round = None
        processed = self.offset - r.offset
        if not 0 <= keep <= processed:
            raise CapabilityError(
                f"[rec:gated-delta] A round that processed {processed} tokens can keep 0 to "
                f"{processed}; received keep={keep}.",
                keep=keep,
                processed=processed,
            )
        if keep == processed:
            return
        if keep == 0:
            self.cache = [r.conv, r.state]
            self.offset = r.offset
            return
        if sum(n for _, n, _ in r.forwards) != processed:
            raise CapabilityError(
                f"[rec:gated-delta] The round processed {processed} tokens but recorded "
                f"{sum(n for _, n, _ in r.forwards)}; every forward of a round must run "
                f"a recording Gated-DeltaNet layer.",
                processed=processed,
            )
        state, left, inputs = r.state, keep, []
        for i, (conv_input, n, replay) in enumerate(r.forwards):
            # The conv inputs of the round in order: the first forward's window, then new rows.
            inputs.append(conv_input if i == 0 else conv_input[:, conv_input.shape[1] - n :])
            steps = min(left, n)
            state = replay(state, steps)
            left -= steps
            if not left:
                break
        window = inputs[0].shape[1] - r.forwards[0][1]
        rows = inputs[0] if len(inputs) == 1 else mx.concatenate(inputs, axis=1)
        self.cache = [mx.contiguous(rows[:, keep : keep + window, :]), state]
        self.offset = r.offset + keep

    def __repr__(self) -> str:
        return f"GatedDeltaCache(rec:gated-delta, offset={self.offset})"


class ArraysCache(_Slots):
    """mlx-lm's ``ArraysCache`` (``slots`` arrays of any shape, mlx-lm's batch verbs),
    with a signature (``rec:arrays:{slots}``) and an ``offset``.

    ``family``: :data:`ARRAYS_FAMILY`.
    """

    family = ARRAYS_FAMILY

    def __init__(self, size: int, left_padding: list[int] | None = None) -> None:
        self.cache: list[Any] = [None] * size
        self.left_padding = mx.array(left_padding) if left_padding else None
        self.lengths: mx.array | None = None
        self.offset = 0

    def signature(self) -> str:
        return f"rec:arrays:{len(self.cache)}"

    @property
    def batch_size(self) -> int:
        for c in self.cache:
            if c is not None:
                return int(c.shape[0])
        if self.left_padding is not None:
            return int(self.left_padding.size)
        if self.lengths is not None:
            return int(self.lengths.size)
        return 1

    @property
    def state(self) -> tuple[list[Any], Any, Any]:
        return self.cache, self.left_padding, self.lengths

    @state.setter
    def state(self, v: tuple[list[Any], Any, Any]) -> None:
        self.cache, self.left_padding, self.lengths = v

    @classmethod
    def from_state(cls, state: tuple[list[Any], Any, Any]) -> ArraysCache:
        obj = cls.__new__(cls)
        obj.offset = 0
        obj.state = state
        return obj

    def filter(self, batch_indices: Any) -> None:
        self.cache = [c[batch_indices] if c is not None else None for c in self.cache]
        if self.left_padding is not None:
            self.left_padding = self.left_padding[batch_indices]
        if self.lengths is not None:
            self.lengths = self.lengths[batch_indices]

    def extend(self, other: ArraysCache) -> None:
        """Append ``other``'s sequences to this batch (mlx-lm ``ArraysCache.extend``)."""
        a_batch, b_batch = self.batch_size, other.batch_size

        def cat(a: Any, b: Any) -> Any:
            ref = b if b is not None else a
            if ref is None:
                return None
            if a is None:
                a = mx.zeros((a_batch, *ref.shape[1:]), dtype=ref.dtype)
            if b is None:
                b = mx.zeros((b_batch, *ref.shape[1:]), dtype=ref.dtype)
            return mx.concatenate([a, b])

        self.cache = [cat(c, o) for c, o in zip(self.cache, other.cache)]
        self.left_padding = cat(self.left_padding, other.left_padding)
        self.lengths = cat(self.lengths, other.lengths)

    @classmethod
    def merge(cls, caches: list[ArraysCache]) -> ArraysCache:
        """One batch of ``caches`` (mlx-lm ``ArraysCache.merge``)."""
        n_state, batch = len(caches[0].cache), len(caches)
        cache = cls(n_state)
        if all(c.empty() for c in caches):
            cache.left_padding = mx.array([0] * batch)
            return cache
        for e in range(n_state):
            first = next(c[e] for c in caches if c[e] is not None)
            merged = mx.zeros((batch, *first.shape[1:]), first.dtype)
            for i, c in enumerate(caches):
                if c[e] is not None:
                    merged[i : i + 1] = c[e]
            cache[e] = merged
        return cache

    def extract(self, idx: int) -> ArraysCache:
        cache = ArraysCache(len(self.cache))
        cache.cache = [c[idx : idx + 1] if c is not None else None for c in self.cache]
        cache.offset = self.offset
        return cache

    def prepare(self, lengths: Any = None, **kwargs: Any) -> None:
        self.lengths = mx.array(lengths)

    def finalize(self) -> None:
        self.lengths = None
        self.left_padding = None

    def empty(self) -> bool:
        return self.cache[0] is None

    def __repr__(self) -> str:
        return f"ArraysCache({self.signature()}, offset={self.offset})"
