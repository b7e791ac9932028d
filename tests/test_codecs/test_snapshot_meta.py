"""Snapshot metadata checked on decode (issue 18, damage 6): a record whose checksums a
buggy or hostile writer recomputed after tampering is corrupt, and the message names
the field."""

from __future__ import annotations

import copy

import pytest

from kvstore.abc.codec import Snapshot
from kvstore.caches import KVCache, RotatingKVCache, TurboQuantKVCache
from kvstore.codecs import decode_record, encode_record, snapshot
from kvstore.codecs import record_header as H
from kvstore.codecs.snapshot_meta import MAX_POSITION, MAX_WINDOW
from kvstore.errors import CorruptEntryError
from kvstore.testing.codec import fill_cache

from .helpers import FAMILIES, craft_record, header_of, payload_of


def record_of(cache_factory, tokens=20):
    cache = cache_factory()
    fill_cache(cache, [tokens], head_dim=64, heads=2)
    return encode_record([snapshot(cache, 0, tokens)])


def tampered(record, change):
    header = copy.deepcopy(header_of(record))
    change(header["layers"][0])
    return craft_record(header, payload_of(record))  # checksums recomputed


def set_meta(field, value):
    return lambda layer: layer["meta"].__setitem__(field, value)


WINDOW = lambda: RotatingKVCache(32, keep=4)  # noqa: E731


@pytest.mark.parametrize(
    "factory, change, field",
    [
        (WINDOW, set_meta("max_size", 2**64 - 1), "max_size"),
        (WINDOW, set_meta("max_size", MAX_WINDOW + 1), "max_size"),
        (WINDOW, set_meta("max_size", 0), "max_size"),
        (WINDOW, set_meta("keep", 2**31), "keep"),
        (WINDOW, set_meta("keep", -1), "keep"),
        (WINDOW, set_meta("ring_idx", 99), "ring_idx"),
        (KVCache, set_meta("offset", "20"), "offset"),
        (KVCache, set_meta("offset", {"a": 1}), "offset"),
        (KVCache, set_meta("offset", 3), "offset"),  # fewer tokens than the rows it holds
        (KVCache, set_meta("offset", MAX_POSITION + 1), "offset"),
        (WINDOW, set_meta("offset", 1.5), "offset"),
        (KVCache, set_meta("dtype", "float64"), "dtype"),
        (KVCache, set_meta("dtype", "int8"), "dtype"),  # a dtype, but not the rows'
        (lambda: TurboQuantKVCache(4, 3), set_meta("tq", {"head_dim": 64}), "tq"),
    ],
)
def test_tampered_snapshot_meta_is_corrupt_naming_the_field(factory, change, field):
    record = record_of(factory)
    decode_record(record)  # intact
    with pytest.raises(CorruptEntryError) as info:
        decode_record(tampered(record, change))
    assert "layers[0]" in str(info.value) and field in str(info.value)


def test_a_layer_past_the_largest_position_is_corrupt():
    record = record_of(KVCache)

    def far(layer):
        layer["start"] = MAX_POSITION
        layer["stop"] = MAX_POSITION + 20
        layer["meta"]["offset"] = MAX_POSITION + 20

    with pytest.raises(CorruptEntryError, match="past"):
        decode_record(tampered(record, far))


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize(
    "field, value", [("offset", "20"), ("offset", 3), ("dtype", "float64"), ("dtype", None)]
)
def test_every_family_checks_its_offset_and_dtype(family, field, value):
    # Families added later (the microscaling ones) inherit the checks from the row
    # codecs: an unchecked family would let tampered meta reach a restore.
    record = record_of(FAMILIES[family])
    decode_record(record)  # intact
    with pytest.raises(CorruptEntryError) as info:
        decode_record(tampered(record, set_meta(field, value)))
    assert "layers[0]" in str(info.value) and field in str(info.value)


@pytest.mark.parametrize("factory", [KVCache, WINDOW], ids=["plain", "window"])
def test_a_snapshot_decoded_as_described_is_not_checked_again_on_restore(monkeypatch, factory):
    # Its codec's description check passed at the header's parse, and for a row codec
    # that check is the restore's: a 4096-token lossless restore of llama-8B checks 512.
    from kvstore.codecs import get_codec
    from kvstore.codecs.snapshot_meta import checked_by

    (snap,) = decode_record(record_of(factory)).layers
    codec = get_codec(snap.signature)
    assert checked_by(snap) is type(codec)
    checked = []
    monkeypatch.setattr(type(codec), "check_snapshot", lambda self, s: checked.append(s))
    codec.plan_restore([snap])
    assert checked == []


def test_a_snapshot_made_anew_from_a_decoded_one_is_checked_on_restore():
    import dataclasses

    from kvstore.codecs import get_codec
    from kvstore.codecs.snapshot_meta import checked_by

    (snap,) = decode_record(record_of(KVCache)).layers
    bad = dataclasses.replace(snap, meta={**snap.meta, "dtype": "int8"})
    assert checked_by(bad) is None  # the note is not a field: a snapshot made anew has none
    with pytest.raises(CorruptEntryError, match="meta dtype int8"):
        get_codec(snap.signature).plan_restore([bad])


