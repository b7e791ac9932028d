"""A record header parsed once per layout: the next one like it is read from the first.

A restore reads one record per block, and the records of one prefix have headers
that differ only in a few integers: each layer's ``start`` and ``stop`` (absolute
token positions) and the payload checksum. Everything else (signatures, codecs,
metas, a TurboQuant layer's codebook and rotation signs, every tensor's name,
dtype, shape, offset and size) is the same bytes. Parsing and checking each of
them anyway was the longest step on a GPU restore's critical path: 16 headers of
4096 tokens of llama-8B took 15 ms on the H200's host (46 ms for
``kv:turboquant:4:4``, whose headers are 36 KB).

So a header that parsed is remembered as a *template*: its bytes with those
integers cut out (the skeleton), and which field each cut integer fills. A later
header with the same skeleton is the template with other integers in the same
places. msgpack decodes left to right, so up to each cut both decode alike; each
cut holds one whole integer there (checked once, on the template: see
:func:`_cuts_are_ranges`), so the decoder reads one integer in either header and goes on
alike. The later header therefore decodes to the template's object with its own
integers in those fields, and only the checks that read them run again: types and
bounds of ``start``/``stop``, ``start <= stop``, and each codec's description
check for each distinct (layer description, range) pair. Anything a template hit
does not vouch for (a check failing, a cut that is not a plain unsigned integer)
returns ``None``, and the caller parses the header in full, which says what is
wrong exactly as before.
"""

from __future__ import annotations

import functools
import re
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from operator import le
from typing import Any

import msgpack

from kvstore.codecs.header import MAX_INT, LayerEntry
from kvstore.codecs.snapshot_meta import check_layers, description_key
from kvstore.errors import CorruptEntryError

__all__ = ["Template", "learn", "fill", "forget"]

#: The cut integers: a map key a record header gives an integer per record (msgpack
#: fixstr ``start``, ``stop``, ``value``), then one unsigned integer as msgpack writes
#: it (positive fixint, uint 8/16/32/64). Any other encoding after such a key does
#: not match, and the header then has another skeleton.
_CUT = re.compile(
    rb"(\xa5start|\xa4stop|\xa5value)(\xcf[\x00-\xff]{8}|\xce[\x00-\xff]{4}"
    rb"|\xcd[\x00-\xff]{2}|\xcc[\x00-\xff]|[\x00-\x7f])"
)
#: A template per skeleton: bounded in a long process (a store of many models).
_LIMIT = 64


@dataclass(frozen=True)
class Template:
    """A parsed header with the integers cut out of its bytes, and where each goes.

    ``skeleton`` is the bytes between the cuts (each part up to and including the key
    of the integer that follows it, the last part the bytes after the last cut).

    ``layers`` are the template's own, ``None`` where absent, and ``present`` the
    others, whose start and stop are the cut integers in order (the payload checksum
    last), replaced on a hit. ``kinds[i]`` is ``present[i]``'s description without its
    range, as a small number (equal kinds and equal ranges: one check).
    """

    version: int
    skeleton: tuple[bytes, ...]
    fields: dict[str, Any]
    layers: tuple[LayerEntry | None, ...]
    present: tuple[LayerEntry, ...]
    kinds: tuple[int, ...]
    #: Whether every present layer has the first one's range (a model without windows):
    #: a later header then likely does too (:func:`_uniform_integers`).
    uniform: bool = False

    @functools.cached_property
    def fixed_bytes(self) -> int:
        """The skeleton's length: a header's bytes less its cut integers'."""
        return sum(map(len, self.skeleton))


_TEMPLATES: dict[tuple[int, tuple[bytes, ...]], Template] = {}
_LOCK = threading.Lock()


def _skeleton(packed: bytes) -> tuple[bytes, ...]:
    """``packed`` split at its cut integers: its skeleton (see :class:`Template`)."""
    parts = _CUT.split(packed)
    between, keys = parts[0::3], parts[1::3]
    return tuple(map(bytes.__add__, between, keys)) + (between[-1],)


def learn(
    version: int,
    packed: bytes,
    fields: dict[str, Any],
    layers: Sequence[LayerEntry | None],
    checksum: int,
) -> None:
    """Remember the header ``packed`` (msgpack, parsed and checked in full into
    ``fields`` and ``layers``, its payload checksum ``checksum``) as a template, when
    its cut integers are exactly its layers' ranges and its checksum."""
    skeleton = _skeleton(packed)
    key = (version, skeleton)
    if key in _TEMPLATES:
        return
    present = tuple(layer for layer in layers if layer is not None)
    if not _cuts_are_ranges(skeleton, packed, layers, present, checksum):
        return
    kinds = _kinds(present)
    if kinds is None:
        return
    with _LOCK:
        if len(_TEMPLATES) >= _LIMIT:
            _TEMPLATES.clear()  # crude, but bounded
        ranges = {(layer.start, layer.stop) for layer in present}
        _TEMPLATES[key] = Template(
            version, skeleton, fields, tuple(layers), present, kinds, len(ranges) == 1
        )


