"""Issue 17, item 3: the decode step specialised to the cache layout.

Its logits equal the generic path's bit for bit over 64 decode steps (growing
buffers crossing a 256-row step, windows wrapping), for every layout below; a
cache with an unknown signature, or one whose signature changed, takes the
generic path.
"""

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from kvstore.caches import (
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    RotatingQuantizedKVCache,
    RotatingTurboQuantKVCache,
    TurboQuantKVCache,
)
from kvstore.errors import CapabilityError
from kvstore.model import CachePolicy, build_model, generate_tokens, load_model
from kvstore.model.args import named_config

from .conftest import prompt_tokens

PREFILL, STEPS = 200, 64  # growing buffers cross 256 rows; 32-token windows wrap
PYCODE = Path("/work/shared/fixtures/pycode-lm")
#: What ``kvstore tune`` chose on pycode-lm at 4.125 bits per value (5-bit keys in layer 1).
TUNED_PYCODE = Path(__file__).parents[2] / "tools/quality/results/tune/layout-4.125.json"


def per_layer(model, make):
    """One cache per layer: ``make(index, window)``."""
    return [make(i, lay["sliding_window"]) for i, lay in enumerate(model.layer_layout())]


def mixed_quant(i, window):
    bits = (4, 8)[i % 2]
    if window is None:
        return QuantizedKVCache(64, bits)
    return RotatingQuantizedKVCache(window, 0, 64, bits)


def mixed_families(i, window):
    """Plain, affine and TurboQuant layers side by side (what ``kvstore tune`` picks)."""
    kind = i % 3
    if window is None:
        return (KVCache(), QuantizedKVCache(64, 4), TurboQuantKVCache(3, 4))[kind]
    return (
        RotatingTurboQuantKVCache(window, kbits=4, vbits=3),
        RotatingQuantizedKVCache(window, 0, 64, 8),
        RotatingKVCache(window),
    )[kind]


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

MODELS = {
    "tiny": lambda: build_model("tiny"),
    "tiny-gemma3": lambda: build_model("tiny-gemma3"),
    "tiny-qwen3-bf16": lambda: build_model("tiny-qwen3", dtype=mx.bfloat16),
    "tiny-llama3-rope-4bit-weights": lambda: quantized(
        build_model(dict(named_config("tiny"), rope_scaling=LLAMA3_ROPE))
    ),
}

#: id -> (model, caches for it)
LAYOUTS = {
    "uniform-plain": ("tiny", lambda m: m.make_cache()),
    "uniform-quant": ("tiny", lambda m: m.make_cache(CachePolicy(kv_bits=4))),
    "mixed-quant-4-8": ("tiny", lambda m: per_layer(m, mixed_quant)),
    "sliding-global-plain": ("tiny-gemma3", lambda m: m.make_cache()),
    "sliding-global-mixed-quant": ("tiny-gemma3", lambda m: per_layer(m, mixed_quant)),
    "turboquant": ("tiny", lambda m: m.make_cache(CachePolicy(turboquant=(3, 3)))),
    "turboquant-sliding": ("tiny-gemma3", lambda m: m.make_cache(CachePolicy(turboquant=(4, 4)))),
    "turboquant-5bit": (
        "tiny",
        lambda m: m.make_cache(CachePolicy(layout="default=kv:turboquant:5:4;1=kv:turboquant:4:5")),
    ),
    "mixed-families": ("tiny-gemma3", lambda m: per_layer(m, mixed_families)),
    "qwen3-bf16-quant": ("tiny-qwen3-bf16", lambda m: m.make_cache(CachePolicy(kv_bits=8))),
    "llama3-rope-quantized-weights": (
        "tiny-llama3-rope-4bit-weights",
        lambda m: per_layer(m, mixed_quant),
    ),
    "tuned": ("tiny-gemma3", lambda m: m.make_cache(tuned_policy(m))),
}


def tuned_policy(model, cached={}):  # noqa: B006 - one sweep per model, shared by both runs
    """The layout ``kvstore tune`` picks for ``model`` at 4 bits per value."""
    from kvstore.model.tune import Budget, tune

    if id(model) not in cached:
        text = np.random.default_rng(0).integers(0, 256, 300).tolist()
        candidates = ["kv:quant:4:64", "kv:quant:8:64", "kv:turboquant:3:3", "kv:turboquant:2:4"]
        result = tune(
            model,
            text,
            Budget(4.0, "bits"),
            candidates=candidates,
            windows=2,
            prefill=48,
            continuation=16,
        )
        assert len(set(result.choice.values())) > 1, result.choice  # a mixed layout
        cached[id(model)] = result.policy
    return cached[id(model)]


