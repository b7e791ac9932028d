"""Behaviour every cache family shares, written once over row *trees*.

A family stores each token's keys (and values) as a tree of arrays shaped
``[B, H, T, width]``: a bare array for raw rows, a ``(packed, scales, biases)``
tuple for MLX affine rows. The growing buffer (:class:`GrowingKVCache`) and the
sliding-window ring (:mod:`kvstore.caches.rotating`) are written once over
such trees, so each family only says how a row is encoded (``_encode``) and
what attention receives (``_present``). The buffer arithmetic mirrors mlx-lm's
``KVCache``/``QuantizedKVCache`` step by step: attention then sees the same
arrays in the same order, which is what makes logits bit-identical to mlx-lm.
"""

from __future__ import annotations

from typing import Any, ClassVar, cast

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map

from kvstore.caches.mask import create_attention_mask
from kvstore.errors import CapabilityError
from kvstore.family import Family

__all__ = [
    "Tree",
    "BaseKVCache",
    "GrowingKVCache",
    "UnwrittenRoom",
    "map_rows",
    "row_leaves",
    "stored_buffers",
    "tree_length",
    "zeros_like_rows",
]

#: A row tree: ``mx.array | tuple[mx.array, ...]`` shaped ``[B, H, T, width]`` (numpy
#: views into store pages while a codec restores). The one definition; codecs import it.
Tree = Any


# Row trees are arrays, or tuples (and lists) of them, nested: every decode step walks
# each layer's a few times, so these walk them directly rather than through
# ``mlx.utils``' general trees (a 32-layer forward's graph built 5.4 -> 4.x ms on a
# 2-core CPU). Anything else (a dict) still goes through ``mlx.utils``.


def row_leaves(tree: Tree) -> list[mx.array]:
    """The arrays of a row tree, in order."""
    if isinstance(tree, (tuple, list)):
        return [leaf for branch in tree for leaf in row_leaves(branch)]
    if isinstance(tree, dict):
        return [leaf for _, leaf in tree_flatten(tree)]  # type: ignore[misc,str-unpack]
    return [tree]


def map_rows(fn: Any, tree: Tree, *rest: Tree) -> Tree:
    """``tree_map(fn, tree, *rest)`` over row trees (the same structure each)."""
    if isinstance(tree, (tuple, list)):
        return type(tree)(
            map_rows(fn, branch, *(other[i] for other in rest)) for i, branch in enumerate(tree)
        )
    if isinstance(tree, dict):
        return tree_map(fn, tree, *rest)
    return fn(tree, *rest)


def tree_length(tree: Tree) -> int:
    """Token capacity (axis 2) of a row tree."""
    return int(row_leaves(tree)[0].shape[2])


def zeros_like_rows(tree: Tree, tokens: int) -> Tree:
    return map_rows(lambda a: mx.zeros((*a.shape[:2], tokens, a.shape[3]), a.dtype), tree)


def _zero_rows_from(leaf: mx.array, first: int) -> None:
    """Zero an evaluated ``[B, H, T, width]`` buffer's rows from ``first`` on, in its
    memory where it is one C-contiguous block (a restore's arrays share one buffer, and
    an MLX slice update of any of them would copy it whole); else by a slice update."""
    view = memoryview(cast(Any, leaf))  # MLX arrays are buffers (writable, shared)
    if not view.c_contiguous or leaf.ndim != 4:
        leaf[..., first:, :] = 0
        return
    planes = np.frombuffer(view.cast("B"), np.uint8).reshape(leaf.shape[0] * leaf.shape[1], -1)
    planes[:, first * leaf.shape[3] * leaf.itemsize :] = 0


