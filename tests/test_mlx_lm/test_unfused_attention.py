"""mlx-lm models' few-query attention by plain ops and quantized caches' attention by
kvstore's kernel (``kvstore.mlx_lm.attention``), as ``kvstore serve`` routes the models
it loads: the same logits as mlx-lm's own route, one-query dense steps left to it."""

import sys

import mlx.core as mx
import pytest
from mlx_lm.models import base
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

from kvstore.mlx_lm.attention import unfused_for_model
from kvstore.model.attention import UNFUSED_ATTENTION
from tests.markers import needs_tested_mlx_lm


@pytest.fixture
def routed(load, monkeypatch):
    """``routed(arch) -> model`` with its modules routed, put back after the test."""

    def get(arch):
        model, _ = load(arch)
        for _, module in model.named_modules():
            name = type(module).__module__
            if hasattr(sys.modules[name], "scaled_dot_product_attention"):
                monkeypatch.setattr(
                    sys.modules[name],
                    "scaled_dot_product_attention",
                    sys.modules[name].scaled_dot_product_attention,
                )
        return model

    return get


def run(model, caches, tokens):
    out = [model(tokens[None, b:e], cache=caches)[0] for b, e in ((0, 30), (30, 61))]
    out += [model(tokens[None, i : i + 1], cache=caches)[0] for i in range(61, 64)]
    return mx.concatenate(out, axis=0)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_routed_models_give_mlx_lms_logits(routed, monkeypatch, arch):
    model = routed(arch)
    tokens = mx.random.randint(0, 200, (64,), key=mx.random.key(3))
    want = run(model, make_prompt_cache(model), tokens)

    def quantized():
        return [QuantizedKVCache(group_size=32, bits=8) for _ in model.layers]

    want_quantized = run(model, quantized(), tokens)
    module = type(model).__module__
    assert unfused_for_model(model) == [module]
    assert unfused_for_model(model) == [module]  # idempotent
    wrapped = sys.modules[module].scaled_dot_product_attention
    assert wrapped.__wrapped__ is base.scaled_dot_product_attention

    calls = []
    import kvstore.mlx_lm.attention as routing

    def spy(q, *args):
        calls.append(q.shape[-2])
        return unfused(q, *args)

    unfused = routing.unfused_attention
    monkeypatch.setattr(routing, "unfused_attention", spy)
    monkeypatch.setenv(UNFUSED_ATTENTION, "always")
    got = run(model, make_prompt_cache(model), tokens)
    assert set(calls) == {30, 31}  # both chunks, in every layer; no one-token step
    assert mx.array_equal(got, want)

    calls.clear()  # quantized caches: kvstore's kernel, bit-identical to mlx-lm's here
    packed_calls = []

    def packed_spy(q, *args, **kwargs):
        packed_calls.append(q.shape[-2])
        return packed(q, *args, **kwargs)

    packed = routing.packed_attention
    monkeypatch.setattr(routing, "packed_attention", packed_spy)
    got_quantized = run(model, quantized(), tokens)
    assert calls == [] and set(packed_calls) == {30, 31, 1}
    assert mx.array_equal(got_quantized, want_quantized)


def test_a_model_whose_modules_attend_otherwise_is_left_alone(load):
    import mlx.nn as nn

    assert unfused_for_model(nn.Sequential(nn.Linear(2, 2))) == []


@needs_tested_mlx_lm
def test_stream_generate_routes_the_model_it_is_given(load, monkeypatch, tmp_path):
    from kvstore.mlx_lm import StorePromptCache, stream_generate
    from kvstore.store import open_store

    model, tokenizer = load("qwen3")
    module = sys.modules[type(model).__module__]
    # As a fresh process has it (an earlier test may have routed it), put back afterwards.
    monkeypatch.setattr(module, "scaled_dot_product_attention", base.scaled_dot_product_attention)
    with open_store(f"lmdb://{tmp_path / 'store'}", block_size=16) as store:
        cache = StorePromptCache(store, model)
        out = list(stream_generate(model, tokenizer, "def f(x):", prompt_cache=cache, max_tokens=2))
        cache.flush()
    assert len(out) == 2
    assert module.scaled_dot_product_attention.__wrapped__ is base.scaled_dot_product_attention
