"""A record's prefix and header: the layout's constants, a header's parse with every
check made before a field it covers is trusted, and the parses remembered.

The layout is :mod:`kvstore.codecs.record`'s docstring. A header is read far more often
than it is new: a restore parses the headers the store's checks parsed a moment before,
and a prefix restored again and again (a shared system prompt) has the same headers each
time, so each distinct header's parse is made once and kept (:func:`read`), and while a
reader parses its own records' headers the checks on other threads wait for it rather
than parse them beside it (:func:`reader_parses`).
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain, compress
from operator import add, attrgetter, le
from typing import Any

import msgpack
import xxhash

from kvstore.codecs import header_template
from kvstore.codecs.header import (
    BOUNDS,
    SUPPORTED_VERSIONS,
    LayerEntry,
    check_format,
    corrupt,
    is_int,
    is_map,
    parse_fields,
)
from kvstore.codecs.header_parse import forget_tensor_tables, parse_header
from kvstore.knobs import switch_from_env

__all__ = [
    "MAGIC",
    "ALIGN",
    "CHECKSUM_ALGORITHM",
    "PREFIX",
    "SUMMED_PREFIX_BYTES",
    "RecordHeader",
    "align",
    "payload_offset",
    "read",
    "reader_parses",
    "forget_parsed_headers",
]

MAGIC = b"KVST"
ALIGN = 64
CHECKSUM_ALGORITHM = "xxh3-64"
PREFIX = struct.Struct("<4sHHIQ")
SUMMED_PREFIX_BYTES = (
    12  # magic, version, flags, header length: the bytes the header checksum covers
)

# Parsed headers, each with its exact bytes (prefix included), by the header's own
# checksum (checked before): a record verified by the store and then decoded by a
# restore is parsed once, and a prefix restored again and again (a shared system
# prompt) not at all. Parsing is a pure function of these bytes, and a hit is one whose
# bytes are equal, so it is exactly what a parse would return. (Keyed by the bytes
# themselves, each lookup hashed them anew: ~30 us for a 36 KB TurboQuant header, a
# quarter of its parse from a template; compared, ~1 us.)
_PARSED: dict[int, tuple[bytes, RecordHeader]] = {}
_PARSED_LIMIT = 512
#: Headers being parsed now, by their checksum (see :func:`_parsed_once`).
_PARSING: dict[int, threading.Event] = {}
_PARSED_LOCK = threading.Lock()
#: Headers a reader parses next, by their checksum: the event set when it is done with
#: them, and its thread (see :func:`reader_parses`).
_PROMISED: dict[int, tuple[threading.Event, int]] = {}
#: Whether checks wait for the headers a reader promised (:func:`reader_parses`;
#: ``KVSTORE_READER_PARSES=0``: they parse whichever they reach first, as before).
READER_PARSES = switch_from_env("KVSTORE_READER_PARSES")


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def payload_offset(header_length: int) -> int:
    """Where the payload starts: after the prefix and a header of ``header_length``
    bytes, at the next aligned offset (the writer pads with zeros up to it)."""
    return align(PREFIX.size + header_length)


@dataclass(frozen=True)
class RecordHeader:
    """A record's parsed header: enough to list, inspect and locate, no payload touched."""

    format: int
    flags: int
    writer: str
    layers: tuple[LayerEntry | None, ...]
    meta: Mapping[str, Any]
    payload_offset: int
    payload_nbytes: int
    checksum: int

    @property
    def nbytes(self) -> int:
        """The record's total length."""
        return self.payload_offset + self.payload_nbytes


