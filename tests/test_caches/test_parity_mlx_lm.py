"""Acceptance 1: logits identical to mlx-lm's own caches on tiny mlx-lm models."""

import mlx.core as mx
import pytest

pytest.importorskip("mlx_lm")
from mlx_lm.models import cache as lm_cache  # noqa: E402

from kvstore.caches import (  # noqa: E402
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    RotatingQuantizedKVCache,
)
from kvstore.testing.mlx_lm_models import build_mlx_lm_model  # noqa: E402

PREFILL, DECODE = 64, 16


def run(model, caches, prompt):
    """Prefill the first PREFILL tokens of `prompt`, then feed the other DECODE
    one at a time (teacher-forced, so runs stay comparable); all logits."""
    out = [model(prompt[None, :PREFILL], cache=caches)[0]]
    for i in range(PREFILL, PREFILL + DECODE):
        out.append(model(prompt[None, i : i + 1], cache=caches)[0])
    result = mx.concatenate(out, axis=0)
    mx.eval(result)
    return result


def prompt(seed=1):
    return mx.random.randint(0, 256, (PREFILL + DECODE,), key=mx.random.key(seed))


def assert_identical(a, b):
    assert a.shape == b.shape
    assert mx.array_equal(a, b).item(), f"max |diff| = {mx.abs(a - b).max().item()}"


FAMILIES = {
    "plain": (lambda: KVCache(), lambda: lm_cache.KVCache()),
    "quant-4-64": (lambda: QuantizedKVCache(64, 4), lambda: lm_cache.QuantizedKVCache(64, 4)),
    "quant-8-64": (lambda: QuantizedKVCache(64, 8), lambda: lm_cache.QuantizedKVCache(64, 8)),
    # keep 4, window 24: the 64-token prefill overflows it and decode wraps it.
    "rotating": (lambda: RotatingKVCache(24, keep=4), lambda: lm_cache.RotatingKVCache(24, keep=4)),
}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_identical_to_mlx_lm(arch, family):
    ours, theirs = FAMILIES[family]
    model = build_mlx_lm_model(arch)
    n = len(model.layers)
    p = prompt()
    assert_identical(
        run(model, [ours() for _ in range(n)], p), run(model, [theirs() for _ in range(n)], p)
    )


def test_gemma3_sliding_window_layers_identical_to_mlx_lm():
    model = build_mlx_lm_model("gemma3_text")
    theirs = model.make_cache()
    ours = [
        RotatingKVCache(c.max_size, keep=c.keep)
        if type(c) is lm_cache.RotatingKVCache
        else KVCache()
        for c in theirs
    ]
    assert [type(c).__name__ for c in ours] == ["RotatingKVCache", "KVCache"] * 2
    p = prompt(2)
    assert_identical(run(model, ours, p), run(model, theirs, p))


def rotating_quant_error_vs_tolerance(model, window_of, bits, p):
    """(error of rotating-quant vs rotating-plain, error of quant vs plain).

    ``window_of(i)`` is layer i's window or None for a full-attention layer.
    Without a ring, the model's window mask alone gives the windowed semantics,
    so quant-vs-plain without rings is the tolerance for the same bits.
    """
    n = len(model.layers)

    def layout(ring, full):
        return [full() if window_of(i) is None else ring(window_of(i)) for i in range(n)]

    plain = run(model, [KVCache() for _ in range(n)], p)
    quant = run(model, [QuantizedKVCache(64, bits) for _ in range(n)], p)
    rot_plain = run(model, layout(lambda w: RotatingKVCache(w, keep=4), KVCache), p)
    rot_quant = run(
        model,
        layout(
            lambda w: RotatingQuantizedKVCache(w, keep=4, bits=bits),
            lambda: QuantizedKVCache(64, bits),
        ),
        p,
    )
    return mx.abs(rot_quant - rot_plain).max().item(), mx.abs(quant - plain).max().item()


@pytest.mark.parametrize("bits", [4, 8])
def test_rotating_quant_within_quant_vs_plain_tolerance(bits):
    err, tolerance = rotating_quant_error_vs_tolerance(
        build_mlx_lm_model("llama"), lambda i: 24, bits, prompt(3)
    )
    assert tolerance > 0  # the quantized run really is quantized
    assert err <= 2 * tolerance, (err, tolerance)


@pytest.mark.parametrize("bits", [4, 8])
def test_gemma3_rotating_quant_within_quant_vs_plain_tolerance(bits):
    model = build_mlx_lm_model("gemma3_text")
    windows = [
        c.max_size if type(c) is lm_cache.RotatingKVCache else None for c in model.make_cache()
    ]
    err, tolerance = rotating_quant_error_vs_tolerance(model, windows.__getitem__, bits, prompt(4))
    assert tolerance > 0
    assert err <= 2 * tolerance, (err, tolerance)
