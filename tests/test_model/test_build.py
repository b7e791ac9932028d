"""Building models: named configs, seeded weights, args normalisation, layer layout."""

import json

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from kvstore.errors import CapabilityError
from kvstore.model import NAMED_CONFIGS, ModelArgs, build_model


def weights(model):
    return dict(tree_flatten(model.parameters()))


def same_weights(a, b):
    wa, wb = weights(a), weights(b)
    return wa.keys() == wb.keys() and all(mx.array_equal(wa[k], wb[k]).item() for k in wa)


@pytest.mark.parametrize("name", [n for n in NAMED_CONFIGS if n.startswith("tiny")])
def test_named_tiny_configs_build_and_run(name):
    model = build_model(name)
    assert model.config == NAMED_CONFIGS[name] and model.source_path is None
    logits = model(mx.array([[1, 2, 3]]), cache=model.make_cache())
    assert logits.shape == (1, 3, NAMED_CONFIGS[name]["vocab_size"])
    assert mx.isfinite(logits).all().item()


def test_same_seed_same_weights_independent_of_global_random_state():
    a = build_model("tiny", seed=3)
    mx.random.seed(999)
    assert same_weights(a, build_model("tiny", seed=3))
    assert not same_weights(a, build_model("tiny", seed=4))


def test_config_dict_and_model_args_inputs():
    config = dict(NAMED_CONFIGS["tiny"], num_hidden_layers=3)
    from_dict = build_model(config)
    assert len(from_dict.layers) == 3 and from_dict.config == config
    args = ModelArgs.from_config(config)
    from_args = build_model(args)
    assert same_weights(from_dict, from_args)
    assert json.loads(json.dumps(from_args.config)) == args.to_dict()


def test_dtype():
    model = build_model("tiny", dtype=mx.bfloat16)
    assert {v.dtype for v in weights(model).values()} == {mx.bfloat16}


def test_unknown_named_config():
    with pytest.raises(ValueError, match="Unknown named config 'huge'; known: tiny"):
        build_model("huge")


def test_unsupported_model_type():
    with pytest.raises(CapabilityError, match="model_type 'gpt2' is not supported"):
        build_model(dict(NAMED_CONFIGS["tiny"], model_type="gpt2"))


def test_heads_must_group():
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        build_model(dict(NAMED_CONFIGS["tiny"], num_key_value_heads=3))


def test_layer_layout_of_gemma3_interleaves_windows():
    model = build_model("tiny-gemma3")
    assert model.layer_layout() == [
        {"n_kv_heads": 2, "head_dim": 64, "sliding_window": 32},
        {"n_kv_heads": 2, "head_dim": 64, "sliding_window": 32},
        {"n_kv_heads": 2, "head_dim": 64, "sliding_window": None},
    ]
    windows = [layer["sliding_window"] for layer in model.layer_layout()]
    assert [getattr(c, "max_size", None) for c in model.make_cache()] == windows


def test_small_configs_have_the_documented_shape():
    small = ModelArgs.from_config(NAMED_CONFIGS["small"])
    assert (small.num_hidden_layers, small.head_dim, small.num_key_value_heads) == (6, 128, 2)
    gemma = ModelArgs.from_config(NAMED_CONFIGS["small-gemma3"])
    assert gemma.layer_windows == ((1024,) * 5 + (None,)) * 2


@pytest.mark.parametrize(
    "config, expected",
    [
        # Qwen2 ignores a head_dim key: it is always hidden / heads.
        (dict(NAMED_CONFIGS["tiny"], model_type="qwen2", head_dim=32), {"head_dim": 32}),
        # Llama without num_key_value_heads: multi-head attention.
        (
            {k: v for k, v in NAMED_CONFIGS["tiny"].items() if k != "num_key_value_heads"},
            {"num_key_value_heads": 4},
        ),
        # transformers >= 5 nests the rope base under rope_parameters.
        (
            {
                **{k: v for k, v in NAMED_CONFIGS["tiny-qwen3"].items() if k != "rope_theta"},
                "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
            },
            {"rope_theta": 5e5},
        ),
        # Llama sliding layers come from layer_types.
        (
            dict(
                NAMED_CONFIGS["tiny"],
                layer_types=["sliding_attention", "full_attention"],
                sliding_window=24,
            ),
            {"layer_windows": (24, None)},
        ),
    ],
)
def test_config_normalisation(config, expected):
    args = ModelArgs.from_config(config)
    assert {k: getattr(args, k) for k in expected} == expected


def test_qwen3_without_rope_theta():
    config = {k: v for k, v in NAMED_CONFIGS["tiny-qwen3"].items() if k != "rope_theta"}
    with pytest.raises(CapabilityError, match="qwen3 config has no rope_theta"):
        ModelArgs.from_config(config)
