"""Acceptance 4: exactly the right predicates per family; unknown fails closed."""

import mlx.core as mx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.abc import cache as preds
from kvstore.caches import KVCache, QuantizedKVCache, RotatingKVCache, RotatingQuantizedKVCache
from kvstore.errors import CapabilityError

FAMILY_PREDICATES = [
    preds.is_plain_kv_cache,
    preds.is_quantized_kv_cache,
    preds.is_rotating_plain_cache,
    preds.is_rotating_quantized_cache,
    preds.is_turboquant_cache,
    preds.is_sliding_window_cache,
    preds.uses_quantized_attention,
    preds.uses_dense_attention,
]
ALL_PREDICATES = [*FAMILY_PREDICATES, preds.can_trim]


def true_predicates(cache):
    return {p.__name__ for p in ALL_PREDICATES if p(cache)}


@pytest.mark.parametrize(
    "make, expected",
    [
        (KVCache, {"is_plain_kv_cache", "uses_dense_attention", "can_trim"}),
        (
            lambda: QuantizedKVCache(64, 4),
            {"is_quantized_kv_cache", "uses_quantized_attention", "can_trim"},
        ),
        (
            lambda: RotatingKVCache(8),
            {
                "is_rotating_plain_cache",
                "is_sliding_window_cache",
                "uses_dense_attention",
                "can_trim",
            },
        ),
        (
            lambda: RotatingQuantizedKVCache(8, bits=4),
            {
                "is_rotating_quantized_cache",
                "is_sliding_window_cache",
                "uses_quantized_attention",
                "can_trim",
            },
        ),
    ],
)
def test_exactly_the_right_predicates(make, expected):
    assert true_predicates(make()) == expected


def test_can_trim_follows_runtime_state():
    cache = RotatingKVCache(4)
    x = mx.zeros((1, 1, 1, 8))
    for _ in range(4):
        assert preds.can_trim(cache)
        cache.update_and_fetch(x, x)
    assert not preds.can_trim(cache)  # wrapped: the window has lost tokens


def test_quantized_attention_params_from_family_and_signature():
    q = preds.quantized_attention_params(RotatingQuantizedKVCache(8, bits=5, group_size=32))
    assert (q.mode, q.bits, q.group_size) == ("affine", 5, 32)
    with pytest.raises(CapabilityError, match="'kv:plain'"):
        preds.quantized_attention_params(KVCache())
    with pytest.raises(CapabilityError, match="'unknown'"):
        preds.quantized_attention_params(object())


def test_mlx_lm_caches_recognised_by_alias():
    lm = pytest.importorskip("mlx_lm.models.cache")
    assert preds.signature_string(lm.KVCache()) == "kv:plain"
    assert preds.signature_string(lm.QuantizedKVCache(group_size=32, bits=4)) == "kv:quant:4:32"
    assert preds.signature_string(lm.RotatingKVCache(max_size=16)) == "kv:rotating-plain"
    assert preds.uses_quantized_attention(lm.QuantizedKVCache())

    class Sub(lm.KVCache):  # a subclass may change semantics: not aliased
        pass

    assert preds.signature_of(Sub()) is None
    assert true_predicates(Sub()) == set()


class Reports:
    def __init__(self, result):
        self.result = result

    def signature(self):
        if isinstance(self.result, BaseException):
            raise self.result
        return self.result

    def is_trimmable(self):
        return True

    def trim(self, n):
        return n


@given(st.one_of(st.text(max_size=30), st.integers(), st.none(), st.binary(max_size=8)))
def test_no_predicate_true_for_unknown_signature(result):
    obj = Reports(result)
    if preds.signature_of(obj) is not None:
        return  # hypothesis found a valid signature string: not an unknown one
    assert preds.signature_string(obj) == "unknown"
    assert true_predicates(obj) == set()


@given(st.sampled_from([object(), 3, "kv:plain", None, [KVCache()], Reports(ValueError("boom"))]))
def test_objects_without_a_signature_fail_closed(obj):
    assert preds.signature_of(obj) is None
    assert true_predicates(obj) == set()


def test_kv_predicates_fail_closed_on_another_state(registries_restored):
    # Issue 16 added recurrent state: every KV predicate is false on it.
    from kvstore.family import RECURRENT_STATE, Family, register_family

    register_family(
        Family("kv:toy-recurrent", "a test family of recurrent state", state=RECURRENT_STATE)
    )

    class Recurrent:
        def signature(self):
            return "kv:toy-recurrent"

        def is_trimmable(self):
            return True

        def trim(self, n):
            return n

    cache = Recurrent()
    assert preds.family_of(cache).state == RECURRENT_STATE
    assert preds.is_recurrent_cache(cache)
    assert true_predicates(cache) == {"can_trim"}  # trimming is the cache's own answer
    with pytest.raises(CapabilityError):
        preds.quantized_attention_params(cache)
