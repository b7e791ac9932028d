"""The demo model's shape and the decoder it trains: mlx-lm's ``llama`` layout, written out.

The module tree and parameter names are mlx-lm's ``mlx_lm.models.llama``
(``model.embed_tokens``, ``model.layers.N.self_attn.q_proj``, ...), so the
exported weights load with ``mlx_lm.load`` and ``kvstore.model.load_model``
unchanged; the tool carries its own copy so that training needs neither
package (tests check the logits against both).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

__all__ = ["ModelShape", "PRESET_SHAPES", "Llama", "init_weights", "quantized_bytes"]

#: mlx-lm's default affine quantization, the one the export uses.
GROUP_SIZE = 64
BITS = 4


@dataclass(frozen=True)
class ModelShape:
    """A llama decoder's dimensions (the fields of its mlx-lm ``config.json``)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5

    def config(self) -> dict[str, Any]:
        """The mlx-lm ``config.json`` of this shape (before quantization)."""
        return {
            "model_type": "llama",
            **dataclasses.asdict(self),
            "rope_traditional": False,
            "tie_word_embeddings": True,
            "attention_bias": False,
            "mlp_bias": False,
        }

    def parameters(self) -> int:
        """Parameter count (tied embeddings counted once)."""
        return sum(n for n, _ in self._matrices()) + self.hidden_size * (
            2 * self.num_hidden_layers + 1
        )

    def _matrices(self) -> list[tuple[int, int]]:
        """``(elements, input dims)`` of every matrix the export quantizes."""
        h, q, kv = self.hidden_size, self.num_attention_heads, self.num_key_value_heads
        d, m = self.head_dim, self.intermediate_size
        layer = [(h * q * d, h), (h * kv * d, h), (h * kv * d, h), (q * d * h, q * d)]
        layer += [(h * m, h), (h * m, h), (m * h, m)]
        return [(self.vocab_size * h, h)] + layer * self.num_hidden_layers


PRESET_SHAPES: dict[str, ModelShape] = {
    # The shipped model: ~11.9 M parameters, ~6.7 MB at 4 bits (the 8 MB budget of issue 15
    # leaves room for tokenizer.json); 2 KV heads keep the demo's stored blocks small.
    "demo": ModelShape(384, 6, 6, 2, 64, 1152, 4096, 2048),
    # Toy scale, for tests and a CPU smoke run: every dimension a multiple of the group.
    "toy": ModelShape(64, 2, 2, 1, 32, 128, 512, 256),
}


def quantized_bytes(shape: ModelShape, scale_bytes: int = 2) -> int:
    """Bytes of ``model.safetensors`` at 4 bits, group 64, bf16 scales and biases, norms
    in bf16 (the header, a few KiB, not counted).

    Raises:
        ValueError: a matrix whose input dimension is not a multiple of the group
            (mlx-lm would leave it unquantized, and the estimate would be wrong).
    """
    total = 0
    for elements, inputs in shape._matrices():
        if inputs % GROUP_SIZE:
            raise ValueError(
                f"[demo_model] Every quantized matrix needs an input dimension that is a "
                f"multiple of {GROUP_SIZE}; received {inputs}. Pick dimensions in steps of "
                f"{GROUP_SIZE}."
            )
        total += elements * BITS // 8 + 2 * scale_bytes * (elements // GROUP_SIZE)
    return total + scale_bytes * shape.hidden_size * (2 * shape.num_hidden_layers + 1)


class Attention(nn.Module):
    def __init__(self, s: ModelShape) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = s.num_attention_heads, s.num_key_value_heads
        self.scale = s.head_dim**-0.5
        self.q_proj = nn.Linear(s.hidden_size, s.num_attention_heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(s.hidden_size, s.num_key_value_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(s.hidden_size, s.num_key_value_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.num_attention_heads * s.head_dim, s.hidden_size, bias=False)
        self.rope = nn.RoPE(s.head_dim, traditional=False, base=s.rope_theta)

    def __call__(self, x: mx.array) -> mx.array:
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        out = mx.fast.scaled_dot_product_attention(
            self.rope(q), self.rope(k), v, scale=self.scale, mask="causal"
        )
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, s: ModelShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerBlock(nn.Module):
    def __init__(self, s: ModelShape, dropout: float) -> None:
        super().__init__()
        self.self_attn = Attention(s)
        self.mlp = MLP(s)
        self.input_layernorm = nn.RMSNorm(s.hidden_size, eps=s.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(s.hidden_size, eps=s.rms_norm_eps)
        # Parameter-free, so the exported layout is mlx-lm's all the same.
        self.dropout = nn.Dropout(dropout)

    def __call__(self, x: mx.array) -> mx.array:
        h = x + self.dropout(self.self_attn(self.input_layernorm(x)))
        return h + self.dropout(self.mlp(self.post_attention_layernorm(h)))


class LlamaModel(nn.Module):
    def __init__(self, s: ModelShape, dropout: float) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
        self.layers = [TransformerBlock(s, dropout) for _ in range(s.num_hidden_layers)]
        self.norm = nn.RMSNorm(s.hidden_size, eps=s.rms_norm_eps)

    def __call__(self, inputs: mx.array) -> mx.array:
        h = self.embed_tokens(inputs)
        for layer in self.layers:
            h = layer(h)
        return self.norm(h)


class Llama(nn.Module):
    """A causal LM over token ids ``[B, L]`` -> logits ``[B, L, vocab]`` (no cache: the tool
    only trains and scores whole windows, and samples short texts by re-running them).

    ``dropout`` applies to the residual branches in training mode only (``model.train()``).
    """

    def __init__(self, shape: ModelShape, dropout: float = 0.0) -> None:
        super().__init__()
        self.shape = shape
        self.model = LlamaModel(shape, dropout)

    def __call__(self, inputs: mx.array) -> mx.array:
        return self.model.embed_tokens.as_linear(self.model(inputs))


def init_weights(model: Llama, seed: int) -> None:
    """GPT-2-style initial weights: N(0, 0.02), the residual outputs (``o_proj``,
    ``down_proj``) scaled by ``1/sqrt(2 * layers)`` so the residual stream's variance
    does not grow with depth; norms at 1."""
    mx.random.seed(seed)
    residual = 0.02 / math.sqrt(2 * model.shape.num_hidden_layers)

    def init(path: str, value: mx.array) -> mx.array:
        if "norm" in path:
            return mx.ones_like(value)
        std = residual if path.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
        return std * mx.random.normal(value.shape)

    flat = [(k, init(k, v)) for k, v in tree_flatten(model.parameters())]
    model.update(tree_unflatten(flat))
    mx.eval(model.parameters())
