"""``python -m tools.quality.microscaling``: the MLX microscaling KV families beside MLX affine.

Bytes per token and next-token KL of ``kv:mxfp8``, ``kv:mxfp4`` and ``kv:nvfp4``
beside affine ``kv:quant:8:64`` and ``kv:quant:4:64``, measured in one run on
``../shared/fixtures/pycode-lm`` with the BENCHMARKS.md "Fidelity" protocol:
the model cast to float32; for each of 8 held-out windows (the main study's,
:func:`tools.quality.pycode.load_pycode`), prefill 1024 bytes with the cache
under test, feed the next 256 as one chunk, KL(plain || family) per position
against a plain-cache run. Every family runs through kvstore's reference model
(:func:`kvstore.model.load_model`, logits equal to mlx-lm's), built by the
model's cache policy (``CachePolicy(family=...)``) and attended over through
the predicates: affine and microscaling rows alike through
``mx.quantized_matmul`` in the family's mode (mlx-lm's attention knows only
affine). Also: relMSE of the prefill's keys and values through each family,
and top-1 agreement.

Writes ``results/microscaling.json`` (every figure) and ``results/microscaling.md``
(the table). ``--render`` rewrites the markdown from the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

import kvstore
from kvstore.abc.cache import quantized_attention_params
from kvstore.model import CachePolicy, load_model
from tools.quality.metrics import Samples, kl_divergence, relmse
from tools.quality.pycode import load_pycode

HERE = Path(__file__).resolve().parent
DEFAULT_MODEL = Path(__file__).resolve().parents[3] / "shared" / "fixtures" / "pycode-lm"

#: The families, each with the affine family of the same value width it is compared to.
FAMILIES: dict[str, str] = {
    "kv:quant:8:64": "kv:quant:8:64",
    "kv:mxfp8": "kv:quant:8:64",
    "kv:quant:4:64": "kv:quant:4:64",
    "kv:mxfp4": "kv:quant:4:64",
    "kv:nvfp4": "kv:quant:4:64",
}


def _log_softmax(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _run(model: Any, caches: list[Any], prefill: mx.array, chunk: mx.array) -> mx.array:
    model(prefill[None], cache=caches)
    logp = _log_softmax(model(chunk[None], cache=caches)[0])
    mx.eval(logp)
    return logp


def _dequantized(cache: Any, rows: mx.array) -> mx.array:
    """``rows`` as attention sees them after ``cache`` stored them (float32)."""
    stored, _ = cache.update_and_fetch(rows, rows)
    q = quantized_attention_params(cache)
    dense = mx.dequantize(
        *stored, group_size=q.group_size, bits=q.bits, mode=q.mode, dtype=mx.float32
    )
    return dense[..., : rows.shape[2], :]


def _bytes_per_token(model: Any, policy: CachePolicy | None, heads: int, head_dim: int) -> int:
    """Stored bytes one token costs across the model's layers (bfloat16 rows)."""
    total = 0
    for cache in model.make_cache(policy):
        x = mx.zeros((1, heads, 1, head_dim), mx.bfloat16)
        cache.update_and_fetch(x, x)
        total += cache.bytes_per_token()
    return total