def read(view: memoryview, op: str) -> RecordHeader:
    """The header of record ``view`` (at least its prefix and header), every check made:
    the magic, the header's checksum before any field it covers, the version, the
    bounds and schema; remembered by its bytes.

    Raises:
        CorruptEntryError: anything wrong with these bytes.
        FormatVersionError: a format (or codec version) this reader does not read.
    """
    if len(view) < PREFIX.size:
        raise corrupt(op, f"A record is at least {PREFIX.size} bytes; received {len(view)}.")
    magic, version, flags, length, header_sum = PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise corrupt(op, f"Not a kvstore record: magic {bytes(magic)!r}, expected {MAGIC!r}.")
    # The checksum covers the version: it is checked first, so a flipped version
    # is damage (a corrupt miss), and only an intact record can be "newer" (#18).
    # The prefix is the same in every format version; a newer header may be larger.
    if version in SUPPORTED_VERSIONS and length > BOUNDS.header_bytes:
        raise corrupt(op, f"Header length {length} exceeds the bound {BOUNDS.header_bytes}.")
    end = PREFIX.size + length
    if len(view) < end:
        raise corrupt(op, f"Truncated: the header needs {end} bytes; received {len(view)}.")
    hasher = xxhash.xxh3_64(view[:SUMMED_PREFIX_BYTES])
    hasher.update(view[PREFIX.size : end])
    if hasher.intdigest() != header_sum:
        raise corrupt(
            op,
            f"Header checksum mismatch: stored {header_sum:#018x}, "
            f"computed {hasher.intdigest():#018x}.",
            stored=header_sum,
            computed=hasher.intdigest(),
        )
    check_format(op, version)
    if length > BOUNDS.header_bytes:
        raise corrupt(op, f"Header length {length} exceeds the bound {BOUNDS.header_bytes}.")
    if flags != 0:
        raise corrupt(op, f"Flags {flags:#06x} are set; format 1 defines none.")
    header = view[:end]
    parsed = _parsed_before(header_sum, header)
    if parsed is None and op == "verify":
        parsed = _promised(header_sum, header)
    if parsed is None:
        raw = bytes(header)
        parsed = _parsed_once(
            header_sum,
            raw,
            lambda: (
                _from_template(op, raw[PREFIX.size :], version, flags, length)
                or _parse_header(
                    op, view[PREFIX.size : end], version, flags, payload_offset(length)
                )
            ),
            wait=op == "verify",
        )
    return parsed


@contextmanager
def reader_parses(buffers: Sequence[Any]) -> Iterator[None]:
    """Within, the calling thread parses the headers of ``buffers`` (records, in the
    order it reads them), and a check (``verify``) on another thread that reaches one of
    them first waits for that parse instead of making its own: a restore's checks hash
    each record and then parse its header, holding the GIL the restore's own thread
    needs for the same parses (H200, TurboQuant 4/4, 4096 tokens: its headers took
    5.9 ms of wall for 2.9 of its CPU, ``tools/bench/results/gpu/d0ceccd/ab-early.txt``),
    and a parse the reader finds under way on a check's thread it makes again rather
    than queue behind the checks for the GIL (:func:`_parsed_once`). When the block
    ends, the checks parse any of them the reader did not (one that failed to parse,
    or after it)."""
    done, me = threading.Event(), threading.get_ident()
    mine = []
    if READER_PARSES:
        with _PARSED_LOCK:
            for buffer in buffers:
                try:
                    header_sum = PREFIX.unpack_from(buffer)[4]
                except (struct.error, TypeError, ValueError):
                    continue  # not a record (or released): its check says why, unhindered
                if header_sum not in _PROMISED:
                    _PROMISED[header_sum] = (done, me)
                    mine.append(header_sum)
    try:
        yield
    finally:
        with _PARSED_LOCK:
            for header_sum in mine:
                del _PROMISED[header_sum]
        done.set()


def _promised(header_sum: int, header: memoryview) -> RecordHeader | None:
    """The parse of a header a reader on another thread promised (:func:`reader_parses`),
    once it is done with its headers; ``None`` when none promised it, or the reader
    did not parse it."""
    promise = _PROMISED.get(header_sum)
    if promise is None or promise[1] == threading.get_ident():
        return None
    promise[0].wait()
    return _parsed_before(header_sum, header)


def _parsed_before(header_sum: int, header: memoryview) -> RecordHeader | None:
    """The parse of a header of exactly these bytes (``header_sum``: its checksum),
    remembered; ``None`` if none is."""
    found = _PARSED.get(header_sum)
    if found is None:
        return None
    raw, parsed = found
    # startswith is one memcmp; == between bytes and a memoryview compares byte by byte.
    return parsed if len(raw) == len(header) and raw.startswith(header) else None


def _from_template(
    op: str, packed: bytes, version: int, flags: int, length: int
) -> RecordHeader | None:
    """The header ``packed`` read from an earlier one of its layout
    (:mod:`~kvstore.codecs.header_template`); ``None`` when none vouches for it."""
    filled = header_template.fill(op, version, packed)
    if filled is None:
        return None
    f, layers, checksum = filled
    return _record_header(version, flags, f, layers, payload_offset(length), checksum)


def _record_header(
    version: int,
    flags: int,
    fields: Mapping[str, Any],
    layers: tuple[LayerEntry | None, ...],
    payload_offset: int,
    checksum: int,
) -> RecordHeader:
    """The parsed header of a record: its checked ``fields`` and ``layers``, and the rest."""
    return RecordHeader(
        version,
        flags,
        fields["writer"],
        layers,
        fields["meta"],
        payload_offset,
        fields["payload_nbytes"],
        checksum,
    )


