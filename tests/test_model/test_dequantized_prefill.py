"""Quantized caches attended dequantized for calls of many queries (issue 17, G5 on CUDA).

MLX 0.32.4's CUDA backend has no ``quantized_matmul`` kernel for a prefill's
shapes, so there (``KVSTORE_DEQUANTIZED_PREFILL=auto``) a call of more than one
query dequantizes the packed rows and runs the fused dense kernel. That CUDA
failure cannot happen on this CPU; the route itself runs here with ``always``.
"""

import mlx.core as mx
import pytest

from kvstore.caches import KVCache, RotatingKVCache
from kvstore.errors import KVStoreError
from kvstore.model import CachePolicy, attention, build_model
from kvstore.model.attention import DEQUANTIZED_PREFILL, dequantizes_queries

from .conftest import prompt_tokens, rel_err

#: Prefill chunks: the later ones attend over rows already cached, as the one that
#: failed on the H200 (2047 queries over 4095 keys) did.
CHUNKS = [(0, 48), (48, 96), (96, 128)]
DECODE = 16


@pytest.fixture(scope="module", params=["tiny", "tiny-gemma3"])
def model(request):
    return build_model(request.param)


def run(model, caches, tokens):
    """Every position's logits: the chunked prefill, then DECODE one-token steps."""
    out = [model(tokens[None, b:e], cache=caches)[0] for b, e in CHUNKS]
    end = CHUNKS[-1][1]
    out += [model(tokens[None, i : i + 1], cache=caches)[0] for i in range(end, end + DECODE)]
    logits = mx.concatenate(out, axis=0)
    mx.eval(logits)
    return logits


def decoded_rows_caches(model, params):
    """Dense caches holding each row as ``mx.quantize(x, **params)`` then
    ``mx.dequantize`` give it back: what the dequantized route attends over."""

    def holding(base):
        class Decoded(base):
            def _encode(self, x):
                return mx.dequantize(*mx.quantize(x, **params), dtype=x.dtype, **params)

        return Decoded

    return [
        holding(KVCache)()
        if layer["sliding_window"] is None
        else holding(RotatingKVCache)(layer["sliding_window"])
        for layer in model.layer_layout()
    ]


FAMILIES = {
    # family: (the existing tests' tolerance for the same decoded values summed by
    # another kernel, mx.quantize's arguments)
    "kv:quant:4:64": (1e-5, dict(group_size=64, bits=4)),
    "kv:quant:8:32": (1e-5, dict(group_size=32, bits=8)),
    "kv:mxfp4": (1e-4, dict(mode="mxfp4")),
    "kv:nvfp4": (1e-4, dict(mode="nvfp4")),
}


def routes(monkeypatch):
    """The query counts of the calls each route ran (a spy around both, which run)."""
    seen = {"quantized": [], "dequantized": []}
    for name in seen:
        kernel = getattr(attention, f"{name}_attention")

        def spy(queries, *args, _kernel=kernel, _calls=seen[name], **kwargs):
            _calls.append(queries.shape[-2])
            return _kernel(queries, *args, **kwargs)

        monkeypatch.setattr(attention, f"{name}_attention", spy)
    return seen


@pytest.mark.parametrize("family", list(FAMILIES))
def test_dequantized_prefill_equals_the_quantized_matmul_path(model, family, monkeypatch):
    tolerance, params = FAMILIES[family]
    tokens = prompt_tokens()
    policy = CachePolicy(family=family)
    monkeypatch.setenv(DEQUANTIZED_PREFILL, "never")
    packed = run(model, model.make_cache(policy), tokens)
    monkeypatch.setenv(DEQUANTIZED_PREFILL, "always")
    seen = routes(monkeypatch)
    dequantized = run(model, model.make_cache(policy), tokens)
    assert rel_err(dequantized, packed) <= tolerance

    # Every prefill chunk took the dense kernel, every decode step quantized_matmul...
    layers = len(model.layers)
    assert seen["dequantized"] == [e - b for b, e in CHUNKS for _ in range(layers)]
    assert seen["quantized"] == [1] * (DECODE * layers)
    # ... and the prefill is bit for bit what dense caches of the decoded rows give.
    prefilled = CHUNKS[-1][1]
    expected = run(model, decoded_rows_caches(model, params), tokens)
    assert mx.array_equal(dequantized[:prefilled], expected[:prefilled]).item()


def test_one_query_always_reads_the_packed_rows(monkeypatch):
    for choice in ("auto", "always", "never"):
        monkeypatch.setenv(DEQUANTIZED_PREFILL, choice)
        assert not dequantizes_queries(1)
    monkeypatch.setenv(DEQUANTIZED_PREFILL, "always")
    assert dequantizes_queries(2)
    monkeypatch.setenv(DEQUANTIZED_PREFILL, "never")
    assert not dequantizes_queries(2048)


def test_auto_dequantizes_on_cuda_only(monkeypatch):
    monkeypatch.delenv(DEQUANTIZED_PREFILL, raising=False)
    on_cuda = mx.default_device() == mx.gpu and mx.cuda.is_available()
    assert dequantizes_queries(2048) == on_cuda


def test_a_bad_setting_is_refused_with_the_choices(model, monkeypatch):
    monkeypatch.setenv(DEQUANTIZED_PREFILL, "yes")
    caches = model.make_cache(CachePolicy(kv_bits=4))
    with pytest.raises(
        KVStoreError,
        match=r"KVSTORE_DEQUANTIZED_PREFILL must be one of "
        r"auto, always, never; got 'yes'",
    ) as info:
        model(prompt_tokens()[None, :8], cache=caches)
    assert info.value.found == "yes"
