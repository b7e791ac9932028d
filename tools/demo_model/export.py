"""Write the trained model as an mlx-lm model directory, quantized to 4 bits.

mlx-lm's conventions throughout: parameters cast to bfloat16, then
``nn.quantize`` with affine group-64 4-bit on every layer that has
``to_quantized`` and an input dimension divisible by the group (mlx-lm's
``quantize_model`` predicate; the tied embedding included, so the output head
is a quantized matmul too), weights in one ``model.safetensors`` with
``{"format": "mlx"}`` metadata, ``quantization`` (and its Hugging Face twin
``quantization_config``) in ``config.json``.

The directory:

* ``config.json``, ``model.safetensors``;
* ``tokenizer.json``, ``tokenizer_config.json`` (:mod:`.bpe`);
* ``README.md`` (what it is, how it was trained, how to retrain) and ``train_log.txt``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from .bpe import write_tokenizer_files
from .model import BITS, GROUP_SIZE, Llama, ModelShape

__all__ = ["FILES", "export", "quantize"]

#: Every file of an export (the names kvstore ships under kvstore/demo/model/).
FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "README.md",
    "train_log.txt",
)


def quantize(shape: ModelShape, params: dict[str, mx.array]) -> Llama:
    """A fresh model holding ``params``, cast to bfloat16 and 4-bit quantized as mlx-lm does."""
    model = Llama(shape)
    model.update(tree_unflatten(list(params.items())))
    model.set_dtype(mx.bfloat16)
    nn.quantize(
        model,
        group_size=GROUP_SIZE,
        bits=BITS,
        mode="affine",
        class_predicate=lambda _, m: (
            hasattr(m, "to_quantized") and m.weight.shape[-1] % GROUP_SIZE == 0
        ),
    )
    mx.eval(model.parameters())
    return model


def export(
    shape: ModelShape,
    params: dict[str, mx.array],
    tokenizer: Any,
    out: Path,
    *,
    training: dict[str, Any],
    readme: str,
    log_lines: list[str],
) -> Path:
    """Write the model directory ``out`` (see the module docstring); returns ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    model = quantize(shape, params)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    quantization = {"group_size": GROUP_SIZE, "bits": BITS, "mode": "affine"}
    eot = tokenizer.token_to_id("<|endoftext|>")
    config = {
        **shape.config(),
        "bos_token_id": eot,
        "eos_token_id": eot,
        "torch_dtype": "bfloat16",
        "quantization": quantization,
        "quantization_config": quantization,
        "training": training,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_tokenizer_files(tokenizer, out, shape.max_position_embeddings)
    (out / "README.md").write_text(readme)
    (out / "train_log.txt").write_text("\n".join(log_lines) + "\n")
    return out
