"""The record format: layout, zero copy, header rules, errors and their attributes."""

import dataclasses
import struct

import mlx.core as mx
import msgpack
import numpy as np
import pytest
import xxhash

from kvstore.caches import KVCache, QuantizedKVCache, RotatingKVCache
from kvstore.codecs import (
    decode_record,
    decode_record_to_mlx,
    encode_record,
    read_header,
    record,
    snapshot,
    snapshot_held,
    snapshot_to_mlx,
)
from kvstore.codecs import record_header as H
from kvstore.codecs.arrays import BFLOAT16_WORDS
from kvstore.codecs.header import BOUNDS
from kvstore.codecs.record import plan_record
from kvstore.errors import CorruptEntryError, FormatVersionError, UnknownSignatureError
from kvstore.testing.codec import assert_snapshots_equal, fill_cache

from .helpers import craft_record, header_of, payload_of, small_record


def mixed_layers():
    plain, quant, ring = KVCache(), QuantizedKVCache(64, 4), RotatingKVCache(16, keep=2)
    for cache in (plain, quant, ring):
        fill_cache(cache, [20], heads=3, dtype=mx.bfloat16)
    # A middle range of a 3-head cache is a strided view: encoded without compacting it first.
    return [snapshot(plain, 5, 17), None, snapshot(quant, 5, 17), snapshot(ring, 5, 17)]


def test_layout_prefix_alignment_and_payload_bytes():
    layers = mixed_layers()
    record = encode_record(layers, meta={"tokens": list(range(5, 17))})
    magic, version, flags, length, header_sum = struct.unpack_from("<4sHHIQ", record)
    assert (magic, version, flags) == (b"KVST", 1, 0)
    assert header_sum == xxhash.xxh3_64_intdigest(record[:12] + record[20 : 20 + length])
    header = read_header(record)
    assert header.payload_offset % 64 == 0 and header.payload_offset >= 20 + length
    assert header.nbytes == len(record)
    assert header.meta == {"tokens": list(range(5, 17))}
    assert header.writer.startswith("kvstore ")
    assert header.checksum == xxhash.xxh3_64_intdigest(payload_of(record))
    payload = payload_of(record)
    for layer, snap in zip(header.layers, layers, strict=True):
        assert (layer is None) == (snap is None)
        if layer is None:
            continue
        assert (layer.signature, layer.start, layer.stop) == (snap.signature, 5, 17)
        assert (layer.codec, layer.codec_version) == (
            {"kv:plain": "PlainKVCodec", "kv:quant:4:64": "QuantizedKVCodec"}.get(
                snap.signature, "RotatingKVCodec"
            ),
            1,
        )
        for entry, (name, array) in zip(layer.tensors, snap.tensors.items(), strict=True):
            assert entry.name == name and entry.offset % 64 == 0
            words = array.view(mx.uint16) if array.dtype == mx.bfloat16 else array
            raw = np.ascontiguousarray(np.asarray(words)).tobytes()
            assert payload[entry.offset : entry.offset + entry.nbytes] == raw


def test_decode_is_zero_copy_and_keeps_bfloat16_words():
    layers = mixed_layers()
    buffer = bytearray(encode_record(layers))
    record = decode_record(buffer)
    assert_snapshots_equal(layers, record.layers)
    keys = record.layers[0].tensors["keys"]
    assert keys.dtype == BFLOAT16_WORDS and keys.dtype.metadata == {"dtype": "bfloat16"}
    whole = np.frombuffer(buffer, dtype=np.uint8)
    for snap in record.layers:
        for array in snap.tensors.values() if snap else ():
            assert np.shares_memory(array, whole)
    # Proof of the view: a write to the buffer shows through.
    offset = record.header.payload_offset + record.header.layers[0].tensors[0].offset
    buffer[offset : offset + 2] = b"\x80\x3f"  # bfloat16 1.0
    assert keys.reshape(-1)[0] == 0x3F80


def test_to_mlx_copies_once_into_owned_memory():
    layers = mixed_layers()
    record_bytes = encode_record(layers)
    numpy_views = decode_record(record_bytes)
    whole = np.frombuffer(record_bytes, dtype=np.uint8)
    converted = [snapshot_to_mlx(s) if s else None for s in numpy_views.layers]
    direct = decode_record_to_mlx(record_bytes)
    for decoded in (converted, direct.layers):
        assert_snapshots_equal(layers, decoded)
        for snap in decoded:
            for array in snap.tensors.values() if snap else ():
                assert isinstance(array, mx.array)
                words = array.view(mx.uint16) if array.dtype == mx.bfloat16 else array
                assert not np.shares_memory(np.asarray(words), whole)
    assert direct.layers[0].tensors["keys"].dtype == mx.bfloat16


