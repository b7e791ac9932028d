"""The Gated-DeltaNet layer of Qwen3.5 / Qwen3-Next, and its recurrence.

Parameter names are mlx-lm's ``qwen3_5.GatedDeltaNet`` (``linear_attn.conv1d``,
``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, ``dt_bias``,
``A_log``, ``norm``, ``out_proj``), so one mlx-lm model directory loads into
both. The operations are those of mlx-lm's *ops* path (``gated_delta_ops``,
not its Metal kernel), in the same order and dtypes, so logits match it to
the bit on the CPU. The state is float32 whatever the model's dtype.

Per token ``t``, for each value head (``g`` a scalar decay, ``beta`` a gate)::

    S = S * g_t
    delta = (v_t - S @ k_t) * beta_t
    S = S + outer(delta, k_t)
    y_t = S @ q_t

The layer talks to its cache through mlx-lm's ``ArraysCache`` protocol only
(``cache[0]`` conv window, ``cache[1]`` state, ``lengths``, ``advance``), so
it runs on :class:`~kvstore.caches.recurrent.GatedDeltaCache` and on mlx-lm's
own caches. During a speculative round it hands the cache its conv input and
a replay of its recurrence (:func:`kvstore.abc.cache.records_round`).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from kvstore.abc.cache import records_round
from kvstore.model.args import ModelArgs

__all__ = ["GatedDeltaNet", "RMSNormGated", "gated_delta_step", "gated_delta_scan", "decay"]


@partial(mx.compile, shapeless=True)
def decay(A_log: mx.array, a: mx.array, dt_bias: mx.array) -> mx.array:
    """Per-token, per-head state decay ``g = exp(-exp(A_log) * softplus(a + dt_bias))``."""
    return mx.exp(-mx.exp(A_log.astype(mx.float32)) * nn.softplus(a + dt_bias))


@partial(mx.compile, shapeless=True)
def _gated_silu(h: mx.array, gate: mx.array, x: mx.array) -> mx.array:
    return (nn.silu(gate.astype(mx.float32)) * x.astype(mx.float32)).astype(h.dtype)


class RMSNormGated(nn.Module):
    """RMSNorm of the recurrence's output, gated by ``silu(z)`` in float32."""

    def __init__(self, dims: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = mx.ones(dims)

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        return _gated_silu(x, gate, mx.fast.rms_norm(x, self.weight, self.eps))


@mx.compile
def gated_delta_step(
    q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array
) -> tuple[mx.array, mx.array]:
    """One token of the recurrence: ``q, k [B, H, Dk]``, ``v [B, H, Dv]``,
    ``g, beta [B, H]``, ``state [B, H, Dv, Dk]`` -> ``(y [B, H, Dv], state)``."""
    state = state * g[..., None, None]
    kv_mem = (state * k[..., None, :]).sum(axis=-1)
    delta = (v - kv_mem) * beta[..., None]
    state = state + k[..., None, :] * delta[..., None]
    y = (state * q[..., None, :]).sum(axis=-1)
    return y.astype(q.dtype), state


def gated_delta_scan(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array | None,
    steps: int | None = None,
) -> tuple[mx.array | None, mx.array]:
    """The recurrence over the first ``steps`` tokens (default all) of
    ``q, k [B, T, Hk, Dk]``, ``v [B, T, Hv, Dv]``, ``g, beta [B, T, Hv]``.

    Returns ``(y [B, steps, Hv, Dv]`` or ``None`` for 0 steps``, state)``.
    """
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    if (repeat := Hv // Hk) > 1:
        q = mx.repeat(q, repeat, -2)
        k = mx.repeat(k, repeat, -2)
    ys = []
    for t in range(T if steps is None else steps):
        y, state = gated_delta_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        ys.append(y)
    return (mx.stack(ys, axis=1) if ys else None), state


def _masked_scan(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array | None,
    mask: mx.array,
) -> tuple[mx.array, mx.array]:
    """:func:`gated_delta_scan` where padded positions (``mask`` false) keep the state."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    if (repeat := Hv // Hk) > 1:
        q = mx.repeat(q, repeat, -2)
        k = mx.repeat(k, repeat, -2)
    ys = []
    for t in range(T):
        y, new = gated_delta_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        state = mx.where(mx.expand_dims(mask[:, t], axis=(1, 2, 3)), new, state)
        ys.append(y)
    return mx.stack(ys, axis=1), state


class GatedDeltaNet(nn.Module):
    """A Gated-DeltaNet token mixer (linear attention with a recurrent state)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.hidden_size = args.hidden_size
        self.num_k_heads = args.linear_num_key_heads
        self.num_v_heads = args.linear_num_value_heads
        self.head_k_dim = args.linear_key_head_dim
        self.head_v_dim = args.linear_value_head_dim
        self.key_dim = self.head_k_dim * self.num_k_heads
        self.value_dim = self.head_v_dim * self.num_v_heads
        self.conv_kernel_size = args.linear_conv_kernel_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv1d = nn.Conv1d(
            in_channels=self.conv_dim,
            out_channels=self.conv_dim,
            kernel_size=self.conv_kernel_size,
            groups=self.conv_dim,
            padding=0,
            bias=False,
        )
        self.in_proj_qkv = nn.Linear(self.hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(self.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(self.hidden_size, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(self.hidden_size, self.num_v_heads, bias=False)
        self.dt_bias = mx.ones(self.num_v_heads)
        self.A_log = mx.zeros(self.num_v_heads)  # checkpoints (or init_weights) set it
        self.norm = RMSNormGated(self.head_v_dim, eps=args.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, self.hidden_size, bias=False)

    def __call__(self, x: mx.array, mask: mx.array | None, cache: Any) -> mx.array:
        B, S, _ = x.shape
        qkv = self.in_proj_qkv(x)
        z = self.in_proj_z(x).reshape(B, S, self.num_v_heads, self.head_v_dim)
        b = self.in_proj_b(x)
        a = self.in_proj_a(x)

        if cache is not None and cache[0] is not None:
            conv_state = cache[0]
        else:
            conv_state = mx.zeros((B, self.conv_kernel_size - 1, self.conv_dim), dtype=x.dtype)
        if mask is not None:
            qkv = mx.where(mask[..., None], qkv, 0)
        conv_input = mx.concatenate([conv_state, qkv], axis=1)
        if cache is not None:
            n_keep = self.conv_kernel_size - 1
            if cache.lengths is not None:
                ends = mx.clip(cache.lengths, 0, S)
                positions = (ends[:, None] + mx.arange(n_keep))[..., None]
                cache[0] = mx.take_along_axis(conv_input, positions, axis=1)
            else:
                cache[0] = mx.contiguous(conv_input[:, -n_keep:, :])
        conv_out = nn.silu(self.conv1d(conv_input))

        q, k, v = (
            t.reshape(B, S, h, d)
            for t, h, d in zip(
                mx.split(conv_out, [self.key_dim, 2 * self.key_dim], -1),
                (self.num_k_heads, self.num_k_heads, self.num_v_heads),
                (self.head_k_dim, self.head_k_dim, self.head_v_dim),
            )
        )
        state = cache[1] if cache is not None else None
        # L2 norms as RMS norms: the l2 eps (1e-6, on sum(x^2)) scaled to mean(x^2);
        # q also carries the Dk**-0.5 readout scale.
        inv_scale = self.head_k_dim**-0.5
        eps = 1e-6 * inv_scale**2
        q = (inv_scale**2) * mx.fast.rms_norm(q, None, eps)
        k = inv_scale * mx.fast.rms_norm(k, None, eps)

        beta = mx.sigmoid(b)
        g = decay(self.A_log, a, self.dt_bias)
        if mask is None:
            out, state = gated_delta_scan(q, k, v, g, beta, state)
        else:
            out, state = _masked_scan(q, k, v, g, beta, state, mask)
        assert out is not None

        if cache is not None:
            if records_round(cache):
                cache.record_round(conv_input, S, partial(_replay, q, k, v, g, beta))
            cache[1] = state
            cache.advance(S)

        out = self.norm(out, z)
        return self.out_proj(out.reshape(B, S, -1))


def _replay(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array | None,
    steps: int,
) -> mx.array:
    """The state after the first ``steps`` tokens of a recorded forward."""
    return gated_delta_scan(q, k, v, g, beta, state, steps)[1]
