"""Parsing a header: the usual one in one pass, anything else rule by rule.

A restore parses a record header per block, on its critical path, holding the
GIL: checked rule by rule (:func:`kvstore.codecs.header.checked_header`), a
32-layer header took about 1.1 ms here, seven times its msgpack decoding.
:func:`usual_header` reads the common, well-formed header a column at a time
(each field of every layer, then of every tensor, checked by C loops:
``map``, ``min``, ``set``) and gives up, returning ``None``, at the first thing
it does not expect; ``checked_header`` then says what is wrong, with the message
it always gave.

What ``usual_header`` accepts, ``checked_header`` accepts, with an equal
result: every map has exactly its fields (``parse_fields``' usual case, which
returns the map itself), each value of the exact type and within the limits its
check in ``header`` has; the free-form maps (``meta``) and a container's extra
fields are walked for :func:`~kvstore.codecs.header.check_bounds`' rules
(:func:`~kvstore.codecs.header.is_bounded`). The fixed part is inside the bounds
by construction (:data:`_USUAL_WITHIN_BOUNDS`). The codec checks then run on the
layers either way.
"""

from __future__ import annotations

import marshal
from collections.abc import Mapping, Sequence
from itertools import chain, compress
from math import prod
from operator import itemgetter, le, mul
from typing import Any

from kvstore.codecs.arrays import DTYPES
from kvstore.codecs.header import (
    BOUNDS,
    LAYER_FIELDS,
    LOCATED_TENSOR_FIELDS,
    MAX_INT,
    MAX_STR_CHARS,
    SUPPORTED_VERSIONS,
    TENSOR_FIELDS,
    Check,
    LayerEntry,
    TensorEntry,
    check_codec_versions,
    checked_header,
    header_fields,
    is_bounded,
)
from kvstore.codecs.snapshot_meta import check_layers

__all__ = ["parse_header", "usual_header", "forget_tensor_tables"]

Parsed = tuple[dict[str, Any], tuple[LayerEntry | None, ...]]


def parse_header(
    op: str, obj: Any, *, located: bool, extra: Mapping[str, Check] | None = None
) -> Parsed:
    """The fields and layers of a header (record or file), bounds and all checked.

    Common fields are ``format``, ``writer``, ``layers`` and ``meta``; ``extra``
    adds a container's own. ``located``: tensors carry ``offset``/``nbytes``.

    Raises:
        CorruptEntryError: a bound, a field, a layer's rule or its codec's check broken.
        FormatVersionError: a format, a field or a codec version this reader does not read.
    """
    fields = header_fields(extra)
    usual = usual_header(obj, fields, located)
    f, layers = usual if usual is not None else checked_header(op, obj, fields, located)
    check_codec_versions(op, layers)
    check_layers(op, layers)
    return f, layers


#: The fixed part of a usual header (its field names, every string at most
#: MAX_STR_CHARS, at most tensors_per_layer tensors of rank at most rank, seven
#: levels: header > layers > layer > tensors > tensor > shape > dim) is within
#: BOUNDS when these hold; when they do not, every header takes the checked way.
_USUAL_WITHIN_BOUNDS = (
    BOUNDS.map_len >= max(len(LAYER_FIELDS), len(LOCATED_TENSOR_FIELDS), 16)
    and BOUNDS.array_len >= max(BOUNDS.tensors_per_layer, BOUNDS.rank)
    and BOUNDS.str_len >= max(MAX_STR_CHARS, *map(len, DTYPES))
    and BOUNDS.depth >= 7
)
#: How deep each free-form part sits (the header itself is depth 1).
_HEADER_FIELD_DEPTH = 2
_LAYER_META_DEPTH = 4

_ITEMSIZES = {name: dtype.itemsize for name, dtype in DTYPES.items()}
_LAYER_COLUMNS = itemgetter(*LAYER_FIELDS)
_TENSOR_COLUMNS = itemgetter(*TENSOR_FIELDS)
_LOCATED_TENSOR_COLUMNS = itemgetter(*LOCATED_TENSOR_FIELDS)
_STR, _INT, _LIST, _DICT = (frozenset({kind}) for kind in (str, int, list, dict))


