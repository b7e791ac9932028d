"""transcode: conversions between families, and what each one loses."""

import mlx.core as mx
import pytest

from kvstore.caches import (
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    RotatingQuantizedKVCache,
    RotatingTurboQuantKVCache,
    TurboQuantKVCache,
)
from kvstore.codecs import restore, snapshot, snapshot_held, transcode, transcode_measured
from kvstore.errors import UnknownSignatureError
from kvstore.testing.codec import assert_snapshots_equal, check_continue, fill_cache


def filled(cache, updates=(40, 1, 1), **shape):
    fill_cache(cache, list(updates), **shape)
    return cache


def without(meta, *keys):
    return {k: v for k, v in meta.items() if k not in keys}


@pytest.mark.parametrize("bits, group", [(8, 64), (4, 64), (4, 32), (3, 64)])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=["fp16", "bf16"])
def test_plain_to_quant_equals_a_quant_cache_of_the_same_rows(bits, group, dtype):
    plain = filled(KVCache(), dtype=dtype)
    quant = filled(QuantizedKVCache(group, bits), dtype=dtype)
    result = transcode_measured(snapshot(plain), f"kv:quant:{bits}:{group}")
    assert_snapshots_equal([snapshot(quant)], [result.snapshot])
    assert not result.lossless
    assert 0 < result.relative_mse["keys"] < {8: 1e-4, 4: 0.02, 3: 0.08}[bits]
    assert 0 < result.relative_mse["values"] < {8: 1e-4, 4: 0.02, 3: 0.08}[bits]


def test_quant_to_plain_dequantizes_losslessly():
    quant = filled(QuantizedKVCache(64, 4))
    snap = snapshot(quant)
    result = transcode_measured(snap, "kv:plain")
    assert result.lossless and result.relative_mse == {"keys": 0.0, "values": 0.0}
    keys = mx.dequantize(*quant.keys_and_values()[0], group_size=64, bits=4)
    assert mx.array_equal(result.snapshot.tensors["keys"], keys).item()
    assert result.snapshot.meta == snap.meta
    restored = restore(result.snapshot)
    assert isinstance(restored, KVCache) and restored.offset == quant.offset


def test_quant_to_other_quant_is_lossy():
    result = transcode_measured(snapshot(filled(QuantizedKVCache(64, 8))), "kv:quant:4:32")
    assert not result.lossless and result.relative_mse["keys"] > 1e-4
    assert result.snapshot.signature == "kv:quant:4:32"


@pytest.mark.parametrize(
    "cache, target",
    [
        (lambda: filled(KVCache()), "kv:quant:8:64"),
        (lambda: filled(QuantizedKVCache(64, 8)), "kv:plain"),
        (lambda: filled(TurboQuantKVCache(4, 4)), "kv:plain"),
    ],
    ids=["plain-to-q8", "q8-to-plain", "tq-to-plain"],
)
def test_transcode_waits_on_no_host_sync(cache, target, monkeypatch):
    # A restore or save transcodes every layer: a sync per layer is a device round
    # trip each (issue 13). transcode_measured is the one that measures.
    snap = snapshot(cache())
    items = []
    real_item = mx.array.item
    monkeypatch.setattr(mx.array, "item", lambda a: items.append(a) or real_item(a))
    out = transcode(snap, target)
    assert items == []
    monkeypatch.undo()
    measured = transcode_measured(snap, target).snapshot
    assert_snapshots_equal([measured], [out])


def test_same_signature_is_the_identity():
    snap = snapshot(filled(KVCache()))
    assert transcode(snap, "kv:plain") is snap


def test_rotating_to_plain_keeps_the_rows_of_each_range():
    ring = filled(RotatingKVCache(32, keep=4), (40, 1, 1, 1))
    held = snapshot_held(ring)
    plain = [transcode(s, "kv:plain") for s in held]
    for src, out in zip(held, plain, strict=True):
        assert (out.signature, out.start, out.stop) == ("kv:plain", src.start, src.stop)
        assert out.meta == without(src.meta, "max_size", "keep", "ring_idx")
        assert mx.array_equal(out.tensors["keys"], src.tensors["keys"]).item()


