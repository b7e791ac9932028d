"""pycode-lm (``fixtures/pycode-lm``): K/V, attention and next-token fidelity.

Protocol (BENCHMARKS.md "Fidelity"): the model cast to float32; for each of
``windows`` held-out windows, prefill ``prefill`` bytes with the cache under
test, feed the next ``continuation`` bytes as one chunk, and compare the
chunk's next-token distributions with a plain-cache run (KL(plain || test)
per position, top-1 agreement, perplexity). The plain run also records each
layer's post-RoPE queries, keys and values at the prefill; each family's
cache stores those same K/V, and relMSE, attention-output cosine and
attention KL are measured on them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from kvstore.caches import KVCache
from tools.quality.families import ATTRIBUTED, Family, OneSidedKVCache, through_cache
from tools.quality.metrics import (
    Samples,
    attention,
    channel_outlier_ratio,
    cosine,
    kl_divergence,
    mean_to_spread,
    relmse,
)

__all__ = ["evaluate_pycode", "load_pycode", "recording_attention"]


@contextlib.contextmanager
def recording_attention(module: Any) -> Iterator[list[tuple[mx.array, mx.array, mx.array]]]:
    """Record ``(queries, keys, values)`` of every attention call of an mlx-lm model module."""
    calls: list[tuple[mx.array, mx.array, mx.array]] = []
    original = module.scaled_dot_product_attention

    def record(queries: mx.array, keys: mx.array, values: mx.array, *args: Any, **kw: Any) -> Any:
        calls.append((queries, keys, values))
        return original(queries, keys, values, *args, **kw)

    module.scaled_dot_product_attention = record
    try:
        yield calls
    finally:
        module.scaled_dot_product_attention = original


def _log_softmax(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _run(model: Any, caches: list[Any], prefill: mx.array, chunk: mx.array) -> mx.array:
    model(prefill[None], cache=caches)
    logp = _log_softmax(model(chunk[None], cache=caches)[0])
    mx.eval(logp)
    return logp


def load_pycode(
    model_dir: Path, windows: int, tokens: int
) -> tuple[Any, dict[str, Any], Any, np.ndarray, list[int]]:
    """``(model in float32, config, its mlx-lm module, held-out bytes, window starts)``:
    ``windows`` evenly spaced starts of ``tokens + 1`` held-out bytes (the last one a target)."""
    import importlib

    from mlx_lm.utils import load_model

    model, config = load_model(Path(model_dir))
    model.set_dtype(mx.float32)
    module = importlib.import_module(type(model).__module__)
    data = np.frombuffer((Path(model_dir) / "heldout.txt").read_bytes(), np.uint8)
    starts = np.linspace(0, len(data) - tokens - 1, windows).astype(int).tolist()
    return model, config, module, data, starts


def evaluate_pycode(
    model_dir: Path,
    families: Sequence[Family],
    windows: int = 8,
    prefill: int = 1024,
    continuation: int = 256,
    log: Any = print,
) -> dict[str, Any]:
    """Measure every family on pycode-lm; returns the summary (JSON-ready)."""
    model, config, module, data, starts = load_pycode(model_dir, windows, prefill + continuation)
    head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    layers = len(model.layers)
    span = prefill + continuation + 1

    samples = Samples()
    layer_stats: dict[str, list[list[float]]] = {
        "outlier_ratio": [],
        "mean_to_spread": [],
        "centred_late_ratio": [],
    }
    for w, start in enumerate(starts):
        tick = time.perf_counter()
        tokens = mx.array(data[start : start + span].astype(np.int32))
        pre, chunk = tokens[:prefill], tokens[prefill : prefill + continuation]
        targets = np.array(tokens[prefill + 1 : span])
        caches = [KVCache() for _ in range(layers)]
        with recording_attention(module) as calls:
            model(pre[None], cache=caches)
        qkv = [tuple(a.astype(mx.float32) for a in call) for call in calls[:layers]]
        mx.eval(qkv)
        logp0 = _log_softmax(model(chunk[None], cache=caches)[0])
        mx.eval(logp0)
        layer_stats["centred_late_ratio"].append(
            [_centred_late_ratio(c, prefill, continuation) for c in caches]
        )
        nll0 = -np.array(logp0)[np.arange(continuation), targets]
        samples.add(("plain", "nll"), nll0)
        exact = [attention(q, k, v, causal=True) for q, k, v in qkv]
        mx.eval(exact)
        for _, alogp in exact:  # how peaked attention is: the largest weight per query
            samples.add(("plain", "attn_peak"), np.array(mx.exp(alogp).max(axis=-1)))
        layer_stats["outlier_ratio"].append([channel_outlier_ratio(k) for _, k, _ in qkv])
        layer_stats["mean_to_spread"].append([mean_to_spread(k) for _, k, _ in qkv])

        for fam in families:
            logp = _run(model, [fam.make(head_dim) for _ in range(layers)], pre, chunk)
            samples.add((fam.name, "kl"), kl_divergence(logp0, logp))
            top = np.array(mx.argmax(logp, axis=-1) == mx.argmax(logp0, axis=-1))
            samples.add((fam.name, "top1"), top.astype(np.float64))
            samples.add((fam.name, "nll"), -np.array(logp)[np.arange(continuation), targets])
            if fam.name in ATTRIBUTED:
                for side in ("k", "v"):
                    caches = [OneSidedKVCache(fam, side) for _ in range(layers)]
                    one = _run(model, caches, pre, chunk)
                    samples.add((fam.name, f"kl_{side}_only"), kl_divergence(logp0, one))
            for i, ((q, k, v), (out, alogp)) in enumerate(zip(qkv, exact)):
                kh, vh = through_cache(fam.make(head_dim), k, v)
                for key in ((fam.name, "k"), (fam.name, "k", str(i))):
                    samples.add(key, relmse(k, kh))
                for key in ((fam.name, "v"), (fam.name, "v", str(i))):
                    samples.add(key, relmse(v, vh))
                mu = mx.mean(k, axis=(0, 2), keepdims=True)
                informative = mx.sum((k - kh) ** 2) / mx.sum((k - mu) ** 2)
                samples.add((fam.name, "k_informative", str(i)), np.array([informative.item()]))
                out_h, alogp_h = attention(q, kh, vh, causal=True)
                cos = cosine(out, out_h)
                akl = kl_divergence(alogp, alogp_h)
                samples.add((fam.name, "cos"), cos)
                samples.add((fam.name, "cos", str(i)), cos)
                samples.add((fam.name, "attn_kl"), akl)
                if fam.name in ATTRIBUTED:
                    samples.add((fam.name, "cos_k_only"), cosine(out, attention(q, kh, v, True)[0]))
                    samples.add((fam.name, "cos_v_only"), cosine(out, attention(q, k, vh, True)[0]))
        log(
            f"pycode-lm window {w + 1}/{len(starts)} (bytes {start}..{start + span}) "
            f"{time.perf_counter() - tick:.1f}s"
        )

    bytes_plain = _bytes_per_token(lambda: KVCache(), model, layers, head_dim, mx.bfloat16)
    return {
        "source": "pycode-lm",
        "head_dim": head_dim,
        "layers": layers,
        "kv_heads": int(config["num_key_value_heads"]),
        "windows": starts,
        "prefill": prefill,
        "continuation": continuation,
        "bf16_bytes_per_token": bytes_plain,
        "attention_peak_median": samples.quantile(("plain", "attn_peak"), 0.5),
        "layer_stats": {
            name: np.mean(np.array(v), axis=0).tolist() for name, v in layer_stats.items()
        },
        "families": {
            fam.name: _summary(samples, fam, layers, head_dim, model, bytes_plain)
            for fam in families
        },
    }


def _centred_late_ratio(cache: KVCache, prefill: int, continuation: int) -> float:
    """||k - mu||^2 / ||k||^2 over the continuation's keys, mu estimated as the
    ``center`` option does (first prefill tokens): > 1 means centering adds error there."""
    from kvstore.caches.turboquant import CENTER_PREFIX_TOKENS

    assert cache.keys is not None
    keys = cache.keys[..., : prefill + continuation, :]
    mu = keys[..., :CENTER_PREFIX_TOKENS, :].mean(axis=(0, 2), keepdims=True)
    late = keys[..., prefill:, :]
    return (mx.sum((late - mu) ** 2) / mx.sum(late * late)).item()


def _bytes_per_token(make: Any, model: Any, layers: int, head_dim: int, dtype: Any) -> int:
    """Stored bytes one token costs across the model's layers (K and V, all KV heads)."""
    heads = model.layers[0].self_attn.n_kv_heads
    total = 0
    for _ in range(layers):
        cache = make()
        x = mx.zeros((1, heads, 1, head_dim), dtype)
        cache.update_and_fetch(x, x)
        total += cache.bytes_per_token()
    return total