def test_large_record_checksum_runs_on_a_second_thread_and_still_verifies():
    cache = KVCache()
    fill_cache(cache, [4096], heads=4, head_dim=128)  # 8 MiB payload: the parallel path
    record = bytearray(encode_record([snapshot(cache)]))
    assert_snapshots_equal([snapshot(cache)], decode_record_to_mlx(record).layers)
    record[-1] ^= 0x01
    with pytest.raises(CorruptEntryError, match="Payload checksum mismatch"):
        decode_record_to_mlx(record)


def test_read_header_needs_only_the_header():
    record = small_record()
    header = read_header(record)
    cut = header.payload_offset
    assert read_header(record[:cut]) == header
    damaged = bytearray(record)
    damaged[cut + 3] ^= 0xFF  # payload damage is decode's business, not read_header's
    assert read_header(damaged) == header
    with pytest.raises(CorruptEntryError):
        decode_record(damaged)
    assert decode_record(damaged, verify=False).header == header


def test_a_remembered_parse_is_served_only_for_the_same_bytes():
    # Parses are remembered under the header's checksum with its bytes, and served only
    # where the bytes are equal: another header filed under the same checksum (xxh3 is
    # no cryptographic hash) is parsed on its own.
    from kvstore.codecs import record as R

    R.forget_parsed_headers()
    record = small_record()
    first = read_header(record)
    assert read_header(bytes(record)) is first  # the same bytes: the parse remembered
    header_sum = struct.unpack_from("<Q", record, 12)[0]
    (remembered,) = H._PARSED.values()
    assert remembered[1] is first and bytes(record).startswith(remembered[0])
    other = dataclasses.replace(first, writer="another writer")
    H._PARSED[header_sum] = (b"other bytes of a colliding header", other)
    again = read_header(record)
    assert again == first and again != other
    R.forget_parsed_headers()


def test_checksum_mismatch_names_stored_and_computed():
    record = bytearray(small_record())
    stored = read_header(record).checksum
    record[-5] ^= 0x10
    with pytest.raises(CorruptEntryError) as info:
        decode_record(record)
    computed = xxhash.xxh3_64_intdigest(payload_of(bytes(record)))
    assert info.value.stored == stored and info.value.computed == computed != stored
    assert f"stored {stored:#018x}, computed {computed:#018x}" in str(info.value)


@pytest.mark.parametrize("version", [2, 7, 65535])
def test_newer_format_is_a_format_version_error(version):
    header, payload = valid_header()
    record = craft_record({**header, "format": version}, payload, version=version)
    with pytest.raises(FormatVersionError) as info:
        decode_record(record)
    assert str(info.value) == (
        f"[decode_record] Format {version} is newer than this reader (reads 1). "
        "Upgrade kvstore, or treat the entry as a miss."
    )
    assert info.value.found == version and info.value.supported == (1,)


