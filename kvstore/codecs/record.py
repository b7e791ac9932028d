"""The record: one stored value holding every layer of a model for one block of tokens.

Layout (little-endian; DESIGN.md section 3)::

    offset 0   magic "KVST"
           4   u16 format version (1)
           6   u16 flags (none defined in format 1: must be 0)
           8   u32 header length H
          12   u64 xxh3-64 of bytes [0, 12) and of the header
          20   msgpack header, H bytes
               zero padding to a multiple of 64
          P    payload: each tensor's bytes, every tensor 64-byte aligned
               (offsets relative to P), zero padding between them

    header = {"format": 1, "writer": "kvstore 0.1.0",
              "layers": [None | layer entry (see kvstore.codecs.header)],
              "meta": {...}, "payload_nbytes": N,
              "checksum": {"algorithm": "xxh3-64", "value": <u64 of the payload>}}

Both checksums are verified on every decode, the header's before any field
it covers is interpreted (the version and flags included), so a flipped bit
anywhere is a ``CorruptEntryError``, never data, and never a "newer format":
only an intact record of a higher version is a ``FormatVersionError`` (the header's
parse, and the parses remembered: :mod:`kvstore.codecs.record_header`). The
20-byte prefix (magic, version, flags, header length, header checksum) is the
same in every format version, so a reader can check a newer record's checksum
before it refuses the record's version.
Tensors come back as numpy views into the caller's buffer (zero copy; the
buffer must outlive them); :func:`snapshot_to_mlx` and
:func:`decode_record_to_mlx` then copy into MLX memory exactly once.

.. versionchanged:: 0.1 format 1.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import msgpack
import numpy as np
import xxhash

from kvstore.abc.codec import Snapshot
from kvstore.abc.placement import Placement
from kvstore.codecs import cuda, cuda_pages, record_header
from kvstore.codecs.arrays import (
    MLX_DTYPES,
    as_mlx,
    as_numpy_all,
    contiguous_chunks,
    numpy_dtype,
)
from kvstore.codecs.copied_sums import digest_of, taking_digests
from kvstore.codecs.header import (
    BOUNDS,
    FORMAT_VERSION,
    check_bounds,
    corrupt,
    layer_entry,
    tensor_manifest,
    writer,
)
from kvstore.codecs.payload_tensors import Payload, PayloadTensors, numpy_view
from kvstore.codecs.record_header import (
    ALIGN,
    CHECKSUM_ALGORITHM,
    MAGIC,
    PREFIX,
    SUMMED_PREFIX_BYTES,
    RecordHeader,
    align,
    forget_parsed_headers,
    payload_offset,
    reader_parses,
)
from kvstore.codecs.snapshot_meta import note_checked
from kvstore.errors import CorruptEntryError, FormatVersionError

__all__ = [
    "MAGIC",
    "ALIGN",
    "CHECKSUM_ALGORITHM",
    "RecordHeader",
    "Record",
    "RecordPlan",
    "plan_record",
    "encode_record",
    "write_record",
    "device_payload",
    "decode_record",
    "decode_record_to_mlx",
    "decode_records_on_device",
    "read_header",
    "reader_parses",
    "snapshot_to_mlx",
    "verify_record",
    "record_payload",
    "placed_payload",
    "checkpoint_nbytes",
    "forget_parsed_headers",
]

# Below this a second thread for the checksum costs more than it saves.
_PARALLEL_CHECKSUM_BYTES = 4 << 20
# Largest copy into MLX memory when its buffer cache is cold: measured on Linux,
# 8 MiB pieces land in reused heap memory, while one 512 MiB piece faults every
# page fresh (4x slower).
_SEGMENT_BYTES = 8 << 20


@dataclass(frozen=True)
class Record:
    """A decoded record: its header and one snapshot per layer (``None`` where absent)."""

    header: RecordHeader
    layers: list[Snapshot | None]


# -- encode ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RecordPlan:
    """A record laid out before its bytes exist: the header entries with every
    tensor's payload offset, and the tensors in payload order.

    :func:`encode_record` turns it into ``bytes``; :func:`write_record` writes it
    into a caller's buffer (a reused arena: no fresh pages to fault in), and
    :func:`device_payload` builds its payload on the device its tensors are on.
    """

    entries: tuple[dict[str, Any] | None, ...]
    tensors: tuple[tuple[Any, int], ...]
    payload_nbytes: int
    meta: Mapping[str, Any]
    #: Per layer, what its entry was made from besides the range (``None`` where
    #: absent): ``(signature, meta, ((name, shape, dtype), ...))`` -- what
    #: :func:`plan_record`'s ``like`` compares.
    layouts: tuple[tuple[Any, ...] | None, ...]
    #: The plan whose header differs from this one's in integers only (a layout lent by
    #: ``plan_record(like=...)``): its bound check is this one's.
    checked_as: RecordPlan | None = field(default=None, compare=False, repr=False)

    def _header(self, checksum: int) -> dict[str, Any]:
        return {
            "format": FORMAT_VERSION,
            "writer": writer(),
            "layers": list(self.entries),
            "meta": dict(self.meta),
            "payload_nbytes": self.payload_nbytes,
            "checksum": {"algorithm": CHECKSUM_ALGORITHM, "value": checksum},
        }

    def head(self, checksum: int) -> bytes:
        """Prefix, header and zero padding: everything before the payload."""
        header = self._header(checksum)
        try:
            packed = msgpack.packb(header, use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as exc:
            raise TypeError(f"[encode_record] The header is not msgpack-able: {exc}.") from exc
        self._within_bounds  # noqa: B018 - what we write, we must be able to read
        if len(packed) > BOUNDS.header_bytes:
            raise ValueError(
                f"[encode_record] The header is {len(packed)} bytes; records allow "
                f"{BOUNDS.header_bytes}. Store fewer layers or less meta per record."
            )
        fixed = PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(packed), 0)[:SUMMED_PREFIX_BYTES]
        header_sum = xxhash.xxh3_64_intdigest(fixed + packed)
        head = PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(packed), header_sum) + packed
        return head + bytes(payload_offset(len(packed)) - len(head))

    @functools.cached_property
    def _within_bounds(self) -> bool:
        """Checked once per plan: a head differs from another of the plan by its
        checksum alone, an integer, so :meth:`head`'s two calls per record (the widest
        checksum's, then the real one's) walked the same header twice (qwen-0.5B, 8192
        tokens: 64 walks, ~9 ms of a 127 ms save on the VM).

        Raises:
            ValueError: the header is past a bound of the format.
        """
        if self.checked_as is not None:  # no bound on integers: the same walk
            return self.checked_as._within_bounds
        try:
            check_bounds("encode_record", self._header(0))
        except CorruptEntryError as exc:
            raise ValueError(f"{exc} Store less meta per record.") from exc
        return True

    @functools.cached_property
    def head_nbytes_bound(self) -> int:
        """Where the payload goes: the length of the head with the widest checksum (the
        real one's, or a little more). Packed once per plan: a save asks it of each
        record three times (the arena's layout, the pending record's bound, the write)."""
        return len(self.head(_WIDEST_CHECKSUM))

    @property
    def nbytes_bound(self) -> int:
        """The record's length, or a little more (the header with the widest checksum)."""
        return self.head_nbytes_bound + self.payload_nbytes


# A u64 msgpack packs in 9 bytes at most: a header laid out with this checksum is
# never shorter than the real one.
_WIDEST_CHECKSUM = (1 << 64) - 1


def plan_record(
    layers: Sequence[Snapshot | None],
    *,
    meta: Mapping[str, Any] | None = None,
    like: RecordPlan | None = None,
) -> RecordPlan:
    """Lay ``layers`` out as a record (no tensor data is read).

    ``like``: a plan whose layers differ from ``layers`` at most in their ranges (a
    save's blocks, cut alike from the same caches) lends its layout: the entries are
    copied with the new ranges and its bound check stands, where a plan made afresh
    cost a qwen-0.5B record ~0.55 ms of Python (32 of them in an 8192-token save). Any
    other difference plans afresh.

    Raises:
        UnknownSignatureError: a snapshot of a kind no codec serves.
        TypeError: a tensor of a dtype records do not carry.
    """
    record_meta = dict(meta or {})
    if like is not None:
        moved = _moved_plan(like, layers, record_meta)
        if moved is not None:
            return moved
    entries: list[dict[str, Any] | None] = []
    layouts: list[tuple[Any, ...] | None] = []
    tensors: list[tuple[Any, int]] = []
    end = 0
    for snap in layers:
        if snap is None:
            entries.append(None)
            layouts.append(None)
            continue
        manifest = tensor_manifest(snap)
        for entry, array in zip(manifest, snap.tensors.values(), strict=True):
            start = align(end)
            # math.prod of the shape's ints: np.prod was ~4 us a tensor, half of a plan.
            nbytes = math.prod(entry["shape"]) * numpy_dtype(entry["dtype"]).itemsize
            entry.update(offset=start, nbytes=nbytes)
            tensors.append((array, start))
            end = start + nbytes
        entries.append(layer_entry(snap, manifest))
        layouts.append(_layout(snap))
    return RecordPlan(tuple(entries), tuple(tensors), end, record_meta, tuple(layouts))


def _layout(snap: Snapshot) -> tuple[Any, ...]:
    """What a layer's entry is made of besides its range (see :attr:`RecordPlan.layouts`)."""
    arrays = tuple((name, a.shape, a.dtype) for name, a in snap.tensors.items())
    return (snap.signature, snap.meta, arrays)


def _same_dtype(array: Any, dtype: Any) -> bool:
    """``array``'s dtype is ``dtype``: for numpy the object itself (its equality ignores
    the tag that makes uint16 words bfloat16, :func:`~kvstore.codecs.arrays.dtype_name`;
    a view shares its base's object), for MLX equal (no tags there)."""
    own = array.dtype
    return own is dtype or (type(array) is mx.array and own == dtype)


def _moved_plan(
    like: RecordPlan, layers: Sequence[Snapshot | None], meta: dict[str, Any]
) -> RecordPlan | None:
    """``like``'s layout with the ranges of ``layers``, or ``None`` where a layer differs
    in anything else: its signature, meta, tensor names, shapes or dtypes."""
    if meta != like.meta or len(layers) != len(like.layouts):
        return None
    entries: list[dict[str, Any] | None] = []
    arrays: list[Any] = []
    for snap, layout, entry in zip(layers, like.layouts, like.entries, strict=True):
        if snap is None or layout is None:
            if snap is not layout:  # both absent, or not alike
                return None
            entries.append(None)
            continue
        signature, snap_meta, named = layout
        if snap.signature != signature or snap.meta != snap_meta:
            return None
        tensors = snap.tensors
        if len(tensors) != len(named):
            return None
        for (name, shape, dtype), (own, array) in zip(named, tensors.items(), strict=True):
            if own != name or array.shape != shape or not _same_dtype(array, dtype):
                return None
            arrays.append(array)
        assert entry is not None  # a layer with a layout has an entry
        moved = dict(entry)
        # The meta as layer_entry makes it, from this snapshot: equal is not the same
        # header (1 == 1.0 == True pack apart), though within the same bounds.
        moved.update(start=int(snap.start), stop=int(snap.stop), meta=dict(snap.meta))
        entries.append(moved)
    tensors_at = tuple(zip(arrays, (offset for _, offset in like.tensors), strict=True))
    checked = like.checked_as or like
    return RecordPlan(tuple(entries), tensors_at, like.payload_nbytes, meta, like.layouts, checked)


def encode_record(
    layers: Sequence[Snapshot | None], *, meta: Mapping[str, Any] | None = None
) -> bytes:
    """One record holding ``layers`` (a snapshot per layer, ``None`` where absent).

    Each tensor's bytes are copied once, straight from the (possibly strided)
    source into the returned ``bytes``.

    Args:
        layers: the snapshots; layers may have different signatures.
        meta: msgpack-able user metadata (token ids, model fingerprint...).

    Raises:
        UnknownSignatureError: a snapshot of a kind no codec serves.
        TypeError: a tensor of a dtype records do not carry, or meta that
            msgpack cannot encode.
        ValueError: the header would exceed the format's bounds.
    """
    plan = plan_record(layers, meta=meta)
    views = as_numpy_all([array for array, _ in plan.tensors])
    chunks: list[Any] = []
    end = 0
    for view, (_, offset) in zip(views, plan.tensors, strict=True):
        if offset > end:
            chunks.append(bytes(offset - end))
        chunks.extend(contiguous_chunks(view))
        end = offset + view.nbytes
    hasher = xxhash.xxh3_64()
    for chunk in chunks:
        hasher.update(chunk)
    return b"".join([plan.head(hasher.intdigest()), *chunks])


#: With a placement, the payload is hashed and handed over in parts of about this many
#: bytes as it is written (``tools/bench/save_parts.py``): the disk starts on a record's
#: first part while the rest is still being copied.
PART_BYTES = 4 << 20


def write_record(
    plan: RecordPlan,
    out: np.ndarray,
    *,
    payload_written: bool = False,
    placement: Placement | None = None,
) -> int:
    """Write the record of ``plan`` at the start of ``out`` (a uint8 buffer of at
    least ``plan.nbytes_bound`` bytes); returns its length.

    With ``payload_written``, the payload is already in place at
    ``len(plan.head(widest checksum))`` (a device wrote it there); otherwise the
    tensors are copied in (one copy each, from wherever they are). With
    ``placement``, each part of the payload is handed to it as soon as it is written
    and hashed (about :data:`PART_BYTES` each), and the head last.
    """
    planned = plan.head_nbytes_bound
    payload = out[planned : planned + plan.payload_nbytes]
    parts = _Parts(payload, planned, placement)
    if not payload_written:
        views = as_numpy_all([array for array, _ in plan.tensors])
        end = 0
        for view, (_, offset) in zip(views, plan.tensors, strict=True):
            payload[end:offset] = 0
            target = payload[offset : offset + view.nbytes].view(view.dtype).reshape(view.shape)
            np.copyto(target, view, casting="no")
            end = offset + view.nbytes
            parts.reached(end)
        payload[end:] = 0
    head = plan.head(parts.digest())
    if len(head) != planned:  # a checksum that packs shorter moved the payload: rare
        if placement is not None:
            placement.moved = True
        out[len(head) : len(head) + plan.payload_nbytes] = payload.copy()
    out[: len(head)] = np.frombuffer(head, np.uint8)
    if placement is not None:
        placement.written(0, memoryview(out[: len(head)]))  # type: ignore[arg-type]
    return len(head) + plan.payload_nbytes


class _Parts:
    """A payload hashed in the order it is written, and, with a placement, handed over
    a part at a time (:data:`PART_BYTES`); without one, hashed whole at the end."""

    __slots__ = ("_payload", "_at", "_placement", "_hasher", "_done")

    def __init__(self, payload: np.ndarray, at: int, placement: Placement | None) -> None:
        self._payload, self._at, self._placement = payload, at, placement
        self._hasher = xxhash.xxh3_64() if placement is not None else None
        self._done = 0  # bytes hashed and handed over

    def reached(self, end: int) -> None:
        """Every byte of the payload before ``end`` is written."""
        if self._hasher is not None and end - self._done >= PART_BYTES:
            self._hand_over(end)

    def digest(self) -> int:
        """The payload's xxh3-64, every byte of it handed over."""
        if self._hasher is None:
            return xxhash.xxh3_64_intdigest(self._payload.data)
        size = self._payload.nbytes
        while self._done < size:  # a payload a device wrote whole: in parts all the same
            self._hand_over(min(size, self._done + PART_BYTES))
        return int(self._hasher.intdigest())

    def _hand_over(self, end: int) -> None:
        assert self._hasher is not None and self._placement is not None
        part = memoryview(self._payload[self._done : end])  # type: ignore[arg-type]
        if part.nbytes:
            self._hasher.update(part)  # just written: still in the CPU's cache
            self._placement.written(self._at + self._done, part)
        self._done = end


def device_payload(plan: RecordPlan) -> mx.array:
    """The payload of ``plan`` as one uint8 MLX array, built where its tensors are
    (``mx.array`` s: on a GPU, nothing crosses the bus until it is downloaded)."""
    parts: list[mx.array] = []
    end = 0
    for array, offset in plan.tensors:
        if offset > end:
            parts.append(mx.zeros((offset - end,), mx.uint8))
        flat = as_mlx(array).reshape(-1)
        parts.append(flat.view(mx.uint8))
        end = offset + flat.nbytes
    if not parts:
        return mx.zeros((0,), mx.uint8)
    return parts[0] if len(parts) == 1 else mx.concatenate(parts)


# -- decode ------------------------------------------------------------------------------


def read_header(buffer: Any) -> RecordHeader:
    """Parse and check a record's header without touching its payload.

    ``buffer`` needs to hold at least the fixed prefix and the header.

    Raises:
        CorruptEntryError: wrong magic, bad header checksum, bounds, schema.
        FormatVersionError: a format (or header field, or codec version)
            this reader does not read.
    """
    return record_header.read(_bytes_view(buffer, "read_header"), "read_header")


def checkpoint_nbytes(buffer: Any) -> int:
    """Payload bytes of the record's recurrent checkpoints: the layers that cover no
    rows (``start == stop``, a state at one position; issue 16). 0 for a record
    without any, or bytes that are not a record this reader parses."""
    try:
        header = read_header(buffer)
    except (CorruptEntryError, FormatVersionError):
        return 0
    return sum(
        t.nbytes
        for layer in header.layers
        if layer is not None and layer.start == layer.stop
        for t in layer.tensors
    )


def decode_record(
    buffer: Any,
    *,
    verify: bool = True,
    lazy_layers: Container[int] = (),
    header: RecordHeader | None = None,
) -> Record:
    """Decode a record; tensors are numpy views into ``buffer`` (zero copy).

    bfloat16 tensors come back as tagged ``uint16`` words
    (:data:`kvstore.codecs.arrays.BFLOAT16_WORDS`). ``buffer`` (bytes,
    memoryview, mmap, an LMDB value...) must outlive the views.

    Args:
        buffer: the whole record.
        verify: check the payload checksum (only skip it for bytes you
            verified yourself).
        lazy_layers: layers whose tensors are a
            :class:`~kvstore.codecs.payload_tensors.PayloadTensors` (each view made
            when asked; a gather reads where they lie without one).
        header: what :func:`read_header` returned for these same bytes (a restore
            has parsed them already: not parsed again).

    Raises:
        CorruptEntryError: anything wrong with the bytes; ``stored`` and
            ``computed`` attributes on a checksum mismatch.
        FormatVersionError: a format this reader does not read.
    """
    view = _bytes_view(buffer, "decode_record")
    if header is None:
        header = record_header.read(view, "decode_record")
    payload = _payload(view, header, "decode_record")
    if verify:
        _verify(header, xxhash.xxh3_64_intdigest(payload), "decode_record")
    stored = Payload(payload) if lazy_layers else None
    return Record(header, _snapshots(header, lambda t: numpy_view(payload, t), lazy_layers, stored))


def record_payload(buffer: Any, header: RecordHeader) -> Payload:
    """The payload of record ``buffer`` whose header ``header`` is (parsed already), as
    :func:`decode_record` checks it (length, padding) but not its checksum: for a
    reader that locates tensors from the header itself
    (:mod:`~kvstore.codecs.alike_joins`).

    Raises:
        CorruptEntryError: the record's length or padding is not what its header says.
    """
    return Payload(_payload(_bytes_view(buffer, "decode_record"), header, "decode_record"))


@taking_digests
def verify_record(buffer: Any) -> None:
    """Raise unless ``buffer`` is an intact record this reader reads.

    Checks what :func:`decode_record` checks (prefix, header checksum, header
    schema and bounds, codec versions, layout, payload checksum) without
    building snapshots: the ``verify`` a prefix store of records is opened with
    (:func:`kvstore.store.open_store` uses it by default). The parsed header is
    remembered, so decoding the record next costs no second parse.

    Raises:
        CorruptEntryError: anything wrong with the bytes.
        FormatVersionError: a format (or codec version) this reader does not read.
    """
    view = _bytes_view(buffer, "verify")
    # The payload is hashed before the header is parsed: xxhash releases the GIL and
    # the parse holds it, so checks on several threads hash at once while the reader
    # parses the same headers (a restore on a GPU: its parse is remembered here).
    # A restore copying the record's rows may hash them as it goes (copied_sums).
    computed = digest_of(view, _payload_digest)
    header = record_header.read(view, "verify")
    payload = _payload(view, header, "verify")
    if computed is None:
        computed = xxhash.xxh3_64_intdigest(payload)
    _verify(header, computed, "verify")


def decode_record_to_mlx(buffer: Any) -> Record:
    """Decode a record straight into MLX memory: one copy of the payload.

    The checksum runs on a second thread while the payload is copied (xxhash
    releases the GIL), and is checked before anything is returned. Tensors
    are views into owned MLX buffers, not into ``buffer``.

    Raises:
        CorruptEntryError, FormatVersionError: as :func:`decode_record`.
    """
    view = _bytes_view(buffer, "decode_record")
    header = record_header.read(view, "decode_record")
    payload = _payload(view, header, "decode_record")
    computed: list[int] = []
    worker = None
    if len(payload) >= _PARALLEL_CHECKSUM_BYTES:
        worker = threading.Thread(target=lambda: computed.append(xxhash.xxh3_64_intdigest(payload)))
        worker.start()
    else:
        computed.append(xxhash.xxh3_64_intdigest(payload))
    try:
        words = np.frombuffer(payload, dtype=np.uint8)
        segments = [(a, b, mx.array(words[a:b])) for a, b in _segments(header)]
        mx.eval([array for _, _, array in segments])
    finally:
        if worker is not None:
            worker.join()
    _verify(header, computed[0], "decode_record")

    def tensor(entry: Any) -> mx.array:
        if not entry.nbytes:
            return _mlx_tensor(entry, None)
        start, _, flat = next(seg for seg in segments if seg[0] <= entry.offset < seg[1])
        return _mlx_tensor(entry, flat, start)

    record = Record(header, _snapshots(header, tensor))
    mx.eval([a for snap in record.layers if snap is not None for a in snap.tensors.values()])
    return record


def decode_records_on_device(buffers: Sequence[Any]) -> list[Record]:
    """Verified records decoded with every tensor on the CUDA device.

    Each record's payload crosses the bus whole, on every staging thread at
    once (:func:`kvstore.codecs.cuda.upload`: one contiguous copy into a
    pinned slot, one kernel); tensors are views into those device buffers,
    so joining a layer's rows and decoding lossy ones happen there, not on
    the host (measured on an H200, 4096 tokens of llama-8B in 16 records:
    64 per-layer arrays gathered on the host took 54 ms to stage; the issue 13
    profile, ``tools/bench/gpu/restore_profile.py``). Where the gather route
    can take them (:func:`kvstore.codecs.cuda_pages.gathered`), the GPU reads each
    payload from the buffers' own pages instead. (A restore whose pages are pinned
    gathers its lossy rows in :func:`kvstore.codecs.plans.join_runs`, not here.)
    The checksums are not checked again: only for bytes the caller verified (a
    store's ``read``).

    Raises:
        RuntimeError: no CUDA staging here.
        CorruptEntryError, FormatVersionError: a header that does not parse.
    """
    views = [_bytes_view(buffer, "decode_record") for buffer in buffers]
    headers = [record_header.read(view, "decode_record") for view in views]
    payloads = [_payload(v, h, "decode_record") for v, h in zip(views, headers, strict=True)]
    sized = [i for i, payload in enumerate(payloads) if len(payload)]
    # Each payload as one row of bytes (a gather's [batch, heads, rows, ...] layout).
    rows = [np.frombuffer(payloads[i], np.uint8).reshape(1, 1, -1, 1) for i in sized]
    uploaded = cuda_pages.gathered([(row.shape, "uint8") for row in rows], [[row] for row in rows])
    if uploaded is None:

        def fill(k: int, target: np.ndarray) -> None:
            np.copyto(target, np.frombuffer(payloads[sized[k]], np.uint8))

        uploaded = cuda.upload([((len(payloads[i]),), "uint8") for i in sized], fill)
    else:
        uploaded = [flat.reshape(-1) for flat in uploaded]
    flats: dict[int, mx.array] = dict(zip(sized, uploaded, strict=True))

    return [
        Record(h, _snapshots(h, functools.partial(_mlx_tensor, flat=flats.get(i))))
        for i, h in enumerate(headers)
    ]


def _mlx_tensor(entry: Any, flat: mx.array | None, start: int = 0) -> mx.array:
    """Tensor ``entry`` of a header as a view into ``flat``, the payload's bytes from
    ``start`` on in MLX memory (zeros for a tensor of no bytes)."""
    dtype = MLX_DTYPES[entry.dtype]
    if not entry.nbytes or flat is None:
        return mx.zeros(entry.shape, dtype)
    cut = flat[entry.offset - start : entry.offset - start + entry.nbytes]
    return cut.view(dtype).reshape(entry.shape)


def _segments(header: RecordHeader) -> list[tuple[int, int]]:
    """Byte ranges of the payload to copy into MLX, each whole tensors.

    One range when MLX's buffer cache already holds that much freed memory
    (a warm process: one large copy into touched pages is fastest); else
    ranges of about ``_SEGMENT_BYTES`` (a larger tensor is one range), which
    the C allocator serves from reused heap memory instead of fresh pages
    that fault one by one. Only speed depends on this choice.
    """
    if not header.payload_nbytes:
        return []
    if mx.get_cache_memory() >= header.payload_nbytes:
        return [(0, header.payload_nbytes)]
    extents = sorted(
        (t.offset, t.offset + t.nbytes)
        for layer in header.layers
        if layer is not None
        for t in layer.tensors
        if t.nbytes
    )
    segments: list[tuple[int, int]] = []
    for start, end in extents:
        if segments and end - segments[-1][0] <= _SEGMENT_BYTES:
            segments[-1] = (segments[-1][0], end)
        else:
            segments.append((start, end))
    return segments


def snapshot_to_mlx(snapshot: Snapshot) -> Snapshot:
    """``snapshot`` with every tensor an ``mx.array``: one copy of each numpy
    view (bfloat16 words reinterpreted for free); MLX tensors pass as they are."""
    tensors = {name: as_mlx(array) for name, array in snapshot.tensors.items()}
    mx.eval(list(tensors.values()))
    return Snapshot(snapshot.signature, snapshot.start, snapshot.stop, tensors, snapshot.meta)


def _bytes_view(buffer: Any, op: str) -> memoryview:
    try:
        view = memoryview(buffer)
    except TypeError as exc:
        raise TypeError(
            f"[{op}] A record is a bytes-like object; received {type(buffer).__name__}."
        ) from exc
    if not view.c_contiguous:
        raise TypeError(f"[{op}] A record buffer must be contiguous.")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def placed_payload(view: memoryview) -> memoryview | None:
    """The payload record ``view``'s prefix places (``None``: it places none): the bytes
    its check hashes, before the header, parsed next, says whether that is the payload
    and the sum it must have."""
    if len(view) < PREFIX.size:
        return None
    offset = payload_offset(PREFIX.unpack_from(view)[3])
    return view[offset:] if offset <= len(view) else None


def _payload_digest(view: memoryview) -> int | None:
    """The checksum of :func:`placed_payload` (``None``: none placed)."""
    payload = placed_payload(view)
    return None if payload is None else xxhash.xxh3_64_intdigest(payload)


def _payload(view: memoryview, header: RecordHeader, op: str) -> memoryview:
    if len(view) != header.nbytes:
        raise corrupt(
            op,
            f"Record length {len(view)} differs from the {header.nbytes} bytes its header "
            f"describes (truncated or trailing bytes).",
            found=len(view),
            expected=header.nbytes,
        )
    pad_start = PREFIX.size + PREFIX.unpack_from(view)[3]
    if any(view[pad_start : header.payload_offset]):
        raise corrupt(op, "The padding after the header is not zero.")
    return view[header.payload_offset :]


def _verify(header: RecordHeader, computed: int, op: str) -> None:
    if computed != header.checksum:
        raise corrupt(
            op,
            f"Payload checksum mismatch: stored {header.checksum:#018x}, computed "
            f"{computed:#018x}. The entry is corrupt; treat it as a miss.",
            stored=header.checksum,
            computed=computed,
        )


def _snapshots(
    header: RecordHeader,
    tensor: Any,
    lazy_layers: Container[int] = (),
    payload: Payload | None = None,
) -> list[Snapshot | None]:
    """Each layer's snapshot, its tensors ``tensor(entry)`` -- or, for ``lazy_layers``,
    a :class:`PayloadTensors` of ``payload``."""
    return [
        None
        if layer is None
        else Snapshot(
            layer.signature,
            layer.start,
            layer.stop,
            PayloadTensors(payload, layer.tensors),
            layer.meta,
        )
        if payload is not None and i in lazy_layers
        else note_checked(
            Snapshot(
                layer.signature,
                layer.start,
                layer.stop,
                {t.name: tensor(t) for t in layer.tensors},
                layer.meta,
            ),
            layer,
        )
        for i, layer in enumerate(header.layers)
    ]