def quantized(model):
    nn.quantize(model, group_size=64, bits=4)
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def models():
    return {}


def model_for(models, name):
    if name not in models:
        models[name] = MODELS[name]()
    return models[name]


def decode(model, caches, tokens, enabled, build_after=0):
    """Prefill ``tokens[:PREFILL]``, then STEPS teacher-forced single-token steps:
    ``(logits [STEPS, vocab], the path of each step)``."""
    model.decode_steps.enabled = enabled
    model.decode_steps.build_after = build_after
    model(tokens[None, :PREFILL], cache=caches)
    out, paths = [], []
    for i in range(PREFILL, PREFILL + STEPS):
        step = model.decode_step(caches)
        paths.append(step.path)
        out.append(step(tokens[None, i : i + 1], caches)[0])
        mx.eval(out[-1])
    return mx.concatenate(out, axis=0), paths


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_specialised_step_equals_the_generic_path_bit_for_bit(models, layout):
    name, make = LAYOUTS[layout]
    model = model_for(models, name)
    tokens = prompt_tokens(n=PREFILL + STEPS, vocab=model.args.vocab_size)
    generic, generic_paths = decode(model, make(model), tokens, enabled=False)
    specialised, paths = decode(model, make(model), tokens, enabled=True)
    assert set(generic_paths) == {"generic"}
    assert set(paths) == {"specialised"}
    assert mx.array_equal(specialised, generic).item()


@pytest.mark.skipif(not PYCODE.is_dir(), reason="pycode-lm fixture not present")
def test_the_layout_tune_chose_on_pycode_lm_decodes_bit_for_bit():
    model, _ = load_model(PYCODE)
    policy = CachePolicy.from_file(TUNED_PYCODE)
    caches = model.make_cache(policy)
    assert [c.signature() for c in caches] == [
        "kv:turboquant:4:4",
        "kv:turboquant:5:4",
        "kv:turboquant:4:4",
        "kv:turboquant:4:3",
    ]
    tokens = prompt_tokens(n=PREFILL + STEPS, vocab=model.args.vocab_size)
    generic, generic_paths = decode(model, caches, tokens, enabled=False)
    specialised, paths = decode(model, model.make_cache(policy), tokens, enabled=True)
    assert set(generic_paths) == {"generic"} and set(paths) == {"specialised"}
    assert mx.array_equal(specialised, generic).item()


def test_built_once_per_layout_and_picked_by_signatures(models):
    model = model_for(models, "tiny")
    model.decode_steps.enabled, model.decode_steps.build_after = True, 0
    quant = model.make_cache(CachePolicy(kv_bits=4))
    first = model.decode_step(quant)
    assert first.path == "specialised"
    assert first.signatures == ("kv:quant:4:64", "kv:quant:4:64")
    assert model.decode_step(model.make_cache(CachePolicy(kv_bits=4))) is first
    assert model.decode_step(model.make_cache()) is not first


class UnknownCache(KVCache):
    def signature(self):
        return "kv:made-up"


def test_unknown_signature_in_one_layer_takes_the_generic_path(models):
    model = model_for(models, "tiny")
    model.decode_steps.enabled, model.decode_steps.build_after = True, 0
    caches = [KVCache(), UnknownCache()]
    step = model.decode_step(caches)
    assert step.path == "generic"
    assert "layer 1" in step.reason
    with pytest.raises(CapabilityError, match="kv:made-up|unknown"):  # and it fails closed
        step(mx.array([[1]]), caches)


