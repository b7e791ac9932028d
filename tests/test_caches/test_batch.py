"""Row-batched caches: mlx-lm's BatchGenerator batches each of our plain and affine
families, growing and windowed, with the tokens of one sequence at a time."""

from __future__ import annotations

import mlx.core as mx
import pytest

from kvstore.abc.cache import (
    is_plain_kv_cache,
    is_quantized_kv_cache,
    is_sliding_window_cache,
    signature_of,
    uses_quantized_attention,
)
from kvstore.caches import (
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    RotatingQuantizedKVCache,
    TurboQuantKVCache,
)
from kvstore.caches.batch import (
    BatchKVCache,
    BatchQuantizedKVCache,
    BatchRotatingKVCache,
    BatchRotatingQuantizedKVCache,
    merge_caches,
)
from kvstore.errors import CapabilityError

pytest.importorskip("mlx_lm")

from mlx_lm.generate import BatchGenerator, generate_step  # noqa: E402

from kvstore.testing.mlx_lm_models import build_mlx_lm_model  # noqa: E402
from tests.markers import needs_tested_mlx_lm  # noqa: E402

WINDOW = 16  # the tiny gemma3's sliding window (TINY_ARGS)


def family_caches(model, affine: bool):
    """Our caches of one family for ``model``'s layers (windows where it has them)."""
    out = []
    for c in model.make_cache() if hasattr(model, "make_cache") else [None] * len(model.layers):
        window = getattr(c, "max_size", None)
        if affine:
            out.append(
                RotatingQuantizedKVCache(window, 0, 64, 8) if window else QuantizedKVCache(64, 8)
            )
        else:
            out.append(RotatingKVCache(window) if window else KVCache())
    return out


def single(model, prompt, n, affine):
    caches = family_caches(model, affine)
    return [t for t, _ in generate_step(mx.array(prompt), model, prompt_cache=caches, max_tokens=n)]


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
@pytest.mark.parametrize(
    "affine",
    [False, pytest.param(True, marks=needs_tested_mlx_lm)],  # mlx-lm 0.32's quantized batches
    ids=["plain", "affine"],
)
def test_a_batch_of_our_caches_gives_each_rows_own_tokens(arch, affine):
    model = build_mlx_lm_model(arch, scale=0.15)
    prompts = [list(range(3, 40)), list(range(50, 60)), list(range(7, 90))]
    n = 24
    want = [single(model, p, n, affine) for p in prompts]
    gen = BatchGenerator(model, max_tokens=n, prefill_step_size=16)  # windows wrap in prefill
    history = family_caches(model, affine)  # a row joining with 20 tokens of history
    model(mx.array([prompts[2][:20]]), cache=history)
    mx.eval([c.state for c in history])
    uids = gen.insert(prompts[:2], caches=[family_caches(model, affine) for _ in range(2)])
    out: dict[int, list[int]] = {}
    for _ in range(5):  # the first two are decoding when the third joins
        for r in gen.next_generated():
            out.setdefault(r.uid, []).append(r.token)
    uids += gen.insert([prompts[2][20:]], caches=[history])
    while not all(len(out.get(u, [])) >= n for u in uids):
        for r in gen.next_generated():
            out.setdefault(r.uid, []).append(r.token)
    gen.close()
    assert [out[u][:n] for u in uids] == want


def filled(cache, tokens: int, seed: int):
    mx.random.seed(seed)
    cache.update_and_fetch(
        mx.random.normal((1, 2, tokens, 64)), mx.random.normal((1, 2, tokens, 64))
    )
    return cache