class BaseKVCache:
    """Attributes and methods common to every family (mlx-lm ``_BaseCache`` plus ours)."""

    step = 256
    #: The family this class implements (declared by its module, registered with its codec).
    family: ClassVar[Family]
    keys: Tree | None
    values: Tree | None
    offset: int
    state: Any  # a property in each family: mlx-lm's positional state tuple

    def signature(self) -> str:
        raise NotImplementedError

    # -- hooks a family overrides -------------------------------------------------
    def _encode(self, x: mx.array) -> Tree:
        """Turn new ``[B, H, S, D]`` rows into the family's stored row tree."""
        return x

    def _encode_pair(self, keys: mx.array, values: mx.array) -> tuple[Tree, Tree]:
        """Encode new key and value rows; a family whose keys and values differ
        (bits, rotation, scale mode) overrides this instead of ``_encode``."""
        return self._encode(keys), self._encode(values)

    def _present(self, keys: Tree, values: Tree) -> tuple[Tree, Tree]:
        """What attention receives for the stored rows ``keys``/``values``."""
        return keys, values

    # -- shared -------------------------------------------------------------------
    def buffers(self) -> tuple[Tree | None, Tree | None]:
        """The key and value buffers as they are, capacity included: rows past ``offset``
        may hold what the heap held (:meth:`GrowingKVCache.leave_unwritten`), so read
        them only below it."""
        return self.keys, self.values

    def empty(self) -> bool:
        return self.buffers()[0] is None

    @property
    def nbytes(self) -> int:
        """Bytes allocated, capacity padding included (as mlx-lm reports it)."""
        keys, values = self.buffers()
        if keys is None:
            return 0
        return sum(leaf.nbytes for leaf in row_leaves((keys, values)))

    def bytes_per_token(self) -> int:
        """Physical bytes one more token costs: one row of keys and values
        across batch and heads. 0 while the cache is empty (no shapes yet)."""
        keys, values = self.buffers()
        if keys is None:
            return 0
        return sum(leaf.nbytes // leaf.shape[2] for leaf in row_leaves((keys, values)))

    def is_trimmable(self) -> bool:
        return True

    # -- speculative rounds (issue 16) --------------------------------------------------
    _round_offset: int | None = None

    def begin_round(self) -> None:
        """Mark the offset before a verify forward; :meth:`end_round` takes back what follows."""
        self._round_offset = self.offset

    def end_round(self, keep: int) -> None:
        """Keep the first ``keep`` tokens processed since :meth:`begin_round`, drop the rest."""
        start, self._round_offset = self._round_offset, None
        if start is None:
            raise CapabilityError(
                f"[{self.signature()}] end_round without begin_round; open a round before "
                f"the verify forward."
            )
        processed = self.offset - start
        if not 0 <= keep <= processed:
            raise CapabilityError(
                f"[{self.signature()}] A round that processed {processed} tokens can keep 0 "
                f"to {processed}; received keep={keep}.",
                keep=keep,
                processed=processed,
            )
        if keep < processed:
            self._drop_newest(processed - keep)

    def trim(self, n: int) -> int:
        """Drop the newest ``n`` tokens (at most ``offset``); returns how many went."""
        raise NotImplementedError  # each family's buffer trims its own way

    def _drop_newest(self, n: int) -> None:
        self.trim(n)

    @classmethod
    def from_state(cls, state: Any) -> Any:
        # As mlx-lm: build without __init__, then let the state setter fill in.
        obj = cls.__new__(cls)
        obj.state = state
        return obj

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.signature()}, offset={self.offset})"


def stored_buffers(cache: Any) -> tuple[Tree | None, Tree | None]:
    """``cache``'s key and value buffers as they are: ours through
    :meth:`BaseKVCache.buffers` (a restored cache's unwritten room is not zeroed for a
    reader of rows below ``offset``), any other cache's ``keys`` and ``values``."""
    return cache.buffers() if isinstance(cache, BaseKVCache) else (cache.keys, cache.values)