@pytest.mark.parametrize("bit", range(16))
def test_a_flipped_version_field_is_corrupt_not_newer(bit):
    # The header checksum covers the version (issue 18: a flip read as "newer" was kept
    # and re-saves deduplicated against it).
    record = bytearray(small_record())
    record[4 + bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(CorruptEntryError, match="Header checksum mismatch"):
        decode_record(record)


def test_a_newer_record_may_have_a_larger_header_than_this_reader_allows():
    header, payload = valid_header()
    header = {**header, "format": 2, "meta": {"big": "x" * BOUNDS.str_len}}
    packed = msgpack.packb(header, use_bin_type=True)
    big = packed + bytes(BOUNDS.header_bytes + 1 - len(packed))
    with pytest.raises(FormatVersionError):
        decode_record(craft_record(None, payload, version=2, raw_header=big))


def test_format_zero_is_not_read():
    header, payload = valid_header()
    record = craft_record({**header, "format": 0}, payload, version=0)
    with pytest.raises(FormatVersionError, match="Format 0 is not read by this reader"):
        decode_record(record)


def valid_header():
    record = small_record()
    return header_of(record), payload_of(record)


def test_unknown_header_fields_are_format_errors_unless_marked_optional():
    header, payload = valid_header()
    with pytest.raises(FormatVersionError, match="header has field 'compression'"):
        decode_record(craft_record({**header, "compression": "zstd"}, payload))
    optional = {**header, "hints": {"must_understand": False, "prefetch": True}}
    assert decode_record(craft_record(optional, payload)).header.meta == header["meta"]
    layer = {**header["layers"][0], "scale": 2}
    with pytest.raises(FormatVersionError, match=r"layers\[0\] has field 'scale'"):
        decode_record(craft_record({**header, "layers": [layer, *header["layers"][1:]]}, payload))
    tensor = {**header["layers"][0]["tensors"][0], "codec": "zstd"}
    layer = {**header["layers"][0], "tensors": [tensor, *header["layers"][0]["tensors"][1:]]}
    with pytest.raises(FormatVersionError, match=r"tensors\[0\] has field 'codec'"):
        decode_record(craft_record({**header, "layers": [layer, *header["layers"][1:]]}, payload))


def test_a_codec_version_this_codec_cannot_read_is_a_format_error():
    header, payload = valid_header()
    layer = {**header["layers"][0], "codec_version": 9}
    crafted = craft_record({**header, "layers": [layer, *header["layers"][1:]]}, payload)
    with pytest.raises(FormatVersionError, match="PlainKVCodec here reads versions 1") as info:
        decode_record(crafted)
    assert info.value.found == 9 and info.value.supported == (1,)


def test_records_of_kinds_not_installed_still_decode():
    header, payload = valid_header()
    layer = {**header["layers"][0], "signature": "kv:elsewhere", "codec": "ElsewhereCodec"}
    record = decode_record(
        craft_record({**header, "layers": [layer, *header["layers"][1:]]}, payload)
    )
    assert record.layers[0].signature == "kv:elsewhere"


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("payload_nbytes", 1 << 40, "differs from"),
        ("format", True, r"header.format is invalid"),
        ("checksum", {"algorithm": "crc32", "value": 1}, "checksum.algorithm is invalid"),
        ("layers", "none", "header.layers is invalid"),
    ],
)
def test_header_schema_violations_are_corrupt(field, value, message):
    header, payload = valid_header()
    with pytest.raises(CorruptEntryError, match=message):
        decode_record(craft_record({**header, field: value}, payload))


def test_tensor_extents_are_checked():
    header, payload = valid_header()
    layer = header["layers"][0]
    for change, message in [
        ({"offset": 8}, "misaligned or outside"),
        ({"offset": 1 << 20}, "misaligned or outside"),
        ({"nbytes": 10}, "needs"),
        ({"shape": [1, 1, 3, 32, 1, 1, 1, 1, 1]}, "shape is invalid"),
        ({"dtype": "complex64"}, "dtype is invalid"),
    ]:
        tensors = [{**layer["tensors"][0], **change}, *layer["tensors"][1:]]
        bad = {**header, "layers": [{**layer, "tensors": tensors}, *header["layers"][1:]]}
        with pytest.raises(CorruptEntryError, match=message):
            decode_record(craft_record(bad, payload))
    overlapping = [layer["tensors"][0], {**layer["tensors"][1], "offset": 0}]
    bad = {**header, "layers": [{**layer, "tensors": overlapping}, *header["layers"][1:]]}
    with pytest.raises(CorruptEntryError, match="overlap"):
        decode_record(craft_record(bad, payload))


def test_nonzero_padding_and_flags_are_corrupt():
    header, payload = valid_header()
    record = bytearray(craft_record(header, payload))
    pad = 20 + struct.unpack_from("<I", record, 8)[0]
    if pad % 64:
        record[pad] = 1
        with pytest.raises(CorruptEntryError, match="padding"):
            decode_record(record)
    with pytest.raises(CorruptEntryError, match="Flags 0x0001"):
        decode_record(craft_record(header, payload, flags=1))


def test_encode_errors():
    cache = KVCache()
    fill_cache(cache, [3])
    snap = snapshot(cache)
    with pytest.raises(UnknownSignatureError):
        encode_record([type(snap)("kv:nope", 0, 3, snap.tensors, snap.meta)])
    with pytest.raises(TypeError, match="not msgpack-able"):
        encode_record([snap], meta={"f": object()})
    with pytest.raises(ValueError, match="Store less meta"):
        encode_record([snap], meta={"ids": list(range(BOUNDS.array_len + 1))})
    with pytest.raises(TypeError, match="dtype"):
        encode_record([type(snap)("kv:plain", 0, 3, {"keys": np.zeros(3, np.float64)}, {})])


