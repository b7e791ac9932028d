"""Tiny mlx-lm models built in-process from small args, with seeded weights.

The parity oracle for our caches and our model: no hub downloads, just
``mlx_lm.models.<arch>.Model(ModelArgs(...))`` with deterministic weights.
:func:`write_model_dir` writes one as an offline mlx-lm model directory that
``mlx_lm.load`` and ``mlx_lm.server`` take: weights, config, a byte-level
tokenizer (every text encodes, every id decodes) and a ChatML chat template.
Needs the ``mlx-lm`` extra (and ``tokenizers`` for the directory).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from kvstore.model.args import named_config

__all__ = [
    "MLX_LM_SHARD_BYTES",
    "TINY_ARGS",
    "build_mlx_lm_model",
    "seed_weights",
    "write_model_dir",
    "SPECIAL_TOKENS",
    "CHAT_TEMPLATE",
]

#: Small args per architecture; head_dim 64 so every affine group (32/64) fits.
TINY_ARGS: dict[str, dict[str, Any]] = {
    "llama": dict(
        model_type="llama",
        hidden_size=128,
        num_hidden_layers=2,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        rms_norm_eps=1e-5,
        vocab_size=256,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    ),
    "qwen2": dict(
        model_type="qwen2",
        hidden_size=128,
        num_hidden_layers=2,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        vocab_size=256,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
    ),
    "qwen3": dict(
        model_type="qwen3",
        hidden_size=128,
        num_hidden_layers=2,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        rms_norm_eps=1e-6,
        vocab_size=256,
        max_position_embeddings=4096,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
    ),
    "phi3": dict(
        model_type="phi3",
        hidden_size=128,
        num_hidden_layers=2,
        intermediate_size=256,
        num_attention_heads=2,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=256,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        original_max_position_embeddings=4096,
    ),
    "gemma3_text": dict(
        model_type="gemma3_text",
        hidden_size=128,
        num_hidden_layers=4,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        rms_norm_eps=1e-6,
        vocab_size=256,
        query_pre_attn_scalar=64,
        sliding_window=16,
        sliding_window_pattern=2,
        max_position_embeddings=4096,
    ),
    # Qwen3.5: 3 Gated-DeltaNet layers, then 1 gated attention layer (Dk = Dv = 64, K = 4):
    # our reference model's own tiny hybrid, so the two are built from one config.
    "qwen3_5": named_config("tiny-qwen3_5"),
    # Qwen3-Next (MoE off): mlx-lm's own hybrid, for stock ArraysCache caches.
    "qwen3_next": dict(
        model_type="qwen3_next",
        hidden_size=128,
        num_hidden_layers=4,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        rms_norm_eps=1e-6,
        vocab_size=256,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        full_attention_interval=4,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        num_experts=0,
        num_experts_per_tok=0,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=0,
        mlp_only_layers=[],
        moe_intermediate_size=0,
        rope_theta=100000.0,
        partial_rotary_factor=0.25,
    ),
}


def seed_weights(model: nn.Module, seed: int, scale: float = 0.08) -> nn.Module:
    """Replace every parameter with seeded normal values (norm weights near 1)."""
    params = []
    flat: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    for i, (name, value) in enumerate(flat):
        sub = mx.random.split(mx.random.key(seed * 1_000_003 + i))[0]
        noise = mx.random.normal(value.shape, dtype=mx.float32, key=sub)
        if "norm" in name:
            value = 1.0 + 0.1 * noise
        else:
            value = scale * noise
        params.append((name, value.astype(mx.float32)))
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())
    return model


def build_mlx_lm_model(
    arch: str, seed: int = 0, *, scale: float = 0.08, **overrides: Any
) -> nn.Module:
    """mlx-lm's own ``arch`` model from :data:`TINY_ARGS` (plus ``overrides``), seeded."""
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    args = module.ModelArgs.from_dict({**TINY_ARGS[arch], **overrides})
    model = module.Model(args)
    return seed_weights(model, seed, scale)


#: The tokenizer's special tokens, after the 256 byte tokens (ids 256, 257, 258).
SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")

#: ChatML, as Qwen models ship it.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _write_tokenizer(path: Path) -> int:
    """A byte-level BPE with no merges: one token per byte, plus :data:`SPECIAL_TOKENS`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 1 << 20,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return len(vocab) + len(SPECIAL_TOKENS)


#: The most bytes ``mlx_lm.utils.save_model`` puts in one weight file (``MAX_FILE_SIZE_GB``).
MLX_LM_SHARD_BYTES = 5 << 30


def _write_shards(root: Path, weights: dict[str, mx.array], shard_bytes: int) -> None:
    """``weights`` in mlx-lm's layout of a sharded model (``mlx_lm.utils.save_model``):
    ``model-0000i-of-0000n.safetensors`` files filled in order up to ``shard_bytes`` each
    (a larger tensor alone; one file is ``model.safetensors``), and
    ``model.safetensors.index.json`` naming each weight's."""
    shards: list[dict[str, mx.array]] = []
    size = 0
    for name, value in weights.items():
        if not shards or size + value.nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += value.nbytes
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = (
            f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            if len(shards) > 1
            else "model.safetensors"
        )
        mx.save_safetensors(str(root / file), shard, metadata={"format": "mlx"})
        weight_map.update(dict.fromkeys(shard, file))
    index = {
        "metadata": {"total_size": sum(v.nbytes for v in weights.values())},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))


def write_model_dir(
    path: str | Path,
    arch: str = "llama",
    seed: int = 0,
    *,
    scale: float = 0.15,
    dtype: str | None = None,
    shard_bytes: int | None = None,
    **overrides: Any,
) -> Path:
    """Write the tiny ``arch`` model as an mlx-lm model directory at ``path``.

    The vocabulary is the tokenizer's (259 ids); ``overrides`` change the model
    args (``num_hidden_layers=4``...). Weights are drawn with standard deviation
    ``scale``: 0.15 makes the tiny llama write varied bytes (0.08 repeats one), so
    a wrong cache shows in the text. ``dtype`` (``"bfloat16"``...): the weights' stored
    type, float32 when not given. ``shard_bytes``: weights in files of at most that many
    bytes and their index, as ``mlx_lm.utils.save_model`` writes a model (5 GiB files),
    rather than one ``model.safetensors``. Returns the directory.
    """
    from mlx.utils import tree_flatten

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    vocab_size = _write_tokenizer(root)
    config = {**TINY_ARGS[arch], "vocab_size": vocab_size, **overrides}
    extra = {"eos_token_id": vocab_size - 2, "pad_token_id": vocab_size - 1}  # im_end, eot
    model = build_mlx_lm_model(arch, seed, scale=scale, **config)
    config.update(extra)
    weights = dict(tree_flatten(model.parameters()))
    if dtype is not None:
        weights = {name: value.astype(getattr(mx, dtype)) for name, value in weights.items()}
    if shard_bytes is None:
        mx.save_safetensors(str(root / "model.safetensors"), weights)  # type: ignore[arg-type]
    else:
        _write_shards(root, weights, shard_bytes)
    (root / "config.json").write_text(json.dumps(config, indent=1))
    del model, weights
    mx.clear_cache()  # a GPU-sized model's buffers back to the device for its servers
    return root