def test_a_codec_whose_description_check_is_weaker_checks_a_decoded_snapshot(monkeypatch):
    # TurboQuant checks its carried matrices on restore, not in the header's parse.
    from kvstore.codecs import get_codec

    (snap,) = decode_record(record_of(lambda: TurboQuantKVCache(4, 3))).layers
    codec = get_codec(snap.signature)
    checked = []
    real = type(codec).check_snapshot
    monkeypatch.setattr(
        type(codec), "check_snapshot", lambda self, s: (checked.append(s), real(self, s))[1]
    )
    codec.plan_restore([snap])
    assert checked and all(s is snap for s in checked)


def test_a_decoded_snapshot_given_to_another_codec_is_checked_and_refused():
    from kvstore.codecs import get_codec

    (snap,) = decode_record(record_of(KVCache)).layers
    with pytest.raises(CorruptEntryError, match="given to the 'kv:quant:8:64' codec"):
        get_codec("kv:quant:8:64").plan_restore([snap])


def test_a_snapshot_decoded_from_a_header_template_is_noted_as_checked(monkeypatch):
    # The template's entries are copied with their ranges replaced; the note comes with
    # them, and the fill's own check of each description at its new range vouches for it.
    from kvstore.codecs import get_codec
    from kvstore.codecs import record as R
    from kvstore.codecs.snapshot_meta import checked_by

    cache = KVCache()
    fill_cache(cache, [20], head_dim=64, heads=2)
    R.forget_parsed_headers()
    first = encode_record([snapshot(cache, 0, 16)])
    later = encode_record([snapshot(cache, 4, 20)])
    decode_record(first)  # parsed in full: the template
    monkeypatch.setattr(H, "_parse_header", lambda *args: pytest.fail("parsed in full"))
    (snap,) = decode_record(later).layers
    assert (snap.start, snap.stop) == (4, 20)
    assert checked_by(snap) is type(get_codec(snap.signature))
    R.forget_parsed_headers()


def test_snapshots_decoded_from_one_header_template_are_alike_and_join():
    import numpy as np

    from kvstore.codecs import get_codec
    from kvstore.codecs import record as R
    from kvstore.codecs.snapshot_meta import decoded_alike

    cache = KVCache()
    fill_cache(cache, [32], head_dim=64, heads=2)
    R.forget_parsed_headers()
    (a,) = decode_record(encode_record([snapshot(cache, 0, 16)])).layers
    (b,) = decode_record(encode_record([snapshot(cache, 16, 32)])).layers  # from a's template
    assert decoded_alike(a, b) and decoded_alike(b, a)
    restored = get_codec(a.signature).restore([a, b])
    assert restored.offset == 32
    for got, want in ((restored.keys, cache.keys), (restored.values, cache.values)):
        assert np.array_equal(np.asarray(got[:, :, :32]), np.asarray(want[:, :, :32]))
    R.forget_parsed_headers()


def test_snapshots_of_other_shapes_are_never_alike_and_do_not_join():
    import dataclasses

    from kvstore.codecs import get_codec
    from kvstore.codecs.snapshot_meta import decoded_alike

    two, four = KVCache(), KVCache()
    fill_cache(two, [32], head_dim=64, heads=2)
    fill_cache(four, [32], head_dim=64, heads=4)
    (a,) = decode_record(encode_record([snapshot(two, 0, 16)])).layers
    (b,) = decode_record(encode_record([snapshot(four, 16, 32)])).layers
    assert not decoded_alike(a, b)
    assert not decoded_alike(a, dataclasses.replace(a))  # made anew: no note
    with pytest.raises(CorruptEntryError, match="the ranges are not of one cache"):
        get_codec(a.signature).restore([a, b])


def _stacked_layers(layers=3):
    """Snapshots of ``layers`` plain caches alike but for their rows, as TurboQuant
    records stored them."""
    from kvstore.codecs import transcode

    snaps = []
    for seed in range(layers):
        cache = KVCache()
        fill_cache(cache, [16], head_dim=64, heads=2, seed=seed)
        snaps.append(transcode(snapshot(cache, 0, 16), "kv:turboquant:4:3"))
    return snaps


def test_the_layers_of_one_stacked_conversion_are_checked_once_and_not_again_on_restore(
    monkeypatch,
):
    # A lossy restore on a GPU decodes every layer at once; the plain snapshots it cuts
    # from that one conversion are alike, so the first is checked for all of them.
    from kvstore.codecs import get_codec
    from kvstore.codecs.snapshot_meta import checked_by
    from kvstore.codecs.transcode import transcode_stacked

    converted = transcode_stacked(_stacked_layers(), "kv:plain")
    assert converted is not None and len(converted) == 3
    codec = get_codec("kv:plain")
    assert all(checked_by(s) is type(codec) for s in converted)
    checked = []
    monkeypatch.setattr(type(codec), "check_snapshot", lambda self, s: checked.append(s))
    for snap in converted:
        codec.plan_restore([snap])
    assert checked == []


def test_snapshots_whose_first_fails_its_check_are_noted_as_nothing():
    from kvstore.codecs import get_codec
    from kvstore.codecs.snapshot_meta import checked_by, note_checked_alike

    codec = get_codec("kv:plain")
    (snap,) = decode_record(record_of(KVCache)).layers
    good = Snapshot(snap.signature, snap.start, snap.stop, dict(snap.tensors), dict(snap.meta))
    bad = Snapshot(
        snap.signature, snap.start, snap.stop, dict(snap.tensors), {**snap.meta, "dtype": "int8"}
    )
    note_checked_alike([bad, good], codec)
    assert checked_by(bad) is None and checked_by(good) is None
    note_checked_alike([good], codec)
    assert checked_by(good) is type(codec)