def test_a_plans_header_is_checked_against_the_bounds_once_for_both_its_heads(monkeypatch):
    # A record's head is made twice (with the widest checksum to size it, then with the
    # real one); they differ by an integer only, so the header is walked once.
    cache = KVCache()
    fill_cache(cache, [3])
    plan = plan_record([snapshot(cache)], meta={"ids": [1, 2, 3]})
    walks = []
    real = record.check_bounds
    monkeypatch.setattr(record, "check_bounds", lambda *a: walks.append(a) or real(*a))
    bound = plan.nbytes_bound
    head = plan.head(12345)
    assert len(walks) == 1 and len(head) + plan.payload_nbytes <= bound
    assert walks[0][1]["meta"] == {"ids": [1, 2, 3]}  # the header as written, walked
    too_long = plan_record([snapshot(cache)], meta={"ids": list(range(BOUNDS.array_len + 1))})
    for _ in range(2):  # a plan past a bound fails every time, not only the first
        with pytest.raises(ValueError, match="Store less meta"):
            too_long.head(0)


def test_a_plan_lends_its_layout_only_to_layers_alike_but_for_their_ranges(monkeypatch):
    walks = []
    real = record.check_bounds
    monkeypatch.setattr(record, "check_bounds", lambda *a: walks.append(a) or real(*a))
    cache, quant = KVCache(), QuantizedKVCache(64, 4)
    for c in (cache, quant):
        fill_cache(c, [40], heads=3, dtype=mx.bfloat16)
    first = plan_record([snapshot(cache, 0, 8), None, snapshot(quant, 0, 8)], meta={"n": 1})
    layers = [snapshot(cache, 8, 16), None, snapshot(quant, 8, 16)]
    lent = plan_record(layers, meta={"n": 1}, like=first)
    again = plan_record(
        [snapshot(cache, 16, 24), None, snapshot(quant, 16, 24)], like=lent, meta={"n": 1}
    )
    assert lent.checked_as is first and again.checked_as is first
    for plan in (lent, again, first):
        plan.head(0)
    assert len(walks) == 1  # the first plan's bound check, made once for all three
    fresh = plan_record(layers, meta={"n": 1})
    assert fresh.checked_as is None
    assert lent.entries == fresh.entries and lent.head(99) == fresh.head(99)
    assert [o for _, o in lent.tensors] == [o for _, o in fresh.tensors]
    assert all(a is b for (a, _), (b, _) in zip(lent.tensors, fresh.tensors, strict=True))
    # A meta equal but packed otherwise (1.0 for 1) is lent the layout, with its own meta.
    snap = snapshot(cache, 8, 16)
    floated = type(snap)(snap.signature, 8, 16, snap.tensors, {**snap.meta, "offset": 40.0})
    assert floated.meta == snap.meta
    other = [floated, None, snapshot(quant, 8, 16)]
    plan = plan_record(other, meta={"n": 1}, like=first)
    assert plan.checked_as is first
    assert plan.head(7) == plan_record(other, meta={"n": 1}).head(7) != lent.head(7)
    # Anything else different: planned afresh, as without ``like``.
    words = snapshot(cache, 8, 16)
    as_words = type(words)(
        words.signature,
        8,
        16,
        {k: np.asarray(v.view(mx.uint16)) for k, v in words.tensors.items()},
        words.meta,
    )
    others = [
        ([snapshot(cache, 8, 15), None, snapshot(quant, 8, 15)], {"n": 1}),  # a length
        (layers, {"n": 2}),  # the record's meta
        ([snapshot(cache, 8, 16), snapshot(cache, 8, 16), snapshot(quant, 8, 16)], {"n": 1}),
        ([snapshot(quant, 8, 16), None, snapshot(cache, 8, 16)], {"n": 1}),  # signatures
        ([as_words, None, snapshot(quant, 8, 16)], {"n": 1}),  # uint16, not bfloat16
        (layers[:2], {"n": 1}),  # a layer fewer
    ]
    for other, meta in others:
        plan = plan_record(other, meta=meta, like=first)
        assert plan.checked_as is None
        assert plan.entries == plan_record(other, meta=meta).entries