def _cuts_are_ranges(
    skeleton: tuple[bytes, ...],
    packed: bytes,
    layers: Sequence[LayerEntry | None],
    present: Sequence[LayerEntry],
    checksum: int,
) -> bool:
    """Whether the cut integers of ``packed`` (whose skeleton is ``skeleton``) are
    exactly every present layer's start and stop, in order, then the payload checksum.

    Proven by decoding the header with a distinct marker (a uint64 no header holds)
    in each cut: each marker must come back in its field and the fields must hold
    nothing else. A cut inside a string or a bin would change its length, and the
    decode would fail or differ."""
    want = [(i, end) for i, layer in enumerate(layers) if layer is not None for end in (0, 1)]
    want.append((-1, 0))
    cuts = len(skeleton) - 1
    if len(want) != cuts:
        return False
    markers = [(1 << 64) - 1 - i for i in range(cuts)]
    encoded = [b"\xcf" + struct.pack(">Q", marker) for marker in markers]
    try:
        marked = msgpack.unpackb(
            b"".join(map(bytes.__add__, skeleton, [*encoded, b""])), raw=False, strict_map_key=True
        )
        got = []
        for i, end in want:
            if i < 0:
                got.append(marked["checksum"]["value"])
            else:
                got.append(marked["layers"][i]["stop" if end else "start"])
    except Exception:  # any failure: not a skeleton this module can vouch for
        return False
    if got != markers:
        return False
    values = [v for layer in present for v in (layer.start, layer.stop)] + [checksum]
    return _integers(skeleton, packed) == values


def _kinds(layers: Sequence[LayerEntry]) -> tuple[int, ...] | None:
    """Each layer's description (:func:`~kvstore.codecs.snapshot_meta.description_key`)
    less its range, as a small number (equal numbers, equal descriptions); ``None``
    when a meta cannot be said in bytes."""
    seen: dict[tuple[Any, ...], int] = {}
    kinds = []
    for layer in layers:
        described = description_key(layer)
        if described is None:
            return None
        signature, _start, _stop, tensors, meta = described
        key = (signature, layer.codec, layer.codec_version, tensors, meta)
        kinds.append(seen.setdefault(key, len(seen)))
    return tuple(kinds)


def fill(
    op: str, version: int, packed: bytes
) -> tuple[dict[str, Any], tuple[LayerEntry | None, ...], int] | None:
    """The fields, layers and payload checksum of header ``packed`` (msgpack, of a
    record of ``version``) read from a template of the same skeleton, with every check
    that reads the integers it differs in passed; ``None`` when there is no such
    template or a check fails (the caller then parses in full, which says why)."""
    for template in _recent(version):
        values = _uniform_integers(template, packed) if template.uniform else None
        if values is None:
            values = _integers(template.skeleton, packed)
        if values is not None:
            _served(template)
            return _filled(op, template, values)
    return None


def _served(template: Template) -> None:
    """Make ``template`` the first :func:`_recent` tries."""
    key = (template.version, template.skeleton)
    with _LOCK:
        if next(reversed(_TEMPLATES), None) != key and _TEMPLATES.pop(key, None) is not None:
            _TEMPLATES[key] = template


def _recent(version: int) -> list[Template]:
    """The templates of ``version``, the one that served last first (a restore reads
    the records of one model: every header after the first fits it)."""
    with _LOCK:
        return [t for t in reversed(_TEMPLATES.values()) if t.version == version][:_TRIES]


def _integers(skeleton: tuple[bytes, ...], packed: bytes) -> list[int] | None:
    """The integers in ``packed``'s cuts when its bytes are ``skeleton``'s with one
    unsigned msgpack integer between each two parts; ``None`` when they are not.
    (Walked here, by ``startswith``, rather than split by the pattern: a 36 KB
    TurboQuant header splits in 180 us, and walks in a few.)"""
    values = []
    pos = 0
    for part in skeleton[:-1]:
        if not packed.startswith(part, pos):
            return None
        pos += len(part)
        if pos >= len(packed):
            return None
        first = packed[pos]
        width = _WIDTHS[first]
        if width == 1:
            values.append(first)
        elif width:
            values.append(int.from_bytes(packed[pos + 1 : pos + width], "big"))
        else:
            return None
        pos += width
    tail = skeleton[-1]
    if len(packed) - pos != len(tail) or not packed.endswith(tail):
        return None
    return values


