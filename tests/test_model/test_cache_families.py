"""Acceptance 3: every cache family runs through the model, routed by signature only."""

import mlx.core as mx
import pytest

from kvstore.abc.cache import signature_string
from kvstore.caches import KVCache, RotatingKVCache
from kvstore.errors import CapabilityError, UnknownSignatureError
from kvstore.family import Family, register_family
from kvstore.model import CachePolicy, build_model

from .conftest import prompt_tokens, rel_err, teacher_forced

LAYOUTS = ["tiny", "tiny-gemma3"]  # all global layers; sliding layers interleaved


@pytest.fixture(scope="module", params=LAYOUTS)
def model(request):
    return build_model(request.param)


@pytest.fixture(scope="module")
def plain_logits(model):
    return teacher_forced(model, model.make_cache(), prompt_tokens())


def dequantizing(base, bits, group_size):
    """A dense family whose rows went through affine quantization and back: what
    quantized attention must equal when it attends over the packed rows."""

    class Dequantizing(base):
        def _encode(self, x):
            return mx.dequantize(*mx.quantize(x, group_size, bits), group_size, bits)

    return Dequantizing


def dense_equivalent(model, bits, group_size):
    return [
        dequantizing(KVCache, bits, group_size)()
        if layer["sliding_window"] is None
        else dequantizing(RotatingKVCache, bits, group_size)(layer["sliding_window"])
        for layer in model.layer_layout()
    ]


def expected_signatures(model, growing, rotating):
    return [growing if lay["sliding_window"] is None else rotating for lay in model.layer_layout()]


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group_size", [32, 64])
def test_quantized_attention_equals_dense_attention_over_dequantized_rows(model, bits, group_size):
    caches = model.make_cache(CachePolicy(kv_bits=bits, kv_group_size=group_size))
    assert [signature_string(c) for c in caches] == expected_signatures(
        model, f"kv:quant:{bits}:{group_size}", f"kv:rotating-quant:{bits}:{group_size}"
    )
    tokens = prompt_tokens()
    got = teacher_forced(model, caches, tokens)
    expected = teacher_forced(model, dense_equivalent(model, bits, group_size), tokens)
    assert rel_err(got, expected) <= 1e-5


def dequantizing_mode(base, mode):
    """A dense family holding rows that went through ``mode`` and back."""

    class Dequantizing(base):
        def _encode(self, x):
            return mx.dequantize(*mx.quantize(x, mode=mode), mode=mode, dtype=x.dtype)

    return Dequantizing


@pytest.mark.parametrize("mode", ["mxfp8", "mxfp4", "nvfp4"])
def test_microscaling_attention_equals_dense_attention_over_dequantized_rows(model, mode):
    caches = model.make_cache(CachePolicy(family=f"kv:{mode}"))
    assert [signature_string(c) for c in caches] == expected_signatures(
        model, f"kv:{mode}", f"kv:rotating-{mode}"
    )
    dense = [
        dequantizing_mode(KVCache, mode)()
        if layer["sliding_window"] is None
        else dequantizing_mode(RotatingKVCache, mode)(layer["sliding_window"])
        for layer in model.layer_layout()
    ]
    tokens = prompt_tokens()
    got = teacher_forced(model, caches, tokens)
    # The same decoded values summed by another kernel (misrouted rows cost > 1e-2).
    assert rel_err(got, teacher_forced(model, dense, tokens)) <= 1e-4


def test_plain_and_rotating_families(model, plain_logits):
    caches = model.make_cache()
    assert [signature_string(c) for c in caches] == expected_signatures(
        model, "kv:plain", "kv:rotating-plain"
    )
    assert mx.array_equal(teacher_forced(model, caches, prompt_tokens()), plain_logits).item()


def test_quant_8_64_close_to_plain(model, plain_logits):
    q8 = teacher_forced(model, model.make_cache(CachePolicy(kv_bits=8)), prompt_tokens())
    q4 = teacher_forced(model, model.make_cache(CachePolicy(kv_bits=4)), prompt_tokens())
    err8, err4 = rel_err(q8, plain_logits), rel_err(q4, plain_logits)
    assert err8 <= 1e-2
    assert err8 <= err4 / 8  # 4 more bits: ~16x finer steps
    assert mx.array_equal(q8.argmax(-1), plain_logits.argmax(-1)).item()


def test_keep_sink_tokens_on_sliding_layers():
    model = build_model("tiny-gemma3")
    caches = model.make_cache(CachePolicy(keep=4))
    assert [getattr(c, "keep", None) for c in caches] == [4, 4, None]
    teacher_forced(model, caches, prompt_tokens())  # windows wrap past the sinks
    assert all(c.offset == 144 for c in caches)


def test_mlx_lm_caches_run_through_the_model_via_aliases(model, plain_logits):
    pytest.importorskip("mlx_lm")
    from mlx_lm.models import cache as lm_cache

    plain = [
        lm_cache.KVCache()
        if lay["sliding_window"] is None
        else lm_cache.RotatingKVCache(max_size=lay["sliding_window"])
        for lay in model.layer_layout()
    ]
    assert mx.array_equal(teacher_forced(model, plain, prompt_tokens()), plain_logits).item()
    if all(lay["sliding_window"] is None for lay in model.layer_layout()):
        theirs = [lm_cache.QuantizedKVCache(group_size=64, bits=8) for _ in model.layers]
        ours = model.make_cache(CachePolicy(kv_bits=8))
        tokens = prompt_tokens()
        assert mx.array_equal(
            teacher_forced(model, theirs, tokens), teacher_forced(model, ours, tokens)
        ).item()