def _parsed_once(
    header_sum: int, raw: bytes, parse: Callable[[], RecordHeader], *, wait: bool
) -> RecordHeader:
    """``parse()`` of header ``raw`` (``header_sum``: its checksum), remembered. A thread
    that finds the same header being parsed by another waits for that parse when
    ``wait`` (the store's checks: nothing waits for them until a read ends), else parses
    it too (a reader): a restore on a GPU parses its headers while the checks, on a
    dozen other threads, parse the same ones, and the reader's wait for a parse on one
    of those queued behind the rest of them for the GIL (H200, TurboQuant 4/4, 4096
    tokens: its 16 parses took 5-7 ms of wall for 1.8 of its CPU;
    ``tools/bench/results/gpu/d1643e2/``). Parsed twice, they once queued on the GIL for
    28 ms where one parse of each took 16 (before a header's template made a parse tens
    of microseconds): the checks never parse one twice."""
    with _PARSED_LOCK:
        parsed = _parsed_before(header_sum, memoryview(raw))
        if parsed is not None:
            return parsed
        running = _PARSING.get(header_sum)
        mine = running is None
        if running is None:
            running = _PARSING[header_sum] = threading.Event()
    if not mine:
        if not wait:
            return parse()
        running.wait()
        parsed = _parsed_before(header_sum, memoryview(raw))
        # its parse raised (so does this), or it was of other bytes with this checksum
        return parsed if parsed is not None else parse()
    try:
        parsed = parse()
        with _PARSED_LOCK:
            if len(_PARSED) >= _PARSED_LIMIT:
                _PARSED.clear()  # crude, but bounded
            _PARSED[header_sum] = (raw, parsed)
        return parsed
    finally:
        with _PARSED_LOCK:
            del _PARSING[header_sum]
        running.set()


def _parse_header(
    op: str, packed: memoryview, version: int, flags: int, payload_offset: int
) -> RecordHeader:
    try:
        obj = msgpack.unpackb(
            packed,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=BOUNDS.str_len,
            max_bin_len=BOUNDS.bin_len,
            max_array_len=BOUNDS.array_len,
            max_map_len=BOUNDS.map_len,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises a dozen types; all mean "not a header"
        raise corrupt(op, f"The header is not valid msgpack: {type(exc).__name__}: {exc}.") from exc
    f, layers = parse_header(
        op, obj, located=True, extra={"payload_nbytes": is_int, "checksum": is_map}
    )
    if f["format"] != version:
        raise corrupt(op, f"Header format {f['format']} disagrees with the prefix's {version}.")
    check = parse_fields(
        op,
        f["checksum"],
        "header.checksum",
        {"algorithm": lambda v: v == CHECKSUM_ALGORITHM, "value": _is_u64},
    )
    _check_extents(op, layers, f["payload_nbytes"])
    header_template.learn(version, bytes(packed), f, layers, check["value"])
    return _record_header(version, flags, f, layers, payload_offset, check["value"])


def _is_u64(value: Any) -> bool:
    return type(value) is int and 0 <= value < 1 << 64


def _check_extents(op: str, layers: Sequence[LayerEntry | None], payload_nbytes: int) -> None:
    tensors = list(chain.from_iterable(map(_TENSORS, filter(None, layers))))
    offsets = list(map(_OFFSET, tensors))
    ends = list(map(add, offsets, map(_NBYTES, tensors)))
    sized = list(map(_NBYTES, tensors))
    starts, stops = list(compress(offsets, sized)), list(compress(ends, sized))
    # The usual layout, checked by C loops: aligned, inside, and each tensor with bytes
    # after the one before it (so in sorted order, none overlapping).
    if (
        not any(map(ALIGN.__rmod__, offsets))
        and max(ends, default=0) <= payload_nbytes
        and all(map(le, stops, starts[1:]))
    ):
        return
    for i, layer in enumerate(layers):
        for t in layer.tensors if layer is not None else ():
            if t.offset % ALIGN or t.offset + t.nbytes > payload_nbytes:
                raise corrupt(
                    op,
                    f"layers[{i}] tensor '{t.name}' at [{t.offset}, {t.offset + t.nbytes}) is "
                    f"misaligned or outside the {payload_nbytes}-byte payload.",
                )
    extents = sorted(zip(starts, stops, strict=True))
    for (_, end), (start, _) in zip(extents, extents[1:], strict=False):
        if start < end:
            raise corrupt(op, "Two tensors overlap in the payload.")


_OFFSET, _NBYTES, _TENSORS = attrgetter("offset"), attrgetter("nbytes"), attrgetter("tensors")


def forget_parsed_headers(*, keep_templates: bool = False) -> None:
    """Drop the remembered header parses, and the tensor tables they share
    (benchmarks measuring a first read call this); ``keep_templates``: only the
    parses (a session whose warm-up read a header of the same layout)."""
    _PARSED.clear()
    if not keep_templates:
        forget_tensor_tables()
        header_template.forget()
