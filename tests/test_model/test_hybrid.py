"""Issue 16, the model: a Qwen3.5-shaped hybrid (Gated-DeltaNet + attention layers).

Parity: mlx-lm builds its tiny ``qwen3_5`` model in process and writes an mlx-lm
model directory; our loader and mlx-lm's read it, and the logits over 128
prompt tokens and 16 decode steps are *equal* (bit for bit, float32, CPU).
The recurrent state after 256 tokens does not depend on how prefill was
chunked. The layers are routed through predicates: a KV cache on a recurrent
layer, or a recurrent cache on an attention layer, fails closed.
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from kvstore.abc import cache as preds
from kvstore.caches import KVCache
from kvstore.caches.recurrent import GatedDeltaCache
from kvstore.errors import CapabilityError
from kvstore.model import build_model, load_model
from kvstore.model.generate import prefill

from .conftest import prompt_tokens, save_mlx_lm_dir, teacher_forced

pytest.importorskip("mlx_lm")

from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from mlx_lm.utils import load_model as mlx_lm_load_model  # noqa: E402

from kvstore.testing.mlx_lm_models import TINY_ARGS, build_mlx_lm_model  # noqa: E402
from tests.markers import needs_tested_mlx_lm


@pytest.fixture(scope="module")
def qwen3_5_dir(tmp_path_factory):
    model = build_mlx_lm_model("qwen3_5", seed=2)
    return save_mlx_lm_dir(tmp_path_factory.mktemp("qwen3_5"), model, TINY_ARGS["qwen3_5"])


@needs_tested_mlx_lm
def test_logits_equal_mlx_lm_bit_for_bit(qwen3_5_dir):
    theirs, _ = mlx_lm_load_model(qwen3_5_dir)
    ours, _ = load_model(qwen3_5_dir)
    assert ours.args.layer_kinds == ("gated-delta",) * 3 + ("attention",)
    tokens = prompt_tokens()
    expected = teacher_forced(theirs, make_prompt_cache(theirs), tokens)
    got = teacher_forced(ours, ours.make_cache(), tokens)
    assert mx.array_equal(got, expected).item()


def _hugging_face_layout(path, out):
    """The same checkpoint as Hugging Face writes it: names under
    ``model.language_model.``, conv1d weights ``[C, 1, K]``, norm offsets, a
    nested ``text_config``."""
    import json

    weights = mx.load(str(path / "model.safetensors"))
    norms = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight")
    hf = {}
    for key, value in weights.items():
        key = key.replace("language_model.model.", "model.language_model.")
        key = key.replace("language_model.lm_head", "lm_head")
        if "conv1d.weight" in key:
            value = value.moveaxis(1, 2)
        if key.endswith(norms) or key.endswith((".q_norm.weight", ".k_norm.weight")):
            value = value - 1.0
        hf[key] = value
    hf["mtp.layers.0.fc.weight"] = mx.zeros((2, 2))  # dropped, as mlx-lm drops it
    out.mkdir()
    mx.save_safetensors(str(out / "model.safetensors"), hf)
    config = json.loads((path / "config.json").read_text())
    (out / "config.json").write_text(
        json.dumps({"model_type": "qwen3_5", "text_config": {**config, "model_type": "x"}})
    )
    return out


def test_hugging_face_checkpoint_loads_to_the_same_model(qwen3_5_dir, tmp_path):
    ours, _ = load_model(qwen3_5_dir)
    hf, _ = load_model(_hugging_face_layout(qwen3_5_dir, tmp_path / "hf"))
    a, b = dict(tree_flatten(ours.parameters())), dict(tree_flatten(hf.parameters()))
    assert a.keys() == b.keys()
    for name in a:
        assert mx.allclose(a[name], b[name], atol=1e-6).item(), name


def _chunks(sizes):
    out, pos = [], 0
    for s in sizes:
        out.append((pos, pos + s))
        pos += s
    return out


def test_state_after_256_tokens_does_not_depend_on_chunking():
    model = build_model("tiny-qwen3_5", seed=3)
    tokens = mx.random.randint(0, 256, (256,), key=mx.random.key(1))
    runs = {}
    for sizes in ([256], [128, 128], [100, 100, 56], [1] * 256):
        caches = model.make_cache()
        logits = prefill(model, tokens, caches, _chunks(sizes))
        runs[len(sizes)] = (caches, logits)
    ref_caches, ref_logits = runs[1]
    for n, (caches, logits) in runs.items():
        assert [c.offset for c in caches] == [256] * 4
        for ref, got in zip(ref_caches[:3], caches[:3]):
            assert mx.array_equal(ref[0], got[0]).item(), n  # conv window
            assert mx.array_equal(ref[1], got[1]).item(), n  # state
            assert got[1].dtype == mx.float32
        assert mx.array_equal(ref_caches[3].keys[..., :256, :], caches[3].keys[..., :256, :])
        assert mx.array_equal(ref_logits, logits).item(), n


def test_float32_state_in_a_bfloat16_model():
    model = build_model("tiny-qwen3_5", dtype=mx.bfloat16)
    caches = model.make_cache()
    model(mx.array([[1, 2, 3]]), cache=caches)
    assert caches[0][1].dtype == mx.float32 and caches[0][0].dtype == mx.bfloat16


def test_recurrent_cache_predicates_fail_closed_for_kv():
    cache = GatedDeltaCache()
    assert preds.is_recurrent_cache(cache) and preds.is_gated_delta_cache(cache)
    kv_predicates = [
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
    assert [p.__name__ for p in kv_predicates if p(cache)] == []
    assert not preds.is_recurrent_cache(KVCache())
    assert cache.bytes_per_token() == 0 and cache.bytes_per_checkpoint() == 0
    model = build_model("tiny-qwen3_5")
    caches = model.make_cache()
    model(mx.array([[5, 6]]), cache=caches)
    conv, state = caches[0].state
    assert caches[0].bytes_per_checkpoint() == conv.nbytes + state.nbytes > 0
    assert caches[0].bytes_per_token() == 0


def test_layers_and_caches_routed_by_predicates():
    model = build_model("tiny-qwen3_5")
    caches = model.make_cache()
    swapped = [KVCache(), *caches[1:3], GatedDeltaCache()]
    with pytest.raises(CapabilityError, match="layer 0"):
        model(mx.array([[1]]), cache=swapped)
    with pytest.raises(CapabilityError, match="rec:gated-delta' at layer 3"):
        model(mx.array([[1]]), cache=[*caches[:3], GatedDeltaCache()])
    assert all(c.offset == 0 for c in caches)  # nothing was updated before the check


@needs_tested_mlx_lm
def test_mlx_lm_layers_run_on_our_cache(qwen3_5_dir):
    """The cache speaks mlx-lm's ArraysCache protocol: mlx-lm's model runs on it."""
    theirs, _ = mlx_lm_load_model(qwen3_5_dir)
    ours, _ = load_model(qwen3_5_dir)
    tokens = prompt_tokens()[None, :40]
    expected = theirs(tokens, cache=make_prompt_cache(theirs))
    caches = ours.make_cache()
    got = theirs(tokens, cache=caches)
    assert mx.array_equal(got, expected).item()
    assert caches[0].offset == 40
    assert np.array_equal(
        np.asarray(ours(tokens[:, :1], cache=ours.make_cache())[0, 0]), np.asarray(expected[0, 0])
    )
