"""What the TurboQuant codecs store and check: rows as the cache holds them,
deterministic records, the spec's ids (codebook, SplitMix64 signs, dense matrix
by sha256), and the refusals when a snapshot does not match them.

Round trips, ranges, rings, transcoding, model continuation, golden fixtures and
fuzzing run in the shared codec suites (the TurboQuant families are in their
parametrisations); this file holds what only TurboQuant has.
"""

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from kvstore.caches import RotatingTurboQuantKVCache, TurboQuantKVCache
from kvstore.codecs import (
    decode_record,
    encode_record,
    get_codec,
    restore,
    snapshot,
    snapshot_held,
    transcode,
)
from kvstore.codecs import turboquant_params as params_module
from kvstore.errors import CorruptEntryError
from kvstore.signature import parse_signature
from kvstore.testing.codec import (
    assert_arrays_equal,
    assert_snapshots_equal,
    check_continue,
    fill_cache,
)
from kvstore.turboquant.codebook import codebook
from kvstore.turboquant.quantizer import bits_per_value
from kvstore.turboquant.rotation import Rotation, dense_rotation_matrix

# The spec's SplitMix64 test vectors: seed 0, round 0, the first 32 signs.
SPEC_SIGNS = {"k": "++-+--+-+-++-+-+++-+--+--+-++-+-", "v": "+++-++-+-+---++-++-+-++--+++++--"}


def filled(cache, updates=(40, 1, 1), **shape):
    fill_cache(cache, list(updates), **shape)
    return cache


def record_of(cache):
    return encode_record(snapshot_held(cache), meta={"t": 1})


@pytest.fixture
def fresh_process(monkeypatch):
    """No dense matrix seen yet, and a reference generator that gives other bits
    than the writer's (another platform's LAPACK)."""
    monkeypatch.setattr(params_module, "_MATRICES", type(params_module._MATRICES)())
    real = params_module.rotation_for

    def elsewhere(dim, kind="k", seed=0, rounds=1):
        rotation = real(dim, kind, seed, rounds)
        if rotation.matrix is None:
            return rotation
        return Rotation(dim, matrix=dense_rotation_matrix(dim, seed + 1, kind))

    monkeypatch.setattr(params_module, "rotation_for", elsewhere)


# -- determinism and rows as they are ---------------------------------------------------------


@pytest.mark.parametrize("head_dim", [128, 96])
@pytest.mark.parametrize(
    "make",
    [
        lambda: TurboQuantKVCache(3, 3, seed=11),
        lambda: RotatingTurboQuantKVCache(32, keep=4, kbits=4, vbits=2, center=True),
    ],
    ids=["tq", "rotating-tq"],
)
def test_same_rows_and_seed_give_byte_identical_records(make, head_dim):
    records = [record_of(filled(make(), head_dim=head_dim)) for _ in range(2)]
    assert records[0] == records[1]
    snap = snapshot(filled(TurboQuantKVCache(3, 3), head_dim=head_dim))
    again = [transcode(transcode(snap, "kv:plain"), "kv:turboquant:2:4") for _ in range(2)]
    assert encode_record(again[:1]) == encode_record(again[1:])


def test_another_seed_gives_other_codes():
    a, b = (filled(TurboQuantKVCache(3, 3, seed=s)) for s in (0, 1))
    sa, sb = snapshot(a), snapshot(b)
    assert not mx.array_equal(sa.tensors["keys.codes"], sb.tensors["keys.codes"]).item()
    assert sa.meta["tq"]["k"]["rotation"] != sb.meta["tq"]["k"]["rotation"]