class StandInTurboQuant(KVCache):
    """Dense rows under a TurboQuant signature, with the ``bits``/``group_size``
    attributes that made mlx-lm's ``hasattr(cache, "bits")`` route such caches
    into affine attention. The signature alone must decide: dense attention."""

    bits, group_size = 4, 64

    def signature(self):
        return "kv:turboquant:4:4"


class StandInRotatingTurboQuant(RotatingKVCache):
    bits, group_size = 3, 64

    def signature(self):
        return "kv:rotating-turboquant:3:3"


def test_turboquant_signatures_get_dense_attention(model, plain_logits):
    caches = [
        StandInTurboQuant()
        if lay["sliding_window"] is None
        else StandInRotatingTurboQuant(lay["sliding_window"])
        for lay in model.layer_layout()
    ]
    assert mx.array_equal(teacher_forced(model, caches, prompt_tokens()), plain_logits).item()


def test_real_turboquant_family_runs(model):
    caches = model.make_cache(CachePolicy(turboquant=(4, 4)))
    assert [signature_string(c) for c in caches] == expected_signatures(
        model, "kv:turboquant:4:4", "kv:rotating-turboquant:4:4"
    )
    logits = teacher_forced(model, caches, prompt_tokens())
    assert mx.isfinite(logits).all().item()


class NoSignature:
    """Looks like a cache (offset, update_and_fetch, make_mask) but says nothing of its family."""

    def __init__(self):
        self.inner = KVCache()
        self.update_and_fetch = self.inner.update_and_fetch
        self.make_mask = self.inner.make_mask

    @property
    def offset(self):
        return self.inner.offset


class MisspelledSignature(KVCache):
    def signature(self):
        return "kv:plane"


class UnregisteredWrapper(KVCache):
    def signature(self):
        return "wrap:kv:plain"  # no wrapper family "wrap" is registered


class BatchOfRows(KVCache):
    def signature(self):
        return "batch:kv:plain"  # registered (issue 15), but a batch holds no one sequence's KV


@pytest.mark.parametrize(
    "bad, signature",
    [
        (NoSignature, "unknown"),
        (MisspelledSignature, "unknown"),
        (UnregisteredWrapper, "unknown"),
        (BatchOfRows, "batch:kv:plain"),
    ],
)
def test_unknown_family_fails_closed_before_any_cache_changes(bad, signature):
    model = build_model("tiny")
    caches = model.make_cache()
    caches[-1] = bad()
    with pytest.raises(CapabilityError) as info:
        model(prompt_tokens()[None, :8], cache=caches)
    assert f"signature '{signature}' at layer 1" in str(info.value)
    assert info.value.signature == signature and info.value.layer == 1
    assert caches[0].offset == 0 and caches[0].empty()  # layer 0 was not touched


def test_policy_validation():
    with pytest.raises(ValueError, match="bits must be one of 2, 3, 4, 5, 6, 8"):
        CachePolicy(kv_bits=7)
    with pytest.raises(ValueError, match="exclusive"):
        CachePolicy(kv_bits=4, turboquant=(4, 4))
    with pytest.raises(ValueError, match="kbits must be one of 2, 3, 4, 5; received 6"):
        CachePolicy(turboquant=(6, 4))
    with pytest.raises(ValueError, match="keep must be >= 0"):
        CachePolicy(keep=-1)
    with pytest.raises(ValueError, match="kv_bits, family are exclusive"):
        CachePolicy(kv_bits=4, family="kv:mxfp4")
    with pytest.raises(ValueError, match=r"Name the growing family \(kv:quant\)"):
        CachePolicy(family="kv:rotating-quant:4:64")
    with pytest.raises(UnknownSignatureError, match="kv:nope"):
        CachePolicy(family="kv:nope")


def test_any_registered_family_by_its_signature():
    model = build_model("tiny-gemma3")
    caches = model.make_cache(CachePolicy(family="kv:quant:4:32", keep=2))
    assert [signature_string(c) for c in caches] == expected_signatures(
        model, "kv:quant:4:32", "kv:rotating-quant:4:32"
    )
    assert [getattr(c, "keep", None) for c in caches] == [2, 2, None]


def test_a_family_without_a_windowed_counterpart_on_a_sliding_layer(registries_restored):
    register_family(Family("kv:growing-only", "a test family", factory=lambda s, w, k: KVCache()))
    policy = CachePolicy(family="kv:growing-only")
    assert [signature_string(c) for c in build_model("tiny").make_cache(policy)] == ["kv:plain"] * 2
    with pytest.raises(CapabilityError, match="no registered family keeps a window of") as info:
        build_model("tiny-gemma3").make_cache(policy)
    assert info.value.layer == 0 and info.value.family == "kv:growing-only"


def test_group_size_must_divide_head_dim():
    with pytest.raises(CapabilityError, match="does not divide head_dim 64") as info:
        build_model("tiny").make_cache(CachePolicy(kv_bits=4, kv_group_size=128))
    assert info.value.fitting_groups == [32, 64]
    assert "use kv_group_size 32 or 64" in str(info.value)


def test_wrong_number_of_caches():
    model = build_model("tiny")
    with pytest.raises(ValueError, match=r"one cache per layer \(2\); received 1"):
        model(prompt_tokens()[None, :4], cache=model.make_cache()[:1])
