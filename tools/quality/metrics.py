"""Fidelity measures (definitions in specs/turboquant.md, "Quality metrics")."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from kvstore.turboquant.quantizer import quantizer_for

__all__ = [
    "Samples",
    "attention",
    "channel_outlier_ratio",
    "cosine",
    "kl_divergence",
    "level0_relmse",
    "mean_to_spread",
    "relmse",
]


def relmse(x: mx.array, xh: mx.array) -> np.ndarray:
    """Per-vector ``||x - x^||^2 / ||x||^2`` (flattened, float64)."""
    err = mx.sum((x - xh) ** 2, axis=-1) / mx.maximum(mx.sum(x * x, axis=-1), 1e-30)
    return np.array(err, dtype=np.float64).reshape(-1)


def cosine(a: mx.array, b: mx.array) -> np.ndarray:
    """Per-row cosine along the last axis (flattened, float64)."""
    dot = mx.sum(a * b, axis=-1)
    norms = mx.linalg.norm(a, axis=-1) * mx.linalg.norm(b, axis=-1)
    return np.array(dot / mx.maximum(norms, 1e-30), dtype=np.float64).reshape(-1)


def kl_divergence(logp: mx.array, logq: mx.array) -> np.ndarray:
    """Per-row KL(p || q) from log-probabilities along the last axis (float64);
    masked entries (``p = 0``) contribute 0."""
    p = mx.exp(logp)
    kl = mx.sum(mx.where(p > 0, p * (logp - logq), 0.0), axis=-1)
    return np.array(kl, dtype=np.float64).reshape(-1)


def attention(q: mx.array, k: mx.array, v: mx.array, causal: bool) -> tuple[mx.array, mx.array]:
    """``(softmax(q k^T / sqrt(d) + mask) v, log-probabilities)`` in float32.

    ``q [B, Hq, T, D]``; ``k, v [B, Hkv, T, D]`` with ``Hq`` a multiple of ``Hkv`` (GQA).
    """
    repeat = q.shape[1] // k.shape[1]
    if repeat > 1:
        k, v = mx.repeat(k, repeat, axis=1), mx.repeat(v, repeat, axis=1)
    scores = (q @ mx.swapaxes(k, -1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        t = q.shape[2]
        scores = mx.where(mx.tril(mx.ones((t, t), mx.bool_)), scores, -mx.inf)
    logp = scores - mx.logsumexp(scores, axis=-1, keepdims=True)
    return mx.exp(logp) @ v, logp


def channel_outlier_ratio(k: mx.array) -> float:
    """max / median over channels of the mean |k| (keys ``[B, H, T, D]``, per head pooled)."""
    per_channel = np.array(mx.mean(mx.abs(k), axis=(0, 2)))  # [H, D]
    return float(np.max(per_channel / np.median(per_channel, axis=-1, keepdims=True)))


def mean_to_spread(k: mx.array) -> float:
    """max over heads of ||mu|| / RMS(||k - mu||): > 3 makes centering worth it (spec)."""
    mu = mx.mean(k, axis=(0, 2), keepdims=True)
    spread = mx.sqrt(mx.mean(mx.sum((k - mu) ** 2, axis=-1), axis=(0, 2)))
    return float(mx.max(mx.linalg.norm(mu[0, :, 0, :], axis=-1) / spread).item())


def level0_relmse(bits: int, dim: int, kind: str, vectors: int = 20_000) -> float:
    """The Level-0 relMSE of ``kind``'s default scale mode at ``dim``: random unit
    vectors, fixed seed (the reference the Level-1 gate compares against)."""
    x = mx.random.normal((vectors, dim), key=mx.random.key(dim))
    x = x / mx.linalg.norm(x, axis=-1, keepdims=True)
    q = quantizer_for(bits, dim, kind)
    return float(np.mean(relmse(x, q.decode(*q.encode(x)))))


class Samples:
    """Per-key lists of per-sample values, reduced to summary statistics at the end."""

    def __init__(self) -> None:
        self._data: dict[tuple[str, ...], list[np.ndarray]] = {}

    def add(self, key: tuple[str, ...], values: np.ndarray) -> None:
        self._data.setdefault(key, []).append(np.asarray(values, dtype=np.float64).reshape(-1))

    def values(self, key: tuple[str, ...]) -> np.ndarray:
        return np.concatenate(self._data[key]) if key in self._data else np.array([])

    def mean(self, key: tuple[str, ...]) -> float:
        return float(np.mean(self.values(key)))

    def quantile(self, key: tuple[str, ...], q: float) -> float:
        return float(np.quantile(self.values(key), q))