@pytest.mark.parametrize(
    "family", ["kv:turboquant:4:3", "kv:rotating-turboquant:4:3", "kv:turboquant:5:4"]
)
def test_rows_are_stored_as_the_cache_holds_them_and_restored_the_same(family):
    sig = parse_signature(family)
    cache = (
        TurboQuantKVCache(sig.kbits, sig.vbits)
        if sig.kind == "kv:turboquant"
        else RotatingTurboQuantKVCache(64, kbits=sig.kbits, vbits=sig.vbits)
    )
    filled(cache, (30, 1, 1))
    snap = snapshot(cache)
    (kc, ks), (vc, vs) = cache.encoded_rows()
    for name, stored in (
        ("keys.codes", kc),
        ("keys.scales", ks),
        ("values.codes", vc),
        ("values.scales", vs),
    ):
        assert_arrays_equal(snap.tensors[name], stored[:, :, :32], name)
    again = restore(decode_record(encode_record([snap])).layers[0])
    for got, want in zip(again.encoded_rows(), cache.encoded_rows(), strict=True):
        for a, b in zip(got, want, strict=True):
            assert_arrays_equal(a[:, :, :32], b[:, :, :32])
    # The working copy attention reads is the codes decoded, as in the original.
    assert_arrays_equal(again.keys_and_values()[0][2], cache.keys_and_values()[0][2])


# -- what the meta says --------------------------------------------------------------------


def test_meta_names_the_spec_codebook_signs_and_modes():
    cache = filled(TurboQuantKVCache(3, 2), head_dim=64, dtype=mx.bfloat16)
    tq = snapshot(cache).meta["tq"]
    assert snapshot(cache).meta["dtype"] == "bfloat16"
    assert (tq["head_dim"], tq["seed"], tq["center"], tq["codebook"]) == (
        64,
        0,
        False,
        "gauss-lm-v1",
    )
    for kind, bits, mode in (("k", 3, "matched"), ("v", 2, "ls")):
        side = tq[kind]
        assert (side["bits"], side["scale_mode"]) == (bits, mode)
        assert side["centroids"] == codebook(bits).centroids.astype(np.float32).tolist()
        (signs,) = side["rotation"]["signs"]
        assert side["rotation"]["method"] == "rht" and signs[:32] == SPEC_SIGNS[kind]
        assert len(signs) == 64


def test_two_rounds_store_two_sign_vectors():
    cache = filled(TurboQuantKVCache(4, 4, rounds=2), head_dim=128)
    signs = snapshot(cache).meta["tq"]["k"]["rotation"]["signs"]
    assert len(signs) == 2 and signs[0][:32] == SPEC_SIGNS["k"] and signs[1] != signs[0]
    assert restore(snapshot(cache)).rounds == 2


@pytest.mark.parametrize("kbits, vbits", [(4, 4), (3, 3), (2, 2), (4, 2), (5, 4), (4, 5)])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_stored_rows_cost_the_spec_formula(kbits, vbits, head_dim):
    heads, tokens = 2, 256
    cache = filled(TurboQuantKVCache(kbits, vbits), (tokens,), heads=heads, head_dim=head_dim)
    snap = snapshot(cache)
    row_bytes = sum(
        int(t.nbytes) for n, t in snap.tensors.items() if n.endswith(("codes", "scales"))
    )
    formula = heads * head_dim * (bits_per_value(kbits, head_dim) + bits_per_value(vbits, head_dim))
    assert row_bytes * 8 == formula * tokens
    assert sorted(snap.tensors) == ["keys.codes", "keys.scales", "values.codes", "values.scales"]


# -- dense rotations: carried once per prefix, identified by sha256 ------------------------


def test_a_dense_rotation_travels_only_in_the_snapshot_starting_at_token_0():
    cache = filled(TurboQuantKVCache(3, 3), (300,), head_dim=96)
    first, later = snapshot(cache, 0, 256), snapshot(cache, 256, 300)
    assert {"keys.rotation", "values.rotation"} <= set(first.tensors)
    assert not {"keys.rotation", "values.rotation"} & set(later.tensors)
    assert first.meta["tq"] == later.meta["tq"]
    matrix = first.tensors["keys.rotation"]
    assert matrix.dtype == mx.float32 and matrix.shape == (96, 96)
    assert first.meta["tq"]["k"]["rotation"]["method"] == "dense"


