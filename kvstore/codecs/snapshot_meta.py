"""Snapshot metadata checked on decode, before anything restores it (issue 18, damage 6).

A record's checksums say its bytes are the ones written, not that the writer
was right: a buggy or hostile writer can store ``max_size = 2**64 - 1`` (a
window that never slides), ``keep = 2**31``, an ``offset`` that is a string
or a map, or ``dtype = "float64"`` over float32 rows, and recompute the
checksums. So every layer of a record header is checked by its own codec as
the header is parsed (:func:`check_layers`, called by
:func:`kvstore.codecs.header_parse.parse_header`), against the tensors the header
describes and against the bounds here; a problem is a ``CorruptEntryError``
naming the layer and the field -- in a store, a counted miss, removed by
``verify --fix``.

Each fact has one home: the codecs own their meta (``dtype`` and ``offset``:
:class:`kvstore.codecs.rows.RowCodec`; ``max_size``, ``keep``, ``ring_idx``:
:class:`kvstore.codecs.ring.RingKVCodec`; ``tq``:
:mod:`kvstore.codecs.turboquant_params`), and check it in their
``description_problem``, the same code that checks a snapshot on restore;
this module holds the bounds and builds the described snapshot they check.
"""

from __future__ import annotations

import functools
import marshal
from collections.abc import Mapping, Sequence
from operator import attrgetter
from typing import Any

import numpy as np

from kvstore.abc.codec import Snapshot
from kvstore.codecs.arrays import DTYPES
from kvstore.errors import CorruptEntryError, UnknownSignatureError

__all__ = [
    "checked_by",
    "decoded_alike",
    "note_checked",
    "note_checked_alike",
    "MAX_POSITION",
    "MAX_WINDOW",
    "described",
    "description_key",
    "position_problem",
    "check_layers",
]

#: Largest token position a snapshot may name (``offset``, ``start``, ``stop``):
#: far past any context a model has, and small enough that no size computed from
#: it overflows.
MAX_POSITION = 1 << 32
#: Largest sliding window (``max_size``) a snapshot may name: 16M tokens.
MAX_WINDOW = 1 << 24


def position_problem(meta: Mapping[str, Any], field: str, at_least: int) -> str | None:
    """What is wrong with ``meta[field]`` as a token position ``>= at_least``, if anything."""
    value = meta.get(field)
    if type(value) is not int:
        return f"meta {field} must be an int; received {type(value).__name__} {str(value)[:40]!r}"
    if not at_least <= value <= MAX_POSITION:
        return f"meta {field} {value} is outside [{at_least}, {MAX_POSITION}]"
    return None