def _uniform_integers(template: Template, packed: bytes) -> list[int] | None:
    """:func:`_integers` of a header whose every present layer has the first one's range
    (the checksum the last cut): the first range read, the header rebuilt from the
    skeleton with it in every layer, and compared whole; ``None`` when it differs
    (:func:`_integers` then walks it). Two reads, one join and one compare, not a walk of
    every cut: 22 -> 6.5 us for a 32-layer TurboQuant header of 36 KB."""
    skeleton = template.skeleton
    pos = len(skeleton[0])
    start = _uint_at(packed, pos)
    if start is None or not packed.startswith(skeleton[0]):
        return None
    start_bytes = packed[pos : pos + start[1]]
    pos += start[1]
    if not packed.startswith(skeleton[1], pos):
        return None
    pos += len(skeleton[1])
    stop = _uint_at(packed, pos)
    if stop is None:
        return None
    stop_bytes = packed[pos : pos + stop[1]]
    n = len(template.present)
    width = len(packed) - template.fixed_bytes - n * (start[1] + stop[1])
    at = len(packed) - len(skeleton[-1]) - width
    checksum = _uint_at(packed, at) if width > 0 and at > 0 else None
    if checksum is None or checksum[1] != width:
        return None
    # The header as the skeleton with these integers in its cuts: parts and cuts in turn.
    whole: list[bytes] = [b""] * (2 * len(skeleton) - 1)
    whole[0::2] = skeleton
    whole[1 : 4 * n : 4] = [start_bytes] * n
    whole[3 : 4 * n : 4] = [stop_bytes] * n
    whole[-2] = packed[at : at + width]
    if b"".join(whole) != packed:
        return None
    return [start[0], stop[0]] * n + [checksum[0]]


def _uint_at(packed: bytes, pos: int) -> tuple[int, int] | None:
    """The unsigned msgpack integer at ``pos`` of ``packed`` and its width in bytes;
    ``None`` when none is there."""
    if pos >= len(packed):
        return None
    first = packed[pos]
    width = _WIDTHS[first]
    if width == 1:
        return first, 1
    if not width or pos + width > len(packed):
        return None
    return int.from_bytes(packed[pos + 1 : pos + width], "big"), width


#: How many bytes an unsigned msgpack integer takes, by its first byte (0: not one).
_WIDTHS = bytes(
    1 if b < 0x80 else {0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9}.get(b, 0) for b in range(256)
)
#: Templates tried per header before it is parsed in full.
_TRIES = 4


def _filled(
    op: str, template: Template, values: list[int]
) -> tuple[dict[str, Any], tuple[LayerEntry | None, ...], int] | None:
    # C loops, as in header_parse: the cuts are each present layer's start and stop,
    # in order, then the checksum (_cuts_are_ranges proved it on the template).
    starts, stops = values[0:-1:2], values[1:-1:2]
    if not (all(map(le, starts, stops)) and max(stops, default=0) <= MAX_INT):
        return None
    entries = list(map(_in_range, template.present, starts, stops))
    # One of each distinct description: check_layers' own rule for the rest.
    checks = dict(zip(zip(template.kinds, starts, stops), entries))
    try:
        check_layers(op, list(checks.values()))
    except CorruptEntryError:
        return None
    if len(entries) == len(template.layers):
        return template.fields, tuple(entries), values[-1]
    built = iter(entries)
    layers = tuple(None if layer is None else next(built) for layer in template.layers)
    return template.fields, layers, values[-1]


def _in_range(entry: LayerEntry, start: int, stop: int) -> LayerEntry:
    """``entry`` covering ``[start, stop)`` (itself when it already does)."""
    if entry.start == start and entry.stop == stop:
        return entry
    # Its fields copied and the two replaced: 0.24 us against 0.42 through __init__, for
    # each of a 32-layer header's layers (an entry is a frozen dataclass of plain fields).
    ranged = _NEW(LayerEntry)
    fields = ranged.__dict__
    fields.update(entry.__dict__)
    fields["start"], fields["stop"] = start, stop
    return ranged


_NEW = object.__new__


def forget() -> None:
    """Drop every template (benchmarks measuring a first read call this)."""
    with _LOCK:
        _TEMPLATES.clear()