@pytest.mark.usefixtures("fresh_process")
def test_a_reader_elsewhere_uses_the_stored_matrix_never_its_own():
    cache = filled(TurboQuantKVCache(4, 3), (300,), head_dim=96)
    records = [encode_record([snapshot(cache, a, b)]) for a, b in ((0, 256), (256, 300))]
    params_module._MATRICES.clear()  # the writer's own matrices are not this reader's
    blocks = [decode_record(r).layers[0] for r in records]
    again = restore(blocks)
    assert_snapshots_equal([snapshot(cache)], [snapshot(again)])
    check_continue(cache, again, [1, 2, 1], head_dim=96)


@pytest.mark.usefixtures("fresh_process")
def test_a_later_block_alone_needs_its_matrix_from_somewhere():
    ring = filled(RotatingTurboQuantKVCache(32, kbits=3, vbits=3), (300,), head_dim=96)
    block0 = decode_record(encode_record([snapshot(ring, 0, 256)])).layers[0]
    window = decode_record(encode_record([snapshot(ring, 268, 300)])).layers[0]
    params_module._MATRICES.clear()
    with pytest.raises(CorruptEntryError, match="together with the snapshot starting at token 0"):
        restore(window)
    restore(block0)  # reading the first block makes its matrix known to this process
    again = restore(window)
    assert_snapshots_equal(snapshot_held(ring), snapshot_held(again))
    check_continue(ring, again, [1, 3, 1], head_dim=96)


def test_a_matrix_that_does_not_match_its_hash_is_refused():
    snap = snapshot(filled(TurboQuantKVCache(3, 3), head_dim=96))
    bad = np.array(snap.tensors["keys.rotation"])
    bad[0, 0] += 1e-3
    with pytest.raises(CorruptEntryError, match=r"does not hash to its sha256"):
        restore(replace(snap, tensors={**snap.tensors, "keys.rotation": mx.array(bad)}))


# -- refusals -----------------------------------------------------------------------------


def with_tq(snap, kind, **changes):
    tq = {**snap.meta["tq"], kind: {**snap.meta["tq"][kind], **changes}}
    return replace(snap, meta={**snap.meta, "tq": tq})


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda s: with_tq(s, "k", rotation={"method": "rht", "signs": ["+" * 64]}), "SplitMix64"),
        (lambda s: with_tq(s, "v", centroids=[0.0] * 4), "gauss-lm-v1 table"),
        (lambda s: with_tq(s, "k", bits=4), "differ from the signature's 3"),
        (lambda s: with_tq(s, "k", scale_mode="max"), "scale_mode 'max'"),
        (lambda s: replace(s, meta={**s.meta, "tq": {**s.meta["tq"], "seed": 3}}), "seed 3"),
        (lambda s: replace(s, meta={**s.meta, "tq": {**s.meta["tq"], "center": True}}), "keys.mu"),
        (lambda s: replace(s, meta={**s.meta, "dtype": "uint8"}), "not a float dtype"),
        (
            lambda s: replace(s, meta={**s.meta, "tq": {**s.meta["tq"], "head_dim": 32}}),
            r"\[B, H, T, 3\]",
        ),
    ],
)
def test_snapshots_that_do_not_match_their_ids_are_corrupt(change, message):
    snap = snapshot(filled(TurboQuantKVCache(3, 2), head_dim=64))
    with pytest.raises(CorruptEntryError, match=message):
        restore(change(snap))
    with pytest.raises(CorruptEntryError, match=message):
        get_codec(snap.signature).to_dense(change(snap))


def test_ranges_encoded_differently_do_not_join():
    a = filled(TurboQuantKVCache(3, 3, seed=1), (20,))
    b = filled(TurboQuantKVCache(3, 3, seed=2), (40,))
    with pytest.raises(CorruptEntryError, match="disagree on tq"):
        restore([snapshot(a), snapshot(b, 20, 40)])
    c, d = (filled(TurboQuantKVCache(3, 3, center=True), (40,), seed=s) for s in (1, 2))
    with pytest.raises(CorruptEntryError, match="different means"):
        restore([snapshot(c, 0, 20), snapshot(d, 20, 40)])