def _summary(
    samples: Samples, fam: Family, layers: int, head_dim: int, model: Any, bytes_plain: int
) -> dict[str, Any]:
    nll, nll0 = samples.mean((fam.name, "nll")), samples.mean(("plain", "nll"))
    stored = _bytes_per_token(lambda: fam.make(head_dim), model, layers, head_dim, mx.bfloat16)
    attribution = {}
    if fam.name in ATTRIBUTED:
        attribution = {
            "kl_k_only": samples.mean((fam.name, "kl_k_only")),
            "kl_v_only": samples.mean((fam.name, "kl_v_only")),
            "cos_k_only_median": samples.quantile((fam.name, "cos_k_only"), 0.5),
            "cos_v_only_median": samples.quantile((fam.name, "cos_v_only"), 0.5),
        }
    return {
        **attribution,
        "signature": fam.signature(head_dim),
        "bytes_per_token": stored,
        "x_bf16": stored / bytes_plain,
        "relmse_k": samples.mean((fam.name, "k")),
        "relmse_v": samples.mean((fam.name, "v")),
        "cos_median": samples.quantile((fam.name, "cos"), 0.5),
        "cos_p5": samples.quantile((fam.name, "cos"), 0.05),
        "attn_kl_mean": samples.mean((fam.name, "attn_kl")),
        "kl_mean": samples.mean((fam.name, "kl")),
        "kl_median": samples.quantile((fam.name, "kl"), 0.5),
        "kl_p95": samples.quantile((fam.name, "kl"), 0.95),
        "top1": samples.mean((fam.name, "top1")),
        "delta_ppl": float(np.exp(nll - nll0) - 1),
        "per_layer": {
            "relmse_k": [samples.mean((fam.name, "k", str(i))) for i in range(layers)],
            "relmse_v": [samples.mean((fam.name, "v", str(i))) for i in range(layers)],
            "k_informative": [
                samples.mean((fam.name, "k_informative", str(i))) for i in range(layers)
            ],
            "cos_median": [samples.quantile((fam.name, "cos", str(i)), 0.5) for i in range(layers)],
        },
    }