def usual_header(obj: Any, fields: Mapping[str, Check], located: bool) -> Parsed | None:
    """What :func:`~kvstore.codecs.header.checked_header` returns for ``obj`` when it is
    a usual header (exactly its fields, a supported format, data within the bounds);
    ``None`` for anything else."""
    if not _USUAL_WITHIN_BOUNDS or type(obj) is not dict or obj.keys() != fields.keys():
        return None
    for key, check in fields.items():
        value = obj[key]
        if not check(value):
            return None
        if key != "layers" and not is_bounded(value, _HEADER_FIELD_DEPTH):
            return None
    if obj["format"] not in SUPPORTED_VERSIONS:
        return None
    layers = _usual_layers(obj["layers"], located)
    return None if layers is None else (obj, layers)


def _usual_layers(obj: Any, located: bool) -> tuple[LayerEntry | None, ...] | None:
    """The layers of a usual header; ``None`` at anything unusual."""
    if type(obj) is not list or len(obj) > min(BOUNDS.layers, BOUNDS.array_len):
        return None
    items = [item for item in obj if item is not None]
    absent = len(obj) - len(items)
    if not items:
        return tuple(obj)
    # A map holds exactly its fields when it has as many and each is there
    # (the column getters raise KeyError otherwise).
    if not (set(map(type, items)) <= _DICT and set(map(len, items)) == {len(LAYER_FIELDS)}):
        return None
    try:
        columns = list(zip(*map(_LAYER_COLUMNS, items), strict=True))
    except KeyError:
        return None
    signatures, codecs, versions, starts, stops, metas, tensor_lists = columns
    if not (
        _are_names(signatures)
        and _are_names(codecs)
        and _are_ints(versions)
        and _are_ints(starts)
        and _are_ints(stops)
        and all(map(le, starts, stops))
        and set(map(type, metas)) <= _DICT
        and _are_bounded(metas, _LAYER_META_DEPTH)
        and set(map(type, tensor_lists)) <= _LIST
        and max(map(len, tensor_lists)) <= BOUNDS.tensors_per_layer
    ):
        return None
    tables = _tensor_tables(tensor_lists, located)
    if tables is None:
        return None
    layers = list(map(LayerEntry, signatures, codecs, versions, starts, stops, metas, tables))
    if not absent:
        return tuple(layers)
    built = iter(layers)
    return tuple(None if item is None else next(built) for item in obj)


def _tensor_tables(
    tensor_lists: tuple[Any, ...], located: bool
) -> Sequence[tuple[TensorEntry, ...]] | None:
    """Each layer's tensors, from its list of tensor maps; ``None`` at anything unusual.

    A restore reads a record per block, and the blocks of one model lay their tensors
    out alike: the layers' lists, as marshal writes them (format 2: every type and bit,
    and no back-references), are read once and their tensors remembered (immutable,
    so shared), for the next header with the same layout.
    """
    known = _TABLES[located]
    try:
        key = marshal.dumps(tensor_lists, 2)
    except ValueError:  # not marshallable: not header data
        return None
    tables = known.get(key)
    if tables is not None:
        return tables
    tensors = _usual_tensors(list(chain.from_iterable(tensor_lists)), located)
    if tensors is None:
        return None
    built: list[tuple[TensorEntry, ...]] = []
    end = 0
    for entries in tensor_lists:
        begin, end = end, end + len(entries)
        table = tuple(tensors[begin:end])
        if len({t.name for t in table}) != len(table):  # a name twice
            return None
        built.append(table)
    if len(known) >= _TABLES_LIMIT:
        known.clear()  # crude, but bounded
    tables = known[key] = tuple(built)
    return tables


