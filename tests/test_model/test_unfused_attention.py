"""Dense attention by plain ops for calls of few queries (``KVSTORE_UNFUSED_ATTENTION``).

On MLX's CUDA backend the fused kernel builds a cuDNN graph for every new shape of a
call of 4 queries or more, so there (``auto``) such calls with few scores take
:func:`~kvstore.model.attention.unfused_attention`. That build cannot happen on this CPU;
the route itself runs here with ``always``, and must give the fused kernel's numbers.
"""

import mlx.core as mx
import pytest

from kvstore.caches.mask import create_causal_mask
from kvstore.errors import KVStoreError
from kvstore.model import attention, build_model
from kvstore.model.attention import (
    UNFUSED_ATTENTION,
    UNFUSED_SCORES_MAX,
    attends_unfused,
    unfused_attention,
)

from .conftest import prompt_tokens

SCALE = 0.125


def qkv(queries, keys, q_heads=8, kv_heads=2, dim=64, value_dim=None, batch=1, seed=0):
    mx.random.seed(seed)
    q = mx.random.normal((batch, q_heads, queries, dim))
    k = mx.random.normal((batch, kv_heads, keys, dim))
    v = mx.random.normal((batch, kv_heads, keys, value_dim or dim))
    return q, k, v


def fused(q, k, v, mask):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=SCALE, mask=mask)


def by_definition(q, k, v, mask):
    """softmax(q k^T * scale + mask) v, every query head on its own key head."""
    repeats = q.shape[1] // k.shape[1]
    k, v = (mx.repeat(x, repeats, axis=1) for x in (k, v))
    scores = (q * SCALE) @ k.swapaxes(-1, -2)
    if mask is not None:
        scores = mx.where(mask, scores, -mx.inf) if mask.dtype == mx.bool_ else scores + mask
    return mx.softmax(scores, axis=-1, precise=True) @ v


@pytest.mark.parametrize("q_heads,kv_heads", [(8, 2), (4, 4), (8, 1)])
@pytest.mark.parametrize("queries,keys", [(5, 5), (7, 40), (33, 300)])
def test_equals_the_fused_kernel_with_every_kind_of_mask(q_heads, kv_heads, queries, keys):
    q, k, v = qkv(queries, keys, q_heads, kv_heads)
    causal = create_causal_mask(queries, keys - queries)
    windowed = create_causal_mask(queries, keys - queries, window_size=4)
    additive = mx.where(windowed, 0.0, -1e9).astype(mx.float32)
    for mask in (None, "causal", causal, windowed, additive):
        got = unfused_attention(q, k, v, SCALE, mask)
        assert got.shape == (1, q_heads, queries, 64) and got.dtype == q.dtype
        assert mx.array_equal(got, fused(q, k, v, mask)), f"mask {mask!r:.40}"


def test_batch_masks_hide_each_rows_padding():
    # mlx-lm's batch caches: [B, 1, L, T] boolean masks, each row its own left padding.
    q, k, v = qkv(6, 20, batch=3)
    mask = create_causal_mask(6, 14, left_padding=mx.array([0, 3, 9]))
    got = unfused_attention(q, k, v, SCALE, mask)
    assert mx.allclose(got, by_definition(q, k, v, mask), atol=1e-5)
    assert mx.array_equal(got, fused(q, k, v, mask))


def test_values_of_another_width_and_bfloat16():
    q, k, v = qkv(9, 30, value_dim=32)
    got = unfused_attention(q, k, v, SCALE, "causal")
    assert got.shape == (1, 8, 9, 32)
    assert mx.allclose(got, by_definition(q, k, v, create_causal_mask(9, 21)), atol=1e-5)
    # bfloat16: the scores, softmax and weighted sum in float32, so the output is off
    # the float32 result by its own rounding to bfloat16; MLX's CPU kernel, which rounds
    # the scores, is further off.
    exact = [x.astype(mx.bfloat16).astype(mx.float32) for x in qkv(60, 200)]
    want = by_definition(*exact, create_causal_mask(60, 140))
    q, k, v = (x.astype(mx.bfloat16) for x in exact)
    got = unfused_attention(q, k, v, SCALE, "causal")
    assert got.dtype == mx.bfloat16
    ours, kernels = (
        mx.abs(x.astype(mx.float32) - want).max().item() for x in (got, fused(q, k, v, "causal"))
    )
    floor = mx.abs(want.astype(mx.bfloat16).astype(mx.float32) - want).max().item()
    assert ours <= floor * 1.01 and ours < kernels, (ours, floor, kernels)


def test_which_calls_take_plain_ops(monkeypatch):
    monkeypatch.delenv(UNFUSED_ATTENTION, raising=False)
    assert not attends_unfused(8, 100)  # auto: only on MLX's CUDA backend, not this CPU
    monkeypatch.setenv(UNFUSED_ATTENTION, "always")
    assert attends_unfused(2, 100) and attends_unfused(8, UNFUSED_SCORES_MAX // 8)
    assert not attends_unfused(1, 100)  # one query: the vector kernel, built once
    assert not attends_unfused(8, UNFUSED_SCORES_MAX // 8 + 1)  # too many scores
    monkeypatch.setenv(UNFUSED_ATTENTION, "never")
    assert not attends_unfused(8, 100)
    monkeypatch.setenv(UNFUSED_ATTENTION, "sometimes")
    with pytest.raises(KVStoreError, match=r"KVSTORE_UNFUSED_ATTENTION must be one of auto, "):
        attends_unfused(8, 100)


@pytest.fixture(scope="module", params=["tiny", "tiny-gemma3"])
def model(request):
    return build_model(request.param)


def test_a_models_logits_are_the_fused_kernels(model, monkeypatch):
    """A chunked prefill (the later chunks over cached rows, gemma3's windows masked by
    arrays) and decode steps, every multi-query call by plain ops, give the logits the
    fused kernel gives."""
    calls = []

    def spy(q, k, v, scale, mask):
        calls.append(q.shape[-2])
        return unfused_attention(q, k, v, scale, mask)

    monkeypatch.setattr(attention, "unfused_attention", spy)
    tokens = prompt_tokens(n=100)

    def logits():
        caches = model.make_cache()
        out = [model(tokens[None, b:e], cache=caches)[0] for b, e in ((0, 40), (40, 97))]
        out += [model(tokens[None, i : i + 1], cache=caches)[0] for i in range(97, 100)]
        return mx.concatenate(out, axis=0)

    monkeypatch.setenv(UNFUSED_ATTENTION, "never")
    want = logits()
    assert calls == []
    monkeypatch.setenv(UNFUSED_ATTENTION, "always")
    got = logits()
    assert set(calls) == {40, 57}  # both chunks in every attention layer; no decode step
    assert mx.array_equal(got, want)