def test_large_vectors_store_float32_scales_and_ranges_of_both_join():
    cache = filled(TurboQuantKVCache(4, 4), (20,), dtype=mx.bfloat16)
    first = snapshot(cache, 0, 20)
    big = mx.full((1, 2, 4, 64), 1e5, mx.bfloat16)  # scale ~1e5: beyond float16's range
    cache.update_and_fetch(big, big)
    second = snapshot(cache, 20, 24)
    assert first.tensors["keys.scales"].dtype == mx.float16
    assert second.tensors["keys.scales"].dtype == mx.float32
    again = restore([first, second])
    assert again.encoded_rows()[0][1].dtype == mx.float32
    assert_arrays_equal(again.keys_and_values()[0][2], cache.keys_and_values()[0][2])


def description_reads(monkeypatch) -> list[bool]:
    """Whether each read of a ``meta["tq"]`` description from now on was a full one
    (``values``), none remembered yet."""
    monkeypatch.setattr(params_module, "_KNOWN", type(params_module._KNOWN)())
    reads: list[bool] = []
    real = params_module._read_described

    def counted(*args, **kwargs):
        reads.append(kwargs["values"])
        return real(*args, **kwargs)

    monkeypatch.setattr(params_module, "_read_described", counted)
    return reads


def test_a_checked_description_is_not_checked_again_nor_taken_for_a_full_read(monkeypatch):
    # The header parse checks every record's map, each record of a template the same
    # one: checked once; a check's parameters (a stand-in for a dense rotation) never
    # answer a full read, and a full read's answer every later check.
    snap = snapshot(filled(TurboQuantKVCache(3, 2), head_dim=64))
    reads = description_reads(monkeypatch)
    params_module.check_described(snap, 3, 2)
    params_module.check_described(replace(snap, start=snap.start), 3, 2)
    assert reads == [False]
    first = params_module.read_params(snap, 3, 2)
    assert reads == [False, True]
    assert params_module.read_params(snap, 3, 2) is first
    params_module.check_described(snap, 3, 2)
    assert reads == [False, True]
    short = {**snap.tensors, "values.codes": snap.tensors["values.codes"][..., :-1]}
    with pytest.raises(params_module.Unreadable, match=r"values.codes is .*\[B, H, T, 4\]"):
        params_module.check_described(replace(snap, tensors=short), 3, 2)


def test_a_description_read_once_is_not_read_again_but_each_snapshots_rows_are(monkeypatch):
    # A header parse shares one meta["tq"] map among a prefix's snapshots: the map is
    # checked once, the rows of every snapshot each time.
    snap = snapshot(filled(TurboQuantKVCache(3, 2), head_dim=64))
    reads = description_reads(monkeypatch)
    first = params_module.read_params(snap, 3, 2)
    assert params_module.read_params(replace(snap, start=snap.start), 3, 2) is first
    params_module.check_described(snap, 3, 2)
    assert len(reads) == 1
    short = {**snap.tensors, "keys.codes": snap.tensors["keys.codes"][..., :-1]}
    with pytest.raises(params_module.Unreadable, match=r"keys.codes is .*\[B, H, T, 6\]"):
        params_module.read_params(replace(snap, tensors=short), 3, 2)
    heads = int(snap.tensors["keys.codes"].shape[1])
    stray = {**snap.tensors, "keys.mu": mx.zeros((heads, 64))}
    with pytest.raises(params_module.Unreadable, match="do not belong"):
        params_module.read_params(replace(snap, tensors=stray), 3, 2)
    with pytest.raises(params_module.Unreadable, match="4-bit codes of D=64"):
        params_module.read_params(snap, 4, 2)  # other bits: the map is read again
    assert len(reads) == 3