def forget_tensor_tables() -> None:
    """Drop the remembered tensor tables (see :func:`_tensor_tables`)."""
    for known in _TABLES.values():
        known.clear()


#: Each layer's tensors of headers read, by ``located`` and the marshal bytes of the
#: layers' lists of tensor maps.
_TABLES: dict[bool, dict[bytes, tuple[tuple[TensorEntry, ...], ...]]] = {True: {}, False: {}}
_TABLES_LIMIT = 256


def _usual_tensors(items: list[Any], located: bool) -> list[TensorEntry] | None:
    """The tensors of a usual header's layers, in order; ``None`` at anything unusual."""
    if not items:
        return []
    fields = LOCATED_TENSOR_FIELDS if located else TENSOR_FIELDS
    if not (set(map(type, items)) <= _DICT and set(map(len, items)) == {len(fields)}):
        return None
    try:
        columns = list(
            zip(*map(_LOCATED_TENSOR_COLUMNS if located else _TENSOR_COLUMNS, items), strict=True)
        )
    except KeyError:
        return None
    names, dtypes, shapes = columns[:3]
    if not (
        _are_names(names)
        and set(map(type, dtypes)) <= _STR
        and set(dtypes) <= _ITEMSIZES.keys()
        and set(map(type, shapes)) <= _LIST
        and min(map(len, shapes)) > 0
        and max(map(len, shapes)) <= BOUNDS.rank
        and _are_ints(list(chain.from_iterable(shapes)))
    ):
        return None
    sizes = list(map(mul, map(_ITEMSIZES.__getitem__, dtypes), map(prod, shapes)))
    if located:
        offsets, nbytes = columns[3:]
        if not (_are_ints(offsets) and _are_ints(nbytes) and list(nbytes) == sizes):
            return None
    else:
        offsets, nbytes = (0,) * len(items), tuple(sizes)
    return list(map(TensorEntry, names, dtypes, map(tuple, shapes), offsets, nbytes))


def _are_bounded(maps: tuple[dict[str, Any], ...], depth: int) -> bool:
    """Every one of ``maps``, sitting ``depth`` levels down, passes ``is_bounded``: the
    usual flat ones (scalars and strings only) by C loops, any other one by the walk."""
    keys = list(chain.from_iterable(maps))
    values = list(chain.from_iterable(map(dict.values, maps)))
    if (
        depth < BOUNDS.depth
        and max(map(len, maps)) <= BOUNDS.map_len
        and set(map(type, keys)) <= _STR
        and max(map(len, keys), default=0) <= BOUNDS.str_len
        and set(map(type, values)) <= _FLAT
        and max(map(len, compress(values, map(_STR.__contains__, map(type, values)))), default=0)
        <= BOUNDS.str_len
    ):
        return True
    # A record's layers usually carry one nested meta 32 times over (a TurboQuant
    # codebook and rotation each): a map equal to one that passed passes too (``==``
    # equates only maps of the same keys and of values that are bounded alike: equal
    # strings have equal lengths, and a number equals only numbers), so it is
    # compared in C instead of walked (a 4096-token kv:turboquant:4:4 restore's 16
    # headers: 18.8 -> 14.9 ms here).
    passed: list[dict[str, Any]] = []
    for value in maps:
        if value in passed:  # identity, then ==
            continue
        if not is_bounded(value, depth):
            return False
        passed.append(value)
    return True


_FLAT = frozenset({str, int, float, bool, type(None)})


def _are_names(column: Any) -> bool:
    """Every item passes ``is_str`` (and is exactly a ``str``)."""
    return (
        set(map(type, column)) <= _STR
        and min(map(len, column), default=1) > 0
        and max(map(len, column), default=0) <= MAX_STR_CHARS
    )


def _are_ints(column: Any) -> bool:
    """Every item passes ``is_int``."""
    return (
        set(map(type, column)) <= _INT
        and min(column, default=0) >= 0
        and max(column, default=0) <= MAX_INT
    )
