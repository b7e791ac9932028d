"""The building blocks: norms, gated MLP, attention and the decoder block.

Parameter names are mlx-lm's (``self_attn.q_proj``, ``input_layernorm``, ...)
so mlx-lm model directories load as they are, and the operations are
mlx-lm's in the same order so logits match it.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from kvstore.model.args import ModelArgs
from kvstore.model.attention import Attend
from kvstore.model.gated_delta import GatedDeltaNet
from kvstore.model.rope import initialize_rope

__all__ = ["OffsetRMSNorm", "MLP", "Attention", "TransformerBlock", "make_norm"]


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: scales by ``1 + weight`` (weights are stored as offsets)."""

    def __init__(self, dims: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = mx.zeros((dims,))  # the identity scale; checkpoints overwrite it
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, 1.0 + self.weight, self.eps)


def make_norm(args: ModelArgs, dims: int) -> nn.Module:
    """The RMSNorm flavour of ``args`` over ``dims`` features."""
    cls = OffsetRMSNorm if args.gemma_norms else nn.RMSNorm
    return cls(dims, eps=args.rms_norm_eps)


@partial(mx.compile, shapeless=True)
def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    return nn.silu(gate) * x


@partial(mx.compile, shapeless=True)
def geglu(gate: mx.array, x: mx.array) -> mx.array:
    return nn.gelu_approx(gate) * x


@partial(mx.compile, shapeless=True)
def clip_residual(x: mx.array, y: mx.array) -> mx.array:
    """``x + y``, clipped to the float16 range in float16 (Gemma activations overflow it)."""
    if x.dtype != mx.float16:
        return x + y
    bound = mx.finfo(mx.float16).max
    return mx.clip(x.astype(mx.float32) + y.astype(mx.float32), -bound, bound).astype(mx.float16)


class MLP(nn.Module):
    """Gated feed-forward: ``down(act(gate(x)) * up(x))``."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        dim, hidden, bias = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self._act = geglu if args.hidden_act == "gelu_approx" else swiglu

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self._act(self.gate_proj(x), self.up_proj(x)))


class Attention(nn.Module):
    """Grouped-query attention with RoPE, optional q/k norms, over a cache.

    Args:
        args: model arguments.
        window: this layer's sliding window (``None``: full attention). Sliding
            layers of a model with ``rope_local_theta`` use that base, unscaled.
    """

    def __init__(self, args: ModelArgs, window: int | None) -> None:
        super().__init__()
        dim, head_dim = args.hidden_size, args.head_dim
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = head_dim
        self.window = window
        self.scale = args.attention_scale
        # Qwen3-Next/3.5: q_proj also yields a per-head output gate.
        self._gate = args.attn_output_gate
        q_out = self.n_heads * head_dim * (2 if self._gate else 1)
        self.q_proj = nn.Linear(dim, q_out, bias=args.qkv_bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=args.qkv_bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=args.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * head_dim, dim, bias=args.o_proj_bias)
        if args.qk_norm:
            self.q_norm = make_norm(args, head_dim)
            self.k_norm = make_norm(args, head_dim)
        self._qk_norm = args.qk_norm
        rotary = args.rotary_dims
        if window is not None and args.rope_local_theta is not None:
            self.rope = initialize_rope(rotary, args.rope_local_theta, args.rope_traditional)
        else:
            self.rope = initialize_rope(
                rotary, args.rope_theta, args.rope_traditional, args.rope_scaling
            )

    def project(self, x: mx.array, offset: int | mx.array = 0) -> tuple[mx.array, ...]:
        """Queries, keys and values ``[B, heads, L, head_dim]`` of ``x``, rotated for
        positions from ``offset`` (an int, or an array: a compiled step's input).

        An attention with an output gate (Qwen3-Next/3.5) returns its gate
        ``[B, L, heads * head_dim]`` fourth, for :meth:`output`."""
        B, L, _ = x.shape
        queries = self.q_proj(x).reshape(B, L, self.n_heads, -1)
        gate = None
        if self._gate:
            queries, gate = mx.split(queries, 2, axis=-1)
            gate = gate.reshape(B, L, -1)
        keys = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1)
        values = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        if self._qk_norm:
            queries, keys = self.q_norm(queries), self.k_norm(keys)
        queries, keys = queries.transpose(0, 2, 1, 3), keys.transpose(0, 2, 1, 3)
        projected = self.rope(queries, offset=offset), self.rope(keys, offset=offset), values
        return projected if gate is None else (*projected, gate)

    @property
    def gated(self) -> bool:
        """The output is gated per head (q_proj yields the gate): :meth:`project`
        returns four arrays."""
        return bool(self._gate)

    def output(self, attended: mx.array, gate: mx.array | None = None) -> mx.array:
        """The output projection of what attention returned (``[B, heads, L, head_dim]``),
        gated by ``gate`` where the layer has one."""
        B, _, L, _ = attended.shape
        output = attended.transpose(0, 2, 1, 3).reshape(B, L, -1)
        if gate is not None:
            output = output * mx.sigmoid(gate)
        return self.o_proj(output)

    def __call__(self, x: mx.array, mask: Any, cache: Any, attend: Attend) -> mx.array:
        # project / output are the halves the specialised decode step compiles (issue 17).
        queries, keys, values, *gate = self.project(x, 0 if cache is None else cache.offset)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        return self.output(attend(queries, keys, values, self.scale, mask), *gate)


class TransformerBlock(nn.Module):
    """Pre-norm decoder block; with ``sandwich_norms`` (Gemma) the attention and
    MLP outputs are normed too before joining the residual stream.

    The token mixer is ``self_attn`` (attention over a KV cache) or, for a
    ``"gated-delta"`` layer, ``linear_attn`` (a Gated-DeltaNet over a recurrent
    cache); ``kind`` says which.
    """

    def __init__(self, args: ModelArgs, window: int | None, kind: str = "attention") -> None:
        super().__init__()
        self.kind = kind
        if kind == "gated-delta":
            self.linear_attn = GatedDeltaNet(args)
        else:
            self.self_attn = Attention(args, window)
        self.mlp = MLP(args)
        self.input_layernorm = make_norm(args, args.hidden_size)
        self.post_attention_layernorm = make_norm(args, args.hidden_size)
        self._sandwich = args.sandwich_norms
        if self._sandwich:
            self.pre_feedforward_layernorm = make_norm(args, args.hidden_size)
            self.post_feedforward_layernorm = make_norm(args, args.hidden_size)

    def __call__(self, x: mx.array, mask: Any, cache: Any, attend: Attend | None) -> mx.array:
        if attend is None:
            r = self.linear_attn(self.input_layernorm(x), mask, cache)
        else:
            r = self.self_attn(self.input_layernorm(x), mask, cache, attend)
        return self.finish(x, r)

    def finish(self, x: mx.array, r: mx.array) -> mx.array:
        """The block's output from its input ``x`` and the token mixer's output ``r``:
        the residual joins and the MLP."""
        if self._sandwich:
            h = clip_residual(x, self.post_attention_layernorm(r))
            r = self.mlp(self.pre_feedforward_layernorm(h))
            return clip_residual(h, self.post_feedforward_layernorm(r))
        h = x + r
        return h + self.mlp(self.post_attention_layernorm(h))