@pytest.mark.parametrize(
    "make, batch_cls, signature",
    [
        (KVCache, BatchKVCache, "batch:kv:plain"),
        (lambda: QuantizedKVCache(64, 4), BatchQuantizedKVCache, "batch:kv:quant:4:64"),
        (lambda: RotatingKVCache(32), BatchRotatingKVCache, "batch:kv:rotating-plain"),
        (
            lambda: RotatingQuantizedKVCache(32, 0, 32, 8),
            BatchRotatingQuantizedKVCache,
            "batch:kv:rotating-quant:8:32",
        ),
    ],
)
def test_merge_extract_filter_extend_round_trip_rows_bit_exactly(make, batch_cls, signature):
    rows = [filled(make(), n, seed) for seed, n in enumerate((5, 12, 9))]
    batch = type(rows[0]).merge(rows)
    assert type(batch) is batch_cls and batch.signature() == signature
    assert str(signature_of(batch)) == signature and signature_of(batch).inner is not None
    assert batch.offset.tolist() == [int(r.offset) for r in rows]
    for i, row in enumerate(rows):
        back = batch.extract(i)
        assert type(back) is type(row) and back.signature() == row.signature()
        assert back.offset == row.offset
        for a, b in zip(_leaves(back), _leaves(row)):
            assert mx.array_equal(a, b).item()
    batch.filter([2, 0])
    assert batch.offset.tolist() == [9, 5]
    more = type(rows[0]).merge([filled(make(), 3, 7)])
    batch.extend(more)
    assert batch.offset.tolist() == [9, 5, 3]
    for i, row in enumerate([rows[2], rows[0]]):
        for a, b in zip(_leaves(batch.extract(i)), _leaves(row)):
            assert mx.array_equal(a, b).item()


def _leaves(cache):
    keys, values = (
        cache.temporal_keys_and_values()
        if hasattr(cache, "temporal_keys_and_values")
        else cache.keys_and_values()
    )
    flat = []
    for tree in (keys, values):
        flat.extend(tree if isinstance(tree, (tuple, list)) else [tree])
    return flat


def test_predicates_fail_closed_on_batches_and_attention_routes_on_affine_rows():
    batch = merge_caches([filled(QuantizedKVCache(64, 8), 4, 0)])
    assert signature_of(batch).kind == "batch"
    for predicate in (is_plain_kv_cache, is_quantized_kv_cache, is_sliding_window_cache):
        assert predicate(batch) is False
    assert uses_quantized_attention(batch) is False  # our model never sees a batch
    assert (batch.bits, batch.group_size) == (8, 64)  # mlx-lm's attention routes on these
    assert not hasattr(merge_caches([filled(KVCache(), 4, 0)]), "bits")


def test_what_does_not_batch_says_so():
    with pytest.raises(CapabilityError, match="share a family"):
        merge_caches([filled(KVCache(), 3, 0), filled(QuantizedKVCache(64, 8), 3, 1)])
    with pytest.raises(CapabilityError, match="share a family"):
        merge_caches([filled(QuantizedKVCache(64, 8), 3, 0), filled(QuantizedKVCache(64, 4), 3, 1)])
    with pytest.raises(CapabilityError, match="keep 0"):
        merge_caches([filled(RotatingKVCache(32, keep=4), 8, 0)])
    assert not hasattr(TurboQuantKVCache(4, 4), "merge")  # mlx-lm serves these one at a time


@pytest.mark.parametrize(
    "empty, make",
    [
        (lambda: BatchKVCache([1, 0]), KVCache),
        (lambda: BatchRotatingKVCache(32, [1, 0]), lambda: RotatingKVCache(32)),
    ],
)
def test_left_padding_goes_on_an_empty_batch_only(empty, make):
    batch = empty()
    batch.prepare(left_padding=[2, 3])
    assert batch.left_padding.tolist() == [3, 3] and batch.offset.tolist() == [-3, -3]
    filled_batch = merge_caches([filled(make(), 4, 0), filled(make(), 6, 1)])
    with pytest.raises(ValueError, match="only be added to an empty batch"):
        filled_batch.prepare(left_padding=[1, 1])
    assert filled_batch.offset.tolist() == [4, 6]  # unchanged