def test_empty_and_zero_token_records():
    assert decode_record(encode_record([])).layers == []
    ring = RotatingKVCache(8)
    fill_cache(ring, [2])
    empty = snapshot(ring, 1, 1)
    (decoded,) = decode_record(encode_record([empty])).layers
    assert_snapshots_equal([empty], [decoded])
    assert_snapshots_equal([empty], decode_record_to_mlx(encode_record([empty])).layers)


def test_record_of_held_ring_snapshots_keeps_ring_meta():
    ring = RotatingKVCache(16, keep=2)
    fill_cache(ring, [30, 1, 1])
    held = snapshot_held(ring)
    decoded = [decode_record(encode_record([s])).layers[0] for s in held]
    assert [dict(s.meta) for s in decoded] == [dict(s.meta) for s in held]
    assert held[0].meta["ring_idx"] == 4


def test_msgpack_header_holds_the_design_fields():
    header = header_of(small_record())
    assert set(header) == {"format", "writer", "layers", "meta", "payload_nbytes", "checksum"}


def _parse_race(monkeypatch, outcome, checking=False):
    """Eight threads reading one record's header (``checking``: checking the record, as
    the store's checks do) while its first parse is slow: how many parses ran, and what
    each thread got (the header, or the error; ``None`` for a check that passed)."""
    import threading
    import time

    from kvstore.caches import KVCache
    from kvstore.codecs import codec_for
    from kvstore.codecs import record as R

    cache = KVCache()
    rows = mx.random.normal((1, 2, 16, 8))
    cache.update_and_fetch(rows, rows)
    record = bytes(R.encode_record([codec_for(cache).snapshot(cache, 0, 16)] * 3))
    calls = []

    def slow_parse(*args):
        calls.append(1)
        time.sleep(0.05)  # the others arrive while this one runs
        return outcome(*args)

    monkeypatch.setattr(H, "_parse_header", slow_parse)
    R.forget_parsed_headers()
    got: list = [None] * 8

    def read(i):
        try:
            got[i] = R.verify_record(record) if checking else R.read_header(record)
        except CorruptEntryError as exc:
            got[i] = exc

    threads = [threading.Thread(target=read, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    R.forget_parsed_headers()
    return len(calls), got


def test_readers_of_one_header_at_once_each_parse_it_and_agree(monkeypatch):
    # A reader does not wait for another's parse (on a GPU the restore's reader would
    # queue behind a dozen checking threads for the GIL): each parses, all read alike.

    parses, got = _parse_race(monkeypatch, H._parse_header)
    assert parses == 8
    assert all(header == got[0] for header in got) and got[0].layers


def test_checks_of_one_record_at_once_parse_its_header_once(monkeypatch):

    parses, got = _parse_race(monkeypatch, H._parse_header, checking=True)
    assert parses == 1
    assert got == [None] * 8  # every check passed


def test_a_header_parsed_once_is_not_parsed_again(monkeypatch):
    from kvstore.codecs import record as R

    parses = []
    real = H._parse_header

    def counted(*args):
        parses.append(1)
        return real(*args)

    monkeypatch.setattr(H, "_parse_header", counted)
    monkeypatch.setattr(H, "_from_template", lambda *args: None)
    R.forget_parsed_headers()
    record = small_record()
    first = R.read_header(record)
    assert R.read_header(record) is first and R.read_header(bytes(record)) is first
    assert len(parses) == 1
    R.forget_parsed_headers()


@pytest.mark.parametrize("checking", [False, True], ids=["readers", "checks"])
def test_a_parse_that_fails_fails_for_every_thread_reading_it(monkeypatch, checking):
    from kvstore.codecs.header import corrupt

    def broken(*args):
        raise corrupt("read_header", "The header is not valid msgpack: planted.")

    parses, got = _parse_race(monkeypatch, broken, checking)
    assert all(isinstance(e, CorruptEntryError) and "planted" in str(e) for e in got)
    assert parses >= 1


def _promised_checks(monkeypatch, reader, parse=None, checks=4):
    """``checks`` threads checking one record, started inside ``reader_parses`` of it
    and given time to reach its header before ``reader(record)`` runs on this thread
    (still inside): the threads that parsed it (each a parse), and what each check got
    (``None``: it passed)."""
    import threading
    import time

    from kvstore.codecs import record as R

    record = bytes(small_record())
    parsers = []
    real = parse or H._parse_header

    def counted(*args):
        parsers.append(threading.get_ident())
        return real(*args)

    monkeypatch.setattr(H, "_parse_header", counted)
    monkeypatch.setattr(H, "_from_template", lambda *args: None)
    R.forget_parsed_headers()
    got: list = [None] * checks

    def check(i):
        try:
            got[i] = R.verify_record(record)
        except CorruptEntryError as exc:
            got[i] = exc

    threads = [threading.Thread(target=check, args=(i,)) for i in range(checks)]
    with R.reader_parses([record]):
        for thread in threads:
            thread.start()
        time.sleep(0.05)  # the checks reach the header first
        reader(record)
    for thread in threads:
        thread.join()
    R.forget_parsed_headers()
    return parsers, got


def test_checks_wait_for_a_header_the_reader_parses_rather_than_parse_it(monkeypatch):
    import threading

    from kvstore.codecs import record as R

    parsers, got = _promised_checks(monkeypatch, R.read_header)
    assert parsers == [threading.get_ident()]  # the reader's parse alone
    assert got == [None] * 4  # and every check passed on it


def test_checks_parse_a_promised_header_the_reader_did_not(monkeypatch):
    import threading

    parsers, got = _promised_checks(monkeypatch, lambda record: None)
    assert len(parsers) == 1 and parsers[0] != threading.get_ident()
    assert got == [None] * 4


def test_a_promised_header_that_fails_to_parse_fails_every_check(monkeypatch):
    from kvstore.codecs import record as R
    from kvstore.codecs.header import corrupt

    def broken(*args):
        raise corrupt("read_header", "The header is not valid msgpack: planted.")

    def reader(record):
        with pytest.raises(CorruptEntryError, match="planted"):
            R.read_header(record)

    parsers, got = _promised_checks(monkeypatch, reader, broken)
    assert all(isinstance(e, CorruptEntryError) and "planted" in str(e) for e in got)
    assert len(parsers) >= 2  # the reader's, then the checks' own (a failure is not kept)


def test_the_reader_checks_a_header_it_promised_without_waiting_for_itself():
    from kvstore.codecs import record as R

    record = bytes(small_record())
    R.forget_parsed_headers()
    with R.reader_parses([record]):
        assert R.verify_record(record) is None
    R.forget_parsed_headers()


def test_with_reader_parses_off_checks_parse_what_they_reach(monkeypatch):
    import threading

    from kvstore.codecs import record as R

    monkeypatch.setattr(H, "READER_PARSES", False)
    parsers, got = _promised_checks(monkeypatch, R.read_header)
    assert parsers and threading.get_ident() not in parsers
    assert got == [None] * 4


def test_a_decode_given_the_header_already_read_is_the_decode_that_reads_it(monkeypatch):

    record = bytes(encode_record(mixed_layers()))
    header = read_header(record)
    want = decode_record(record)
    monkeypatch.setattr(H, "read", lambda *args: pytest.fail("parsed again"))
    got = decode_record(record, header=header)
    assert got.header is header
    for a, b in zip(want.layers, got.layers, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert (a.signature, a.start, a.stop, a.meta) == (b.signature, b.start, b.stop, b.meta)
            assert all(np.array_equal(a.tensors[n], b.tensors[n]) for n in a.tensors)


def test_a_record_written_into_a_buffer_is_the_encoded_record():
    """``write_record`` (a save's records, into the arena) writes the bytes
    ``encode_record`` makes: the alignment gaps between tensors of several dtypes, a
    strided token range and a quantized layer's scales, over a buffer of stale bytes."""
    from kvstore.codecs import codec_for
    from kvstore.codecs import record as record_module

    plain, quant = KVCache(), QuantizedKVCache(group_size=64, bits=4)
    rows = mx.random.normal((1, 2, 40, 64))
    plain.update_and_fetch(rows.astype(mx.bfloat16), rows.astype(mx.bfloat16))
    quant.update_and_fetch(rows, rows * 3)
    layers = [codec_for(plain).snapshot(plain, 3, 37), codec_for(quant).snapshot(quant, 0, 40)]
    plan = record_module.plan_record(layers)
    out = np.full(plan.nbytes_bound + 64, 0xAB, np.uint8)  # stale bytes: every gap rewritten
    n = record_module.write_record(plan, out)
    assert bytes(out[:n]) == encode_record(layers)
    record_module.verify_record(memoryview(out[:n]))
