"""Issue 16, recurrent families: ``rec:gated-delta`` and ``rec:arrays:{slots}``.

A recurrent layer's snapshot is a checkpoint -- the state at one position,
``start == stop`` -- stored as it is: a record holding a model's KV rows and
its recurrent checkpoints decodes and restores bit-exactly, and a model
continued from the restored caches computes what it computes from its own.
mlx-lm's stock ``ArraysCache`` is recognised by its class path, so caches of
any mlx-lm hybrid model store too. Every KV predicate fails closed on them.
"""

import mlx.core as mx
import pytest

from kvstore.abc import cache as preds
from kvstore.caches.recurrent import ARRAYS_FAMILY, GATED_DELTA_FAMILY, ArraysCache
from kvstore.codecs import codec_for, decode_record_to_mlx, encode_record, get_codec, restore
from kvstore.errors import CapabilityError, CorruptEntryError
from kvstore.family import RECURRENT_STATE, Family, get_family
from kvstore.model import build_model

KV_PREDICATES = [
    preds.is_plain_kv_cache,
    preds.is_quantized_kv_cache,
    preds.is_rotating_plain_cache,
    preds.is_rotating_quantized_cache,
    preds.is_turboquant_cache,
    preds.is_sliding_window_cache,
    preds.uses_quantized_attention,
    preds.uses_dense_attention,
    preds.can_trim,
]


def hybrid_caches(n=37, seed=0):
    model = build_model("tiny-qwen3_5", seed=seed)
    caches = model.make_cache()
    tokens = mx.random.randint(0, 256, (1, n), key=mx.random.key(4))
    model(tokens, cache=caches)
    mx.eval([c.state for c in caches])
    return model, caches


def test_families_are_declared_recurrent():
    for kind in ("rec:gated-delta", "rec:arrays"):
        family = get_family(kind)
        assert family.state == RECURRENT_STATE and family.holds_recurrent_state
        assert not family.holds_kv and not family.windowed and not family.storage_policy
    assert (
        GATED_DELTA_FAMILY.kind == "rec:gated-delta" and ARRAYS_FAMILY.form == "rec:arrays:{slots}"
    )
    with pytest.raises(ValueError, match="state"):
        Family(kind="rec:x", description="x", state="fluid")
    with pytest.raises(ValueError, match="recurrent family"):
        Family(kind="rec:y", description="y", state=RECURRENT_STATE, window_of="kv:plain")


@pytest.mark.parametrize("make", [lambda: hybrid_caches()[1][0], lambda: ArraysCache(2)])
def test_kv_predicates_fail_closed(make):
    cache = make()
    assert preds.is_recurrent_cache(cache)
    assert [p.__name__ for p in KV_PREDICATES if p(cache)] == []
    assert cache.bytes_per_token() == 0


def test_checkpoint_record_round_trip_is_bit_exact_and_continues():
    model, caches = hybrid_caches()
    layers = [codec_for(c).snapshot(c) for c in caches]
    for snap in layers[:3]:
        assert snap.signature == "rec:gated-delta" and snap.start == snap.stop == 37
        assert set(snap.tensors) == {"conv", "state"} and snap.tensors["state"].dtype == mx.float32
    assert layers[3].signature == "kv:plain" and (layers[3].start, layers[3].stop) == (0, 37)
    record = encode_record(layers)
    restored = [restore(s) for s in decode_record_to_mlx(record).layers]
    for a, b in zip(caches[:3], restored[:3]):
        assert b.offset == a.offset == 37
        assert mx.array_equal(a[0], b[0]).item() and mx.array_equal(a[1], b[1]).item()
    nxt = mx.array([[9, 8]])
    assert mx.array_equal(model(nxt, cache=caches), model(nxt, cache=restored)).item()
    assert restored[0].bytes_per_checkpoint() == caches[0].bytes_per_checkpoint() > 0


def test_a_checkpoint_is_one_position():
    _, caches = hybrid_caches()
    codec = codec_for(caches[0])
    assert codec.snapshot(caches[0], 37, 37).stop == 37
    with pytest.raises(CapabilityError, match="position 37, not 36"):
        codec.snapshot(caches[0], 36, 36)
    with pytest.raises(ValueError, match="start must be 0 or equal stop"):
        codec.snapshot(caches[0], 5, 37)
    with pytest.raises(CapabilityError, match="empty"):
        codec.snapshot(build_model("tiny-qwen3_5").make_cache()[0])
    with pytest.raises(CapabilityError, match="signature"):
        codec.snapshot(caches[3])
    snap = codec.snapshot(caches[0])
    bad = type(snap)(snap.signature, 30, 37, snap.tensors, snap.meta)
    with pytest.raises(CorruptEntryError, match="no rows"):
        codec.restore(bad)


@pytest.fixture(scope="module")
def qwen3_next():
    pytest.importorskip("mlx_lm")
    from mlx_lm.models.cache import make_prompt_cache

    from kvstore.testing.mlx_lm_models import build_mlx_lm_model

    model = build_mlx_lm_model("qwen3_next", seed=1)
    caches = make_prompt_cache(model)
    tokens = mx.random.randint(0, 256, (1, 29), key=mx.random.key(2))
    model(tokens, cache=caches)
    mx.eval([c.state for c in caches])
    return model, caches


def test_stock_mlx_lm_arrays_cache_stores_and_restores_bit_exactly(qwen3_next):
    model, caches = qwen3_next
    stock = caches[0]
    assert type(stock).__module__ == "mlx_lm.models.cache"
    assert preds.signature_string(stock) == "rec:arrays:2" and preds.is_recurrent_cache(stock)
    codec = codec_for(stock)
    with pytest.raises(CapabilityError, match="keeps no offset"):
        codec.snapshot(stock)
    position = caches[3].offset  # the position of the model's KV layers
    layers = [
        codec_for(c).snapshot(c, position, position)
        if preds.is_recurrent_cache(c)
        else codec_for(c).snapshot(c)
        for c in caches
    ]
    restored = [restore(s) for s in decode_record_to_mlx(encode_record(layers)).layers]
    assert type(restored[0]) is ArraysCache and restored[0].offset == 29
    for a, b in zip(caches[:3], restored[:3]):
        assert all(mx.array_equal(x, y).item() for x, y in zip(a.cache, b.cache))
    nxt = mx.array([[3]])
    # mlx-lm's own model runs on the restored caches and computes the same logits.
    expected = model(nxt, cache=caches)
    assert mx.array_equal(model(nxt, cache=restored), expected).item()


def test_arrays_cache_is_mlx_lm_compatible():
    pytest.importorskip("mlx_lm")
    from mlx_lm.models.cache import ArraysCache as Stock

    ours, stock = ArraysCache(2), Stock(2)
    for c in (ours, stock):
        c[0] = mx.ones((1, 3, 4))
        c[1] = mx.zeros((1, 2, 2, 2))
    merged = ArraysCache.merge([ours, ours])
    assert merged[0].shape == (2, 3, 4)
    merged.filter(mx.array([1]))
    assert merged[0].shape == (1, 3, 4)
    assert ours.nbytes == stock.nbytes and ours.empty() == stock.empty()
    assert get_codec("rec:arrays:2").slots == 2
