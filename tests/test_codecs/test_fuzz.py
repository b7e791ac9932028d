"""Acceptance 4: whatever the bytes, decoding ends in CorruptEntryError or
FormatVersionError (both KVStoreErrors) -- never another exception, never data
from a damaged record. Every single-bit flip is detected.

Hypothesis runs 2000 examples per test in the `ci` profile (200 otherwise).
"""

import os
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.codecs import decode_record, decode_record_to_mlx, read_header, restore
from kvstore.codecs.header import BOUNDS
from kvstore.errors import (
    CapabilityError,
    CorruptEntryError,
    FormatVersionError,
    KVStoreError,
    UnknownSignatureError,
)

from .helpers import SMALL_RECORD_TQ_LAYER, craft_record, header_of, payload_of, small_record

FUZZ = settings(
    max_examples=2000 if os.environ.get("HYPOTHESIS_PROFILE") == "ci" else 200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
REJECTED = (CorruptEntryError, FormatVersionError)
RECORD = small_record()
HEADER, PAYLOAD = header_of(RECORD), payload_of(RECORD)


def assert_rejected(data, decoders=(decode_record, decode_record_to_mlx)):
    for decode in decoders:
        with pytest.raises(REJECTED) as info:
            decode(data)
        assert isinstance(info.value, KVStoreError)
    return info.value


def decode_or_reject(data):
    """Decode, or be rejected with one of our two errors; nothing else is allowed."""
    try:
        return decode_record(data)
    except REJECTED:
        return None


# -- exhaustive ----------------------------------------------------------------------


def test_the_sample_record_is_valid():
    layers = decode_record(RECORD).layers
    assert len(layers) == 4 and len(PAYLOAD) > 0
    assert layers[SMALL_RECORD_TQ_LAYER].signature == "kv:turboquant:2:3"


def test_every_truncation_is_rejected():
    for n in range(len(RECORD)):
        assert_rejected(RECORD[:n], decoders=(decode_record,))
    assert_rejected(RECORD + b"\x00")


def test_every_single_bit_flip_is_detected():
    start = len(RECORD) - len(PAYLOAD)
    for bit in range(len(RECORD) * 8):
        damaged = bytearray(RECORD)
        damaged[bit // 8] ^= 1 << (bit % 8)
        decoders = (decode_record, decode_record_to_mlx) if bit % 11 == 0 else (decode_record,)
        error = assert_rejected(damaged, decoders)
        if bit // 8 >= start:  # a payload flip is a checksum mismatch, naming both sums
            assert isinstance(error, CorruptEntryError)
            assert "Payload checksum mismatch" in str(error)
            assert error.stored != error.computed


# -- hypothesis ----------------------------------------------------------------------


@FUZZ
@given(st.binary(max_size=4096))
def test_random_bytes(data):
    assert_rejected(data)


@FUZZ
@given(st.binary(max_size=2048), st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1))
def test_random_bytes_behind_a_valid_prefix(body, length, header_sum):
    assert_rejected(struct.pack("<4sHHIQ", b"KVST", 1, 0, length, header_sum) + body)


MUTATION = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, len(RECORD) * 8 - 1)),
    st.tuples(st.just("set"), st.integers(0, len(RECORD) - 1), st.integers(0, 255)),
    st.tuples(st.just("delete"), st.integers(0, len(RECORD) - 1), st.integers(1, 64)),
    st.tuples(st.just("insert"), st.integers(0, len(RECORD)), st.binary(min_size=1, max_size=64)),
)