def evaluate(model_dir: Path, windows: int, prefill: int, continuation: int, log: Any) -> dict:
    _, config, _, data, starts = load_pycode(model_dir, windows, prefill + continuation)
    model, _ = load_model(model_dir, dtype=mx.float32)
    layout = model.layer_layout()
    heads, head_dim = layout[0]["n_kv_heads"], layout[0]["head_dim"]
    span = prefill + continuation + 1
    samples = Samples()
    for w, start in enumerate(starts):
        tick = time.perf_counter()
        tokens = mx.array(data[start : start + span].astype(np.int32))
        pre, chunk = tokens[:prefill], tokens[prefill : prefill + continuation]
        targets = np.array(tokens[prefill + 1 : span])
        plain = model.make_cache()
        logp0 = _run(model, plain, pre, chunk)
        samples.add(("plain", "nll"), -np.array(logp0)[np.arange(continuation), targets])
        for family in FAMILIES:
            policy = CachePolicy(family=family)
            logp = _run(model, model.make_cache(policy), pre, chunk)
            samples.add((family, "kl"), kl_divergence(logp0, logp))
            top = np.array(mx.argmax(logp, axis=-1) == mx.argmax(logp0, axis=-1))
            samples.add((family, "top1"), top.astype(np.float64))
            samples.add((family, "nll"), -np.array(logp)[np.arange(continuation), targets])
            for cache in plain:  # the prefill's keys and values through the family
                keys, values = (a[..., :prefill, :].astype(mx.float32) for a in cache.state[:2])
                for side, rows in (("k", keys), ("v", values)):
                    fresh = model.make_cache(policy)[0]
                    samples.add((family, side), relmse(rows, _dequantized(fresh, rows)))
        log(f"pycode-lm window {w + 1}/{len(starts)} {time.perf_counter() - tick:.1f}s")
    bf16 = _bytes_per_token(model, None, heads, head_dim)
    nll0 = samples.mean(("plain", "nll"))
    results = {}
    for family, reference in FAMILIES.items():
        stored = _bytes_per_token(model, CachePolicy(family=family), heads, head_dim)
        results[family] = {
            "compared_to": reference,
            "bytes_per_token": stored,
            "x_bf16": stored / bf16,
            "relmse_k": samples.mean((family, "k")),
            "relmse_v": samples.mean((family, "v")),
            "kl_mean": samples.mean((family, "kl")),
            "kl_median": samples.quantile((family, "kl"), 0.5),
            "kl_p95": samples.quantile((family, "kl"), 0.95),
            "top1": samples.mean((family, "top1")),
            "delta_ppl": float(np.exp(samples.mean((family, "nll")) - nll0) - 1),
        }
    for family, reference in FAMILIES.items():
        results[family]["kl_ratio"] = results[family]["kl_mean"] / results[reference]["kl_mean"]
    return {
        "source": "pycode-lm",
        "model": "kvstore.model.load_model (float32)",
        "head_dim": head_dim,
        "kv_heads": heads,
        "layers": len(layout),
        "windows": starts,
        "prefill": prefill,
        "continuation": continuation,
        "bf16_bytes_per_token": bf16,
        "families": results,
        "config_model_type": config.get("model_type"),
    }


def render_markdown(report: dict) -> str:
    r = report["pycode"]
    lines = [
        "# MLX microscaling KV families beside MLX affine (pycode-lm)",
        "",
        f"`{report['command']}` — kvstore {report['kvstore']}, mlx {report['mlx']}, "
        f"{report['blas']}, {report['seconds']:.0f} s.",
        "",
        f"{r['source']}: {r['layers']} layers, {r['kv_heads']} KV heads, head_dim "
        f"{r['head_dim']}; model {r['model']}; {len(r['windows'])} windows of "
        f"{r['prefill']} prefill + {r['continuation']} bytes; KL(plain ‖ family) per position "
        f"of the continuation, averaged; bf16 = {r['bf16_bytes_per_token']} bytes/token.",
        "",
        "| family | bytes/token | × bf16 | relMSE K | relMSE V | next-token KL (mean) "
        "| KL median | KL p95 | KL ÷ affine of its width | top-1 | Δppl |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for family, f in r["families"].items():
        ratio = "—" if f["compared_to"] == family else f"{f['kl_ratio']:.2f} × {f['compared_to']}"
        lines.append(
            f"| `{family}` | {f['bytes_per_token']} | {f['x_bf16']:.3f} | {f['relmse_k']:.2e} "
            f"| {f['relmse_v']:.2e} | {f['kl_mean']:.4f} | {f['kl_median']:.4f} "
            f"| {f['kl_p95']:.4f} | {ratio} | {f['top1']:.3f} | {f['delta_ppl']:+.2%} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.quality.microscaling", description=__doc__
    )
    parser.add_argument(
        "--model-dir", type=Path, default=Path(os.environ.get("PYCODE_LM", DEFAULT_MODEL))
    )
    parser.add_argument("--windows", type=int, default=8, help="pycode-lm windows (>= 4)")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--render", action="store_true", help="only rewrite the markdown")
    args = parser.parse_args(argv)
    if args.render:
        saved = json.loads((args.out / "microscaling.json").read_text())
        (args.out / "microscaling.md").write_text(render_markdown(saved))
        return 0
    mx.set_default_device(mx.cpu)
    started = time.perf_counter()
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    report: dict = {
        "command": "python -m tools.quality.microscaling"
        + ("" if argv is None else " " + " ".join(argv)),
        "kvstore": kvstore.__version__,
        "mlx": mx.__version__,
        "blas": "OpenBLAS (LD_PRELOAD)"
        if "openblas" in os.environ.get("LD_PRELOAD", "")
        else "MLX bundled",
        "pycode": evaluate(args.model_dir, args.windows, 1024, 256, log),
    }
    report["seconds"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "microscaling.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "microscaling.md").write_text(render_markdown(report))
    print(render_markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
