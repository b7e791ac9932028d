"""Quantized weights made dense for the CPU: what the demo's sessions compute with there.

MLX's CPU quantized matmul is a plain loop, not BLAS: the shipped 4-bit model
prefills 256 tokens in ~10 s through it and in ~0.5 s with the same weights
dequantized to float32 through OpenBLAS (measured on this project's 2-core
VM). Dequantizing changes nothing the store sees but speed: the values are the
ones the quantized kernels multiply by, and caches are stored under the
directory's namespace either way.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

__all__ = ["dequantize"]


def _dense(module: nn.Module) -> nn.Module | None:
    """The float32 twin of a quantized layer, or ``None`` for any other module."""
    if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        # Scales and biases in float32 first: dequantizing in bfloat16 would round each
        # weight once more than the quantized kernels do.
        biases = module.get("biases")
        weight = mx.dequantize(
            module.weight,
            module.scales.astype(mx.float32),
            None if biases is None else biases.astype(mx.float32),
            group_size=module.group_size,
            bits=module.bits,
            mode=module.mode,
        )
    else:
        return None
    rows, cols = weight.shape
    if isinstance(module, nn.QuantizedEmbedding):
        dense: nn.Module = nn.Embedding(rows, cols)
    else:
        dense = nn.Linear(cols, rows, bias="bias" in module)
        if "bias" in module:
            dense.bias = module.bias.astype(mx.float32)
    dense.weight = weight
    return dense


def dequantize(model: nn.Module) -> int:
    """Replace every affine-quantized layer of ``model`` by a float32 dense one, in
    place, and cast the other parameters to float32; the number of layers replaced."""
    replaced = [(name, d) for name, m in model.named_modules() if (d := _dense(m)) is not None]
    if replaced:
        model.update_modules(tree_unflatten(replaced))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return len(replaced)