def test_plain_to_rotating_needs_a_window_and_then_restores_a_ring():
    plain = filled(KVCache(), (40, 1, 1))
    with pytest.raises(ValueError, match="needs max_size"):
        transcode(snapshot(plain), "kv:rotating-plain")
    with pytest.raises(ValueError, match="0 <= keep < max_size"):
        transcode(snapshot(plain), "kv:rotating-plain", max_size=8, keep=8)
    ring = restore(transcode(snapshot(plain), "kv:rotating-plain", max_size=16, keep=2))
    assert isinstance(ring, RotatingKVCache) and (ring.max_size, ring.keep) == (16, 2)
    # The ring built from all 42 rows continues like a ring fed them as one chunk.
    reference = RotatingKVCache(16, keep=2)
    reference.update_and_fetch(*(t[:, :, :42] for t in plain.keys_and_values()))
    check_continue(reference, ring, [1, 1, 4, 1])


def test_rotating_plain_to_rotating_quant_keeps_the_window():
    ring = filled(RotatingKVCache(32, keep=4), (40, 1, 1, 1))
    quant_ring = filled(RotatingQuantizedKVCache(32, keep=4, bits=8), (40, 1, 1, 1))
    out = [transcode(s, "kv:rotating-quant:8:64") for s in snapshot_held(ring)]
    assert_snapshots_equal(snapshot_held(quant_ring), out)
    check_continue(quant_ring, restore(out), [1, 3, 1])


def test_unknown_target():
    with pytest.raises(UnknownSignatureError):
        transcode(snapshot(filled(KVCache())), "kv:nope")


# -- TurboQuant: lossy from dense, lossless to dense -------------------------------------

#: Level-0 relative MSE of TurboQuant at each width (spec), with room for 42 short rows.
TQ_RELMSE = {4: (0.006, 0.013), 3: (0.025, 0.045), 2: (0.09, 0.14)}


@pytest.mark.parametrize("kbits, vbits", [(4, 3), (2, 2)])
@pytest.mark.parametrize("head_dim", [64, 96])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=["fp16", "bf16"])
def test_plain_to_turboquant_equals_a_turboquant_cache_of_the_same_rows(
    kbits, vbits, head_dim, dtype
):
    shape = {"dtype": dtype, "head_dim": head_dim}
    plain = filled(KVCache(), **shape)
    tq = filled(TurboQuantKVCache(kbits, vbits), **shape)
    result = transcode_measured(snapshot(plain), f"kv:turboquant:{kbits}:{vbits}")
    assert_snapshots_equal([snapshot(tq)], [result.snapshot])
    assert not result.lossless
    for side, bits in (("keys", kbits), ("values", vbits)):
        low, high = TQ_RELMSE[bits]
        assert low < result.relative_mse[side] < high, (side, result.relative_mse)
    check_continue(tq, restore(result.snapshot), [1, 3, 1], **shape)


def test_turboquant_to_plain_decodes_losslessly_and_leaves_its_meta_behind():
    tq = filled(TurboQuantKVCache(3, 4, seed=9, center=True))
    snap = snapshot(tq)
    result = transcode_measured(snap, "kv:plain")
    assert result.lossless and result.relative_mse == {"keys": 0.0, "values": 0.0}
    keys, values = tq.keys_and_values()
    assert mx.array_equal(result.snapshot.tensors["keys"], keys[2][:, :, :42]).item()
    assert mx.array_equal(result.snapshot.tensors["values"], values[2][:, :, :42]).item()
    assert result.snapshot.meta == without(snap.meta, "tq")


@pytest.mark.parametrize("source", ["kv:quant:4:64", "kv:turboquant:4:4"])
def test_affine_and_turboquant_convert_through_dense_rows(source):
    plain = snapshot(filled(KVCache()))
    start = transcode(plain, source)
    target = "kv:turboquant:3:3" if source.startswith("kv:quant") else "kv:quant:4:64"
    result = transcode_measured(start, target)
    assert result.snapshot.signature == target and not result.lossless
    assert 0 < result.relative_mse["keys"] < 0.05
    # Through dense rows: the same as converting the source's dense rows directly.
    direct = transcode(transcode(start, "kv:plain"), target)
    assert_snapshots_equal([direct], [result.snapshot])


def test_rotating_plain_to_rotating_turboquant_keeps_the_window():
    ring = filled(RotatingKVCache(32, keep=4), (40, 1, 1, 1))
    tq_ring = filled(RotatingTurboQuantKVCache(32, keep=4, kbits=3, vbits=2), (40, 1, 1, 1))
    out = [transcode(s, "kv:rotating-turboquant:3:2") for s in snapshot_held(ring)]
    assert_snapshots_equal(snapshot_held(tq_ring), out)
    check_continue(tq_ring, restore(out), [1, 3, 1])