def mutate(data, mutation):
    kind, where, *rest = mutation
    if kind == "flip":
        where %= len(data) * 8
        data[where // 8] ^= 1 << (where % 8)
    elif kind == "set":
        where %= len(data)
        data[where] = rest[0] if data[where] != rest[0] else rest[0] ^ 1
    elif kind == "delete":
        del data[where : where + rest[0]]
    else:
        data[where:where] = rest[0]


@FUZZ
@given(st.lists(MUTATION, min_size=1, max_size=6))
def test_mutated_records_are_rejected(mutations):
    data = bytearray(RECORD)
    for mutation in mutations:
        if data:
            mutate(data, mutation)
    if bytes(data) != RECORD:
        assert_rejected(data)


KEYS = st.sampled_from(["format", "layers", "meta", "tensors", "shape", "dtype", "x"])
JSONISH = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(KEYS | st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=12,
)


@FUZZ
@given(JSONISH, st.binary(max_size=256))
def test_arbitrary_headers_with_valid_checksums_are_rejected(header, payload):
    assert_rejected(craft_record(header, payload))


def paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from paths(value, (*prefix, key))
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            yield from paths(value, (*prefix, i))


ALL_PATHS = list(paths(HEADER))[1:]


def replaced(obj, path, value):
    if not path:
        return value
    head, *rest = path
    copy = dict(obj) if isinstance(obj, dict) else list(obj)
    copy[head] = replaced(obj[head], rest, value)
    return copy


@FUZZ
@given(st.sampled_from(ALL_PATHS), JSONISH)
def test_headers_with_one_field_replaced_decode_or_are_rejected(path, value):
    data = craft_record(replaced(HEADER, path, value), PAYLOAD)
    record = decode_or_reject(data)
    if record is not None:  # a replacement can be valid (meta, no layers, an equal value)
        assert record.header.nbytes == len(data)
        for layer in record.layers:
            for array in layer.tensors.values() if layer else ():
                assert array.base is not None  # a view into `data`, within its bounds


TQ_PATHS = [p for p in ALL_PATHS if p[:2] == ("layers", SMALL_RECORD_TQ_LAYER)]


@FUZZ
@given(st.sampled_from(TQ_PATHS), JSONISH)
def test_turboquant_layers_with_one_field_replaced_restore_or_are_rejected(path, value):
    # Decoding checks the record; restoring checks what the TurboQuant codec
    # records about its encoding (codebook, rotation, scale modes, key mean).
    record = decode_or_reject(craft_record(replaced(HEADER, path, value), PAYLOAD))
    layer = record.layers[SMALL_RECORD_TQ_LAYER] if record is not None else None
    if layer is None:
        return
    try:
        cache = restore(layer)
    except (CorruptEntryError, UnknownSignatureError, CapabilityError, ValueError) as exc:
        # A replaced signature may name another kind, or bad parameters of this one.
        assert isinstance(exc, KVStoreError) or path[-1] == "signature"
    else:
        assert cache.offset == 3


@FUZZ
@given(st.binary(min_size=4, max_size=4).filter(lambda m: m != b"KVST"))
def test_wrong_magic(magic):
    error = assert_rejected(magic + RECORD[4:])
    assert "Not a kvstore record" in str(error)


@FUZZ
@given(st.integers(2, 65535))
def test_newer_versions(version):
    error = assert_rejected(craft_record(HEADER, PAYLOAD, version=version))
    assert isinstance(error, FormatVersionError)
    assert error.supported == (1,) and error.found == version
    assert "reads 1" in str(error)


# -- bounds ----------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [BOUNDS.depth + 1, 1000, 5000, 100_000])
def test_deeply_nested_headers(depth):
    raw = b"\x91" * depth + b"\xc0"  # [[[...[nil]...]]]
    error = assert_rejected(craft_record(None, raw_header=raw))
    assert isinstance(error, CorruptEntryError)


def test_header_length_over_the_bound_is_rejected_before_reading():
    data = struct.pack("<4sHHIQ", b"KVST", 1, 0, BOUNDS.header_bytes + 1, 0)
    error = assert_rejected(data + bytes(64))
    assert "exceeds the bound" in str(error)


@pytest.mark.parametrize(
    "raw",
    [
        b"\xdd\xff\xff\xff\xff",  # array32 claiming 4G items
        b"\xdf\xff\xff\xff\xff",  # map32 claiming 4G entries
        b"\xdb\xff\xff\xff\xff",  # str32 claiming 4 GiB
        b"\xc6\xff\xff\xff\xff",  # bin32 claiming 4 GiB
        b"\xc7\x01\x05\x00",  # ext8
        b"\x81\x01\xc0",  # a map with an int key
    ],
)
def test_oversized_or_foreign_msgpack_is_rejected(raw):
    assert_rejected(craft_record(None, raw_header=raw))


@pytest.mark.parametrize(
    "header",
    [
        {"meta": {"s": "x" * (BOUNDS.str_len + 1)}},
        {"meta": {"a": [0] * (BOUNDS.array_len + 1)}},
        {"meta": {str(i): i for i in range(BOUNDS.map_len + 1)}},
        {"meta": {"b": b"\x00" * (BOUNDS.bin_len + 1)}},
    ],
)
def test_header_containers_over_their_bounds(header):
    big = {**HEADER, **header}
    error = assert_rejected(craft_record(big, PAYLOAD))
    assert isinstance(error, CorruptEntryError)


def test_read_header_alone_never_raises_anything_else():
    end = 20 + struct.unpack_from("<I", RECORD, 8)[0]
    for n in range(end):
        with pytest.raises(REJECTED):
            read_header(RECORD[:n])
    assert read_header(RECORD[:end]) == read_header(RECORD)
