"""Load mlx-lm model directories: ``config.json`` + ``model*.safetensors``.

Sharded or single-file weights, affine-quantized weights (``quantization`` in
``config.json``, per-layer overrides included, quantized as mlx-lm does with
``nn.quantize`` and a class predicate), and an optional tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from kvstore.errors import CapabilityError, ModelLoadError
from kvstore.model.args import ModelArgs
from kvstore.model.tokenizer import Tokenizer, load_tokenizer
from kvstore.model.transformer import Model

__all__ = ["load_model", "read_config", "read_weights"]


def read_config(path: Path) -> dict[str, Any]:
    """The ``config.json`` of model directory ``path``.

    Raises:
        ModelLoadError: ``path`` is not a directory, or has no readable config.json.
    """
    file = path / "config.json"
    if not path.is_dir() or not file.is_file():
        what = "does not exist" if not path.exists() else "has no config.json"
        raise ModelLoadError(
            f"[load_model] A model directory holds config.json and model*.safetensors; "
            f"'{path}' {what}. Pass an mlx-lm model directory (e.g. from mlx_lm.convert).",
            path=path,
        )
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"[load_model] config.json in '{path}' is not readable JSON ({exc}).", path=path
        ) from exc
    if type(config) is not dict:
        raise ModelLoadError(
            f"[load_model] config.json in '{path}' must hold a JSON object; "
            f"received {type(config).__name__}.",
            path=path,
        )
    return config


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise ModelLoadError(
                f"[load_model] model.safetensors.index.json in '{path}' names shards that "
                f"are missing: {', '.join(missing)}. Copy the whole model directory.",
                path=path,
                missing=missing,
            )
        return [path / n for n in names]
    files = sorted(path.glob("model*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"[load_model] No model*.safetensors in '{path}'; an mlx-lm model directory "
            f"holds its weights there.",
            path=path,
        )
    return files


def read_weights(path: Path) -> dict[str, mx.array]:
    """Every tensor of the directory's ``model*.safetensors`` (all shards), lazily loaded."""
    weights: dict[str, mx.array] = {}
    for file in _weight_files(path):
        weights.update(mx.load(str(file)))  # type: ignore[arg-type]
    return weights


_QWEN3_5_NORMS = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)


def _sanitize_qwen3_5(weights: dict[str, mx.array]) -> None:
    """mlx-lm's ``qwen3_5`` sanitize, onto our names: the text model's tensors under
    ``model.``/``lm_head`` (mlx-lm keeps them under ``language_model.``, Hugging Face
    under ``model.language_model.``), vision and multi-token-prediction tensors
    dropped; a Hugging Face checkpoint's conv1d weights moved to MLX's layout and
    its norm offsets turned into scales."""
    renamed: dict[str, mx.array] = {}
    for key, value in weights.items():
        if key.startswith(("vision_tower", "model.visual")) or "mtp." in key:
            continue
        if key.startswith("model.language_model."):
            key = "model." + key[len("model.language_model.") :]
        elif key.startswith("language_model."):
            key = key[len("language_model.") :]
        renamed[key] = value
    unsanitized = any("conv1d.weight" in k and v.shape[-1] != 1 for k, v in renamed.items())
    for key, value in renamed.items():
        if "conv1d.weight" in key and value.shape[-1] != 1:
            renamed[key] = value.moveaxis(2, 1)
        if unsanitized and value.ndim == 1 and key.endswith(_QWEN3_5_NORMS):
            renamed[key] = value + 1.0
    weights.clear()
    weights.update(renamed)


def _sanitize(args: ModelArgs, weights: dict[str, mx.array]) -> ModelArgs:
    """Drop tensors mlx-lm drops, and settle tied embeddings (Gemma: from the weights)."""
    for name in [n for n in weights if "rotary_emb.inv_freq" in n]:
        del weights[name]
    if args.model_type == "qwen3_5":
        _sanitize_qwen3_5(weights)
    if args.model_type == "gemma3_text":
        return dataclasses.replace(args, tie_word_embeddings="lm_head.weight" not in weights)
    if args.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    return args


def _affine(params: dict[str, Any], where: str) -> dict[str, Any]:
    mode = params.get("mode", "affine")
    if mode != "affine":
        raise CapabilityError(
            f"[load_model] Weight quantization mode {mode!r} ({where}) is not supported; "
            f"kvstore.model reads affine-quantized weights. Load this model with mlx-lm.",
            found=mode,
            supported=["affine"],
        )
    return {"group_size": params["group_size"], "bits": params["bits"], "mode": "affine"}


def _quantize(model: Model, quantization: dict[str, Any], weights: dict[str, mx.array]) -> None:
    """Turn the layers the checkpoint stores quantized into quantized layers (as mlx-lm)."""
    defaults = _affine(quantization, "config.json 'quantization'")

    def predicate(path: str, module: nn.Module) -> bool | dict[str, Any]:
        if path in quantization:  # a per-layer override: False or a params dict
            override = quantization[path]
            return _affine(override, path) if type(override) is dict else bool(override)
        if f"{path}.scales" not in weights:
            return False
        # Infer bits and group from the stored shapes: the default can be wrong for a path.
        scales = weights[f"{path}.scales"]
        in_dims = module.weight.shape[-1]
        if scales.dtype == mx.uint8:
            _affine({"mode": "microscaled (uint8 scales)"}, path)
        return {
            "group_size": in_dims // scales.shape[-1],
            "bits": weights[f"{path}.weight"].shape[-1] * 32 // in_dims,
            "mode": "affine",
        }

    nn.quantize(
        model,
        group_size=defaults["group_size"],
        bits=defaults["bits"],
        mode="affine",
        class_predicate=predicate,
    )


def load_model(
    path: str | Path, *, lazy: bool = False, dtype: mx.Dtype | None = None
) -> tuple[Model, Tokenizer | None]:
    """Load an mlx-lm model directory.

    Args:
        path: directory with ``config.json`` and ``model*.safetensors``.
        lazy: leave the weights unevaluated (loaded on first use).
        dtype: cast floating-point parameters (e.g. ``mx.float32``); stored dtype by default.

    Returns:
        ``(model, tokenizer)``; ``tokenizer`` is ``None`` unless the directory
        has tokenizer files and ``tokenizers``/``transformers`` is installed.

    Raises:
        ModelLoadError: missing or unreadable config/weights, or weights that
            do not fit the architecture.
        CapabilityError: unsupported ``model_type``, rope type or quantization mode.
    """
    path = Path(path).expanduser()
    config = read_config(path)
    args = ModelArgs.from_config(config)
    weights = read_weights(path)
    args = _sanitize(args, weights)
    model = Model(args, config=config, source_path=path.resolve())

    quantization = config.get("quantization")
    legacy = config.get("quantization_config")
    if quantization is None and legacy and "quant_method" in legacy:
        raise CapabilityError(
            f"[load_model] Quantization method {legacy['quant_method']!r} is not supported; "
            f"kvstore.model reads MLX affine-quantized weights ('quantization' in config.json).",
            found=legacy["quant_method"],
            supported=["affine"],
        )
    if quantization is not None:
        _quantize(model, quantization, weights)

    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as exc:
        raise ModelLoadError(
            f"[load_model] The weights in '{path}' do not fit the {args.model_type} "
            f"architecture its config.json describes: {exc}",
            path=path,
        ) from exc
    if dtype is not None:
        model.set_dtype(dtype)
    if not lazy:
        mx.eval(model.parameters())
    return model, load_tokenizer(path)
