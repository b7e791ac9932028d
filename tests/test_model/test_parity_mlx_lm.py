"""Acceptance 1: our model's logits equal mlx-lm's for every supported architecture.

mlx-lm builds each model from the same tiny args with seeded weights and
writes an mlx-lm model directory; mlx-lm's loader and ours both load it, and
the logits over a 128-token prompt and 16 decode steps (float32) must agree
within 1e-5 relative, with each side's own ``make_cache()``.
"""

import pytest

pytest.importorskip("mlx_lm")

from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from mlx_lm.utils import load_model as mlx_lm_load_model  # noqa: E402
from mlx_lm.utils import quantize_model  # noqa: E402

from kvstore.model import build_model, load_model  # noqa: E402
from kvstore.testing.mlx_lm_models import TINY_ARGS, build_mlx_lm_model  # noqa: E402

from .conftest import prompt_tokens, rel_err, save_mlx_lm_dir, teacher_forced  # noqa: E402

TOL = 1e-5

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # A short original context so most frequencies of head_dim 64 are rescaled.
    "original_max_position_embeddings": 64,
}
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}

#: id -> (mlx-lm module, config overrides, quantize as (group, bits) or None, drop lm_head)
CASES = {
    "llama": ("llama", {}, None, False),
    "mistral": ("llama", {"model_type": "mistral"}, None, False),
    "llama-llama3-rope": (
        "llama",
        {"rope_scaling": LLAMA3_ROPE, "max_position_embeddings": 1024},
        None,
        False,
    ),
    "llama-bias-untied-traditional": (
        "llama",
        {
            "attention_bias": True,
            "mlp_bias": True,
            "tie_word_embeddings": False,
            "rope_traditional": True,
        },
        None,
        False,
    ),
    "llama-sliding-layers": (
        "llama",
        {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 24},
        None,
        False,
    ),
    "qwen2": ("qwen2", {}, None, False),
    "qwen3": ("qwen3", {}, None, False),
    "qwen3-yarn-rope": ("qwen3", {"rope_scaling": YARN_ROPE}, None, False),
    "gemma3_text": ("gemma3_text", {}, None, False),
    "gemma3_text-tied-linear-rope": (
        "gemma3_text",
        {"rope_scaling": {"rope_type": "linear", "factor": 8.0}},
        None,
        True,
    ),
    "llama-4bit": ("llama", {}, (64, 4), False),
    "qwen2-4bit": ("qwen2", {}, (32, 4), False),
    "gemma3_text-4bit-tied": ("gemma3_text", {}, (64, 4), True),
    "qwen3-8bit": ("qwen3", {}, (64, 8), False),
}


def write_case(tmp_path, case):
    arch, overrides, quant, drop_head = CASES[case]
    model = build_mlx_lm_model(arch, **overrides)
    config = {**TINY_ARGS[arch], **overrides}
    if drop_head:
        model.pop("lm_head")  # a tied checkpoint has no lm_head.weight
    if quant is not None:
        model, config = quantize_model(model, config, group_size=quant[0], bits=quant[1])
    return save_mlx_lm_dir(tmp_path / case, model, config)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_mlx_lm(tmp_path, case):
    path = write_case(tmp_path, case)
    theirs, _ = mlx_lm_load_model(path)
    ours, tokenizer = load_model(path)
    assert tokenizer is None
    if CASES[case][2] is not None:  # quantized weights stay quantized
        kinds = {type(m).__name__ for _, m in ours.named_modules()}
        assert {"QuantizedLinear", "QuantizedEmbedding"} <= kinds and "Linear" not in kinds
    tokens = prompt_tokens()
    expected = teacher_forced(theirs, make_prompt_cache(theirs), tokens)
    got = teacher_forced(ours, ours.make_cache(), tokens)
    assert rel_err(got, expected) <= TOL


def test_same_cache_families_as_mlx_lm(tmp_path):
    path = write_case(tmp_path, "gemma3_text")
    theirs, _ = mlx_lm_load_model(path)
    ours, _ = load_model(path)
    kinds = [type(c).__name__ for c in ours.make_cache()]
    assert kinds == [type(c).__name__ for c in make_prompt_cache(theirs)]
    assert kinds == ["RotatingKVCache", "KVCache"] * 2
    windows = [lay["sliding_window"] for lay in ours.layer_layout()]
    assert windows == [getattr(c, "max_size", None) for c in make_prompt_cache(theirs)]
    assert windows == [getattr(c, "max_size", None) for c in ours.make_cache()]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3_text"])
def test_weights_copied_into_a_built_model(arch):
    """The other route: build ours from the same config dict and copy the weights in."""
    theirs = build_mlx_lm_model(arch)
    config = {**TINY_ARGS[arch]}
    if arch == "gemma3_text":
        config["tie_word_embeddings"] = False  # mlx-lm's built Gemma keeps its lm_head
    ours = build_model(config)
    ours.load_weights(tree_flatten(theirs.parameters()), strict=True)
    tokens = prompt_tokens(seed=3)
    expected = teacher_forced(theirs, make_prompt_cache(theirs), tokens)
    assert rel_err(teacher_forced(ours, ours.make_cache(), tokens), expected) <= TOL