class _RowBuffer:
    """A cache's ``keys`` or ``values`` (:class:`UnwrittenRoom`): held in
    ``_keys``/``_values``, the rows a restore left unwritten zeroed before the buffer is
    read or replaced (a buffer left behind must not keep them either)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._slot = f"_{name}"

    def __get__(self, cache: Any, owner: type | None = None) -> Any:
        if cache is None:
            return self
        if cache._unwritten is not None:
            cache._zero_unwritten()
        return getattr(cache, self._slot)

    def __set__(self, cache: Any, tree: Tree | None) -> None:
        if cache._unwritten is not None:
            cache._zero_unwritten()
        setattr(cache, self._slot, tree)


class UnwrittenRoom:
    """Buffers a host restore may leave unwritten past the rows it restored: the room
    for the next tokens (12% of a 2048-token llama-8B restore's bytes, a third of a
    512-token one's), holding what the heap held (:meth:`leave_unwritten`).

    The cache's steps write those rows before attention reads them, so only what reads
    the whole buffer would see them: ``keys`` and ``values`` zero them first, once. The
    cache's own steps use the buffers directly (``_keys``, ``_values``) and tell how far
    they wrote (:meth:`_written_to`). A growing cache and a sliding window's ring before
    it fills take it so."""

    #: The first buffer row that may hold what the heap held rather than zeros or rows
    #: written here; ``None``: none does.
    _unwritten: int | None = None
    _keys: Tree | None = None
    _values: Tree | None = None

    keys = _RowBuffer()
    values = _RowBuffer()

    def leave_unwritten(self, rows: int) -> None:
        """Note that the buffers' rows from ``rows`` on were not written (a restore left
        its room as the allocator gave it): they are zeroed before the whole buffer is
        first read through ``keys``, ``values`` or ``state``."""
        if self._keys is not None and rows < tree_length(self._keys):
            self._unwritten = rows

    def _written_to(self, row: int) -> None:
        """The cache's step wrote its rows up to ``row`` (from below the unwritten rows'
        start: writes go on from the last one, and a trim only moves back)."""
        if self._unwritten is not None and row > self._unwritten:
            assert self._keys is not None
            self._unwritten = row if row < tree_length(self._keys) else None

    def _zero_unwritten(self) -> None:
        first, self._unwritten = self._unwritten, None
        assert first is not None
        leaves = row_leaves((self._keys, self._values))
        mx.eval(leaves)
        for leaf in leaves:
            _zero_rows_from(leaf, first)

    def buffers(self) -> tuple[Tree | None, Tree | None]:
        return self._keys, self._values


class GrowingKVCache(UnwrittenRoom, BaseKVCache):
    """Rows appended to a buffer that grows in steps of ``step`` tokens; a host restore
    may leave its room unwritten (:class:`UnwrittenRoom`)."""

    def __init__(self) -> None:
        self._keys = None
        self._values = None
        self.offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Tree, Tree]:
        prev = self.offset
        new_keys, new_values = self._encode_pair(keys, values)
        num_steps = keys.shape[2]
        if self._keys is None or prev + num_steps > tree_length(self._keys):
            grow = (self.step + num_steps - 1) // self.step * self.step
            fresh_k = zeros_like_rows(new_keys, grow)
            fresh_v = zeros_like_rows(new_values, grow)
            if self._keys is None:
                self._keys, self._values = fresh_k, fresh_v
            else:
                if prev % self.step != 0:
                    # Rows from prev on go: the unwritten ones too (they lie past offset).
                    self._keys, self._values = map_rows(
                        lambda a: a[..., :prev, :], (self._keys, self._values)
                    )
                    self._unwritten = None
                self._keys, self._values = map_rows(
                    lambda a, b: mx.concatenate([a, b], axis=2),
                    (self._keys, self._values),
                    (fresh_k, fresh_v),
                )
        self.offset += num_steps
        for buf, new in zip(
            row_leaves((self._keys, self._values)), row_leaves((new_keys, new_values))
        ):
            buf[..., prev : self.offset, :] = new
        self._written_to(self.offset)
        return self._present(*self.keys_and_values())

    def keys_and_values(self) -> tuple[Tree, Tree]:
        """The stored rows of the ``offset`` logical tokens (no capacity padding)."""
        keys, values = self._keys, self._values
        assert keys is not None and values is not None
        if self.offset < tree_length(keys):
            return map_rows(lambda a: a[..., : self.offset, :], (keys, values))
        return keys, values

    def size(self) -> int:
        return self.offset

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None
    ) -> mx.array | str | None:
        return create_attention_mask(
            N, offset=self.offset, return_array=return_array, window_size=window_size
        )


#: The rows' family kind -> the batch class its rows go into; each batch class of
#: :mod:`kvstore.caches.batch` registers itself (it declares its rows' family).
_BATCH_CLASSES: dict[str, type] = {}


def register_batch_class(cls: type) -> type:
    """Register a batch class under its rows' family (``cls.rows_family``); returns it."""
    _BATCH_CLASSES[cls.rows_family.kind] = cls  # type: ignore[attr-defined]
    return cls


def batch_class_for(cache: Any) -> type:
    """The batch class rows of ``cache``'s family go into.

    Raises:
        CapabilityError: a family that does not batch (TurboQuant, plug-ins, unknown ones).
    """
    from kvstore.errors import CapabilityError
    from kvstore.signature import parse_signature

    try:
        kind: str | None = parse_signature(cache.signature()).kind
    except Exception:  # fail closed: a cache without a signature we know does not batch
        kind = None
    cls = _BATCH_CLASSES.get(kind) if kind is not None else None
    if cls is None:
        raise CapabilityError(
            f"[batch cache] {type(cache).__name__} ({kind or 'unknown'}) does not batch yet; "
            f"batching families: {', '.join(sorted(_BATCH_CLASSES))}.",
            found=kind,
        )
    return cls


def merge_caches(caches: Any) -> Any:
    """One row-batched cache of single caches of one family and parameters (left-padded;
    :mod:`kvstore.caches.batch`).

    Raises:
        CapabilityError: caches of different families or parameters, or a family
            that does not batch.
    """
    from kvstore.errors import CapabilityError

    caches = list(caches)
    if not caches:
        raise ValueError("[batch cache] Nothing to merge.")
    signatures = {c.signature() for c in caches}
    if len(signatures) != 1 or len({type(c) for c in caches}) != 1:
        raise CapabilityError(
            f"[batch cache] Rows of one batch share a family; received {sorted(signatures)}.",
            found=sorted(signatures),
        )
    return batch_class_for(caches[0]).merge(caches)  # type: ignore[attr-defined]


class Batchable:
    """A family whose rows batch: mlx-lm's ``BatchGenerator`` calls ``merge`` (only
    families that batch have it: mlx-lm serves the others one at a time)."""

    @classmethod
    def merge(cls, caches: Any) -> Any:
        """One row-batched cache of ``caches`` (:func:`merge_caches`)."""
        return merge_caches(caches)