@functools.lru_cache(maxsize=1024)
def _described_tensor(dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    # Shape and dtype without data: a read-only zero-stride view of one element,
    # remembered (each record of a prefix describes the same few shapes; building
    # them was half the header parse of a 32-layer record).
    view = np.lib.stride_tricks.as_strided(
        np.zeros(1, dtype=DTYPES[dtype]), shape=shape, strides=(0,) * len(shape)
    )
    view.flags.writeable = False
    return view


def described(entry: Any) -> Snapshot:
    """The snapshot a header's layer entry describes (a
    :class:`kvstore.codecs.header.LayerEntry`): its tensors have the described shapes
    and dtypes and no data (zero-stride arrays), for the codecs' checks."""
    tensors = {t.name: _described_tensor(t.dtype, tuple(t.shape)) for t in entry.tensors}
    return Snapshot(entry.signature, entry.start, entry.stop, tensors, entry.meta)


def description_key(entry: Any) -> tuple[Any, ...] | None:
    """Everything a codec's description check reads of a header's layer entry (signature,
    range, each tensor's name, dtype and shape in order, meta), as one value: two entries
    with equal keys describe the same snapshot, types and all, so no check can tell them
    apart. ``None`` when the meta cannot be said in bytes.

    For entries a header parse builds, whose fixed fields are exactly ``str``, ``int``
    and tuples of ``int`` (``==`` is exact on those). The meta is free-form, so it is
    compared as marshal writes it: each value's exact type and every bit (``1``,
    ``1.0`` and ``True`` differ, as do ``0.0`` and ``-0.0``, which ``==`` equates);
    format 2 has no back-references, so the bytes do not depend on how objects are shared.
    """
    try:
        meta = marshal.dumps(entry.meta, 2)
    except ValueError:  # not marshallable: a value of another type
        return None
    tensors = tuple(map(_DESCRIBED_TENSOR, entry.tensors))
    return (entry.signature, entry.start, entry.stop, tensors, meta)


_DESCRIBED_TENSOR = attrgetter("name", "dtype", "shape")


def check_layers(op: str, layers: Sequence[Any]) -> None:
    """Raise ``CorruptEntryError`` for the first layer whose codec finds its meta or
    tensors wrong. Layers of kinds no installed codec serves are not checked here
    (their restore needs the codec anyway).

    A layer whose :func:`description_key` equals one already passed is not checked
    again: a record's layers usually differ only in their tensors' offsets, and the
    check of 32 identical layers was most of a header's parse.

    Each layer that passed (itself, or as one equal to it) is noted with the class of
    the codec that passed it (:func:`checked_by`), so a restore need not check a
    snapshot decoded from it again.
    """
    from kvstore.codecs.registry import get_codec

    passed: dict[tuple[Any, ...], type] = {}
    last, last_by = None, None  # the layer before, usually the same again: compared
    for i, layer in enumerate(layers):
        if layer is None:
            continue
        key = description_key(layer)
        if key is not None and key == last:  # its stop too: it passed
            layer.__dict__[_CHECKED_BY] = last_by
            continue
        if key is not None and key in passed:
            layer.__dict__[_CHECKED_BY] = passed[key]
            continue
        if layer.stop > MAX_POSITION:
            raise CorruptEntryError(
                f"[{op}] layers[{i}] ends at {layer.stop}, past {MAX_POSITION}."
            )
        try:
            codec = get_codec(layer.signature)
        except (UnknownSignatureError, ValueError, TypeError):
            continue  # not installed here (a malformed signature failed the version check)
        problem = codec.description_problem(described(layer))
        if problem:
            raise CorruptEntryError(f"[{op}] layers[{i}] ({layer.signature}): {problem}.", layer=i)
        layer.__dict__[_CHECKED_BY] = type(codec)
        if key is not None:
            passed[key] = type(codec)
            last, last_by = key, type(codec)


#: Where a header's layer entry that passed its codec's description check notes that
#: codec's class, and a snapshot decoded from it (:func:`checked_by`). Not a field: it
#: takes no part in equality, and a snapshot made anew (a cut, a ``replace``) has none.
_CHECKED_BY = "_checked_by"


def checked_by(described: Any) -> type | None:
    """The codec class whose ``description_problem`` found nothing wrong with the header
    entry ``described``, or with the entry a decoded snapshot ``described`` was made
    from as it is (:func:`check_layers`); ``None`` when none did. A codec whose
    description check is its whole restore check need not check such a snapshot again:
    a 4096-token lossless restore of llama-8B checks 512 on its critical path."""
    return described.__dict__.get(_CHECKED_BY)


def note_checked(snapshot: Snapshot, entry: Any) -> Snapshot:
    """``snapshot``, decoded from header entry ``entry`` as it describes it, with the
    note of the codec that checked ``entry`` (if one did) and of the tensors ``entry``
    describes (:func:`decoded_alike`); returned."""
    notes = snapshot.__dict__
    by = entry.__dict__.get(_CHECKED_BY)
    if by is not None:
        notes[_CHECKED_BY] = by
    notes[_DESCRIBED] = entry.tensors
    return snapshot


def note_checked_alike(snapshots: Sequence[Snapshot], codec: Any) -> None:
    """Check the first of ``snapshots`` with ``codec``'s description check, and when it
    passes note every one of them checked by ``codec``'s class (:func:`checked_by`).
    For snapshots alike in everything that check reads: one signature, range and meta,
    tensors of the same names, shapes and dtypes (the layers of one stacked conversion,
    :func:`~kvstore.codecs.transcode.transcode_stacked`). A restore's plans then do not
    check 32 such snapshots one by one."""
    if snapshots and codec.description_problem(snapshots[0]) is None:
        for snapshot in snapshots:
            snapshot.__dict__[_CHECKED_BY] = type(codec)


#: Where a decoded snapshot notes its header entry's tensor descriptions (a tuple the
#: layers of one header template share: :mod:`~kvstore.codecs.header_template`).
_DESCRIBED = "_described"


def decoded_alike(first: Snapshot, other: Snapshot) -> bool:
    """Whether ``first`` and ``other`` were decoded from header entries with the very
    same tensor descriptions and meta (the same objects: one header template's layer),
    so their tensors have the same names, dtypes and shapes and their metas are equal
    -- everything a join of the two compares but their ranges. A 4096-token lossless
    restore of llama-8B compares 512 such pairs."""
    described = first.__dict__.get(_DESCRIBED)
    return (
        described is not None
        and other.__dict__.get(_DESCRIBED) is described
        and first.meta is other.meta
    )
