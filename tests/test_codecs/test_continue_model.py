"""Acceptance 2 through a model: a cache restored from records continues with
logits identical, bit for bit, to the cache it was taken from."""

import mlx.core as mx
import pytest

pytest.importorskip("mlx_lm")
from mlx_lm.models import cache as lm_cache  # noqa: E402

from kvstore.caches import (  # noqa: E402
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    RotatingQuantizedKVCache,
    RotatingTurboQuantKVCache,
    TurboQuantKVCache,
)
from kvstore.codecs import (  # noqa: E402
    decode_record,
    decode_record_to_mlx,
    encode_record,
    restore,
    snapshot_held,
)
from kvstore.testing.codec import assert_arrays_equal, assert_snapshots_equal  # noqa: E402
from kvstore.testing.mlx_lm_models import build_mlx_lm_model  # noqa: E402

PREFILL, DECODE = 64, 6
# After restoring: single tokens, a chunk (the multi-token path), single tokens.
CONTINUE = [1, 1, 1, 1, 7, 1, 1, 1]

FAMILIES = {
    "plain": KVCache,
    "quant-4-64": lambda: QuantizedKVCache(64, 4),
    "quant-8-64": lambda: QuantizedKVCache(64, 8),
    # window 24, keep 4: the prefill overflows it and decoding wraps it
    "rotating": lambda: RotatingKVCache(24, keep=4),
    "rotating-quant-8-64": lambda: RotatingQuantizedKVCache(24, keep=4, bits=8),
    "tq-4-3": lambda: TurboQuantKVCache(4, 3),
    "tq-2-2-centred": lambda: TurboQuantKVCache(2, 2, seed=3, center=True),
    "rotating-tq-3-3": lambda: RotatingTurboQuantKVCache(24, keep=4, kbits=3, vbits=3),
    "mlx-lm-plain": lm_cache.KVCache,
    "mlx-lm-quant-4-64": lambda: lm_cache.QuantizedKVCache(64, 4),
    "mlx-lm-rotating": lambda: lm_cache.RotatingKVCache(24, keep=4),
}


def tokens(n, seed):
    return mx.random.randint(0, 256, (1, n), key=mx.random.key(seed))


def prefill_and_decode(model, caches):
    prompt = tokens(PREFILL + DECODE, seed=1)
    model(prompt[:, :PREFILL], cache=caches)
    for i in range(PREFILL, PREFILL + DECODE):
        model(prompt[:, i : i + 1], cache=caches)


def through_records(caches, to_mlx):
    """Every layer's held snapshots, stored as a store would (one record per
    range index, all layers in each), decoded, and restored."""
    held = [snapshot_held(c) for c in caches]
    records = [
        encode_record([h[j] if j < len(h) else None for h in held], meta={"part": j})
        for j in range(max(map(len, held)))
    ]
    decode = decode_record_to_mlx if to_mlx else decode_record
    layers = [decode(r).layers for r in records]
    restored = [
        restore([rec[i] for rec in layers if rec[i] is not None]) for i in range(len(caches))
    ]
    for original, again in zip(held, restored, strict=True):
        assert_snapshots_equal(original, snapshot_held(again))
    return restored


def continue_both(model, a, b):
    seq = tokens(sum(CONTINUE), seed=2)
    pos = 0
    for n in CONTINUE:
        chunk = seq[:, pos : pos + n]
        want, got = model(chunk, cache=a), model(chunk, cache=b)
        mx.eval(want, got)
        assert_arrays_equal(want, got, f"logits at position {PREFILL + DECODE + pos} (+{n})")
        pos += n


@pytest.mark.parametrize("to_mlx", [False, True], ids=["numpy-views", "to-mlx"])
@pytest.mark.parametrize("dtype", [None, mx.float16, mx.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize(
    "family, head_dim",
    [(f, 64) for f in FAMILIES]
    # head_dim 96: TurboQuant's dense rotation, restored from the matrix the records carry
    + [("tq-4-3", 96), ("rotating-tq-3-3", 96)],
)
def test_restored_cache_continues_with_identical_logits(family, head_dim, dtype, to_mlx):
    model = build_mlx_lm_model("llama", head_dim=head_dim)
    if dtype is not None:
        model.set_dtype(dtype)
    original = [FAMILIES[family]() for _ in model.layers]
    prefill_and_decode(model, original)
    restored = through_records(original, to_mlx)
    continue_both(model, original, restored)
    for a, b in zip(original, restored, strict=True):
        assert_snapshots_equal(snapshot_held(a), snapshot_held(b))


@pytest.mark.parametrize("dtype", [None, mx.bfloat16], ids=["fp32", "bf16"])
def test_gemma3_sliding_and_global_layers_continue_identically(dtype):
    model = build_mlx_lm_model("gemma3_text")
    if dtype is not None:
        model.set_dtype(dtype)
    original = [
        RotatingKVCache(c.max_size, keep=c.keep)
        if type(c) is lm_cache.RotatingKVCache
        else KVCache()
        for c in model.make_cache()
    ]
    prefill_and_decode(model, original)
    restored = through_records(original, to_mlx=True)
    assert [type(c).__name__ for c in restored] == ["RotatingKVCache", "KVCache"] * 2
    continue_both(model, original, restored)