def test_a_layer_whose_signature_changed_takes_the_generic_path():
    model = build_model("tiny")  # no step built for any other layout yet
    model.decode_steps.enabled, model.decode_steps.build_after = True, 0
    tokens = prompt_tokens(n=PREFILL + 2, vocab=model.args.vocab_size)
    caches = model.make_cache(CachePolicy(kv_bits=4))
    reference = model.make_cache(CachePolicy(kv_bits=4))
    for c in (caches, reference):
        model(tokens[None, :PREFILL], cache=c)
    built = model.decode_step(caches)
    assert built.path == "specialised"
    # Layer 1 is transcoded to 8 bits in both runs; the 4-bit step must not serve it.
    for c in (caches, reference):
        k, v = c[1].state[:2]
        keys = mx.dequantize(*k, group_size=64, bits=4)[..., : c[1].offset, :]
        values = mx.dequantize(*v, group_size=64, bits=4)[..., : c[1].offset, :]
        c[1] = QuantizedKVCache(64, 8)
        c[1].update_and_fetch(keys, values)
    model.decode_steps.build_after = 1  # the new layout is not built on sight
    step = model.decode_step(caches)
    assert step is not built and step.path == "generic"
    got = step(tokens[None, PREFILL : PREFILL + 1], caches)
    expected = model(tokens[None, PREFILL : PREFILL + 1], cache=reference)
    assert mx.array_equal(got, expected).item()


def test_caches_that_disagree_on_their_offset_take_the_generic_path(models):
    model = model_for(models, "tiny")
    model.decode_steps.enabled, model.decode_steps.build_after = True, 0
    caches = model.make_cache()
    caches[0].update_and_fetch(mx.zeros((1, 2, 3, 64)), mx.zeros((1, 2, 3, 64)))
    assert model.decode_step(caches).path == "generic"


def test_generate_decodes_with_the_specialised_step(models):
    model = model_for(models, "tiny-gemma3")
    prompt = prompt_tokens(n=40, vocab=model.args.vocab_size)
    model.decode_steps.enabled = False
    expected, _ = generate_tokens(model, prompt, max_tokens=24, policy=CachePolicy(kv_bits=8))
    model.decode_steps.enabled, model.decode_steps.build_after = True, 4
    got, _ = generate_tokens(model, prompt, max_tokens=24, policy=CachePolicy(kv_bits=8))
    assert got == expected
    q8 = ("kv:rotating-quant:8:64", "kv:rotating-quant:8:64", "kv:quant:8:64")
    assert model.decode_steps.built()[q8].path == "specialised"


def test_a_kernel_mlx_cannot_compile_shapeless_runs_as_it_is():
    from kvstore.model.attention import dense_attention
    from kvstore.model.decode_step import _Shapeless

    def sliced(queries, keys, values, scale, mask):  # a Slice infers no shapes
        return dense_attention(queries, keys[..., :-1, :], values[..., :-1, :], scale, mask)

    kernel = _Shapeless(sliced)
    q, k = mx.ones((1, 2, 1, 8)), mx.arange(2 * 5 * 8, dtype=mx.float32).reshape(1, 2, 5, 8)
    assert mx.array_equal(kernel(q, k, k, 0.5, None), sliced(q, k, k, 0.5, None)).item()
    assert kernel._compiled is None


def test_a_step_mlx_cannot_compile_is_never_used(monkeypatch):
    from kvstore.model.decode_step import DecodeStep

    def fails(self):
        raise RuntimeError("no kernel for this")

    monkeypatch.setattr(DecodeStep, "warm_up", fails)
    model = build_model("tiny")
    model.decode_steps.build_after = 0
    step = model.decode_step(model.make_cache())
    assert step.path == "generic" and "failed to compile: no kernel" in step.reason
    assert model.decode_step(model.make_cache()) is step  # decided once per layout


@pytest.mark.parametrize(
    "interval, reason",
    [(4, "layer 0 is a gated-delta layer"), (1, "layer 0's attention gates its output")],
)
def test_hybrid_and_gated_attention_models_keep_the_generic_path(interval, reason):
    """A Qwen3.5 model: its Gated-DeltaNet layers have no attention to cut at, and its
    attention's output gate would be lost between two segments (issue 16)."""
    model = build_model(dict(named_config("tiny-qwen3_5"), full_attention_interval=interval))
    prompt = prompt_tokens(n=40, vocab=model.args.vocab_size)
    model.decode_steps.enabled = False
    expected, _ = generate_tokens(model, prompt, max_tokens=12)
    model.decode_steps.enabled, model.decode_steps.build_after = True, 2
    got, _ = generate_tokens(model, prompt, max_tokens=12)
    assert got == expected
    (step,) = model.decode_steps.built().values()
    assert step.path == "generic" and reason in step.reason
