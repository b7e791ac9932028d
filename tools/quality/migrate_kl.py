"""Migration fidelity end to end: a real model's store, migrated, restored, continued.

For pycode-lm (a trained byte-level Llama, float32 per BENCHMARKS.md's KL
protocol) and each of ``--windows`` held-out windows:

1. prefill 1024 held-out bytes with plain caches and ``store.save`` them into
   a lossless LMDB store (the source);
2. ``kvstore.store.maintenance.migrate.migrate`` the source into one store per target
   family (``kv:quant:8:64``, ``kv:quant:4:64``, ``kv:turboquant:4:4``,
   ``kv:turboquant:3:3``...), reporting the migration's own measured error;
3. from each store, ``lookup`` + ``restore`` the prefix into fresh plain caches
   (the store decodes into the live family) and feed the next 256 bytes as one
   chunk;
4. next-token KL(source ‖ migrated) per position, top-1 agreement, and bytes.

The lossless source restores bit-exactly, so its row is the control (KL 0).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python -m tools.quality.migrate_kl [--windows 4]

Writes ``tools/quality/results/migrate_kl.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

from kvstore.model import load_model
from kvstore.store import namespace_for_model, open_store
from kvstore.store.maintenance.migrate import migrate
from tools.quality.metrics import kl_divergence

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT.parent / "shared" / "fixtures" / "pycode-lm"
RESULTS = Path(__file__).resolve().parent / "results"
TARGETS = ("kv:quant:8:64", "kv:quant:4:64", "kv:turboquant:4:4", "kv:turboquant:3:3")
PREFIX, CONTINUATION = 1024, 256


def _log_softmax(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def continue_from_store(model, url: str, namespace: str, tokens: np.ndarray) -> mx.array:
    """Log-probabilities of the continuation after restoring the prefix from ``url``."""
    with open_store(url) as store:
        match = store.lookup(namespace, tokens)
        caches = store.restore(match, model.make_cache())
    if caches[0].offset != PREFIX:
        raise RuntimeError(f"[migrate_kl] {url} restored {caches[0].offset} of {PREFIX} tokens")
    chunk = mx.array(tokens[PREFIX:][None])
    return _log_softmax(model(chunk, cache=caches)[0].astype(mx.float32))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--model", type=Path, default=MODEL_DIR)
    args = parser.parse_args(argv)

    model, _ = load_model(args.model, dtype=mx.float32)
    namespace = namespace_for_model(model)
    data = np.frombuffer((args.model / "heldout.txt").read_bytes(), np.uint8).astype(np.int32)
    starts = np.linspace(0, len(data) - PREFIX - CONTINUATION, args.windows).astype(int)
    windows = [data[s : s + PREFIX + CONTINUATION] for s in starts]

    with tempfile.TemporaryDirectory() as tmp:
        source = f"lmdb://{tmp}/source"
        with open_store(source) as store:
            for tokens in windows:
                caches = model.make_cache()
                mx.eval(model(mx.array(tokens[None, :PREFIX]), cache=caches))
                store.save(namespace, tokens[:PREFIX], caches)
        reports = {"lossless (source)": None}
        urls = {"lossless (source)": source}
        for target in TARGETS:
            urls[target] = f"lmdb://{tmp}/{target.replace(':', '-')}"
            reports[target] = migrate(source, urls[target], to=target)

        reference = [continue_from_store(model, source, namespace, t) for t in windows]
        rows = []
        for name, url in urls.items():
            kls, agree = [], []
            for tokens, ref in zip(windows, reference, strict=True):
                got = continue_from_store(model, url, namespace, tokens)
                kls.append(kl_divergence(ref, got))
                agree.append(np.array(mx.argmax(ref, -1) == mx.argmax(got, -1)))
            kl, top1 = np.concatenate(kls), np.concatenate(agree)
            report = reports[name]
            errors = [] if report is None else report.errors
            rows.append(
                {
                    "family": name,
                    "bytes": None if report is None else report.bytes_after,
                    "bytes_before": None if report is None else report.bytes_before,
                    "relmse_keys": max((e.mean_keys for e in errors), default=0.0),
                    "relmse_values": max((e.mean_values for e in errors), default=0.0),
                    "kl_mean": float(kl.mean()),
                    "kl_p95": float(np.percentile(kl, 95)),
                    "top1": float(top1.mean()),
                }
            )
    write(rows, args.windows)
    return 0


def write(rows: list[dict], windows: int) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "migrate_kl.json").write_text(
        json.dumps({"windows": windows, "rows": rows}, indent=1)
    )
    lines = [
        "# Migration fidelity: pycode-lm store migrated, restored, continued",
        "",
        "Generated by `python -m tools.quality.migrate_kl` "
        f"({windows} held-out windows: prefill {PREFIX} bytes, save, migrate, restore into "
        f"plain caches, continue {CONTINUATION} bytes as one chunk; float32 model). "
        "relMSE: the migration's own report (worst layer, mean over vectors). "
        'KL(source ‖ migrated) per position of the continuation. Protocol "store/reload": '
        "only the restored prefix went through the stored family; the continuation's own "
        "K/V are plain (`quality.md` runs the continuation through the family too, hence its "
        "larger KL). The source holds float32 rows (the model runs in float32), so bytes are "
        "relative to float32.",
        "",
        "| stored family | bytes (× source) | relMSE K | relMSE V "
        "| next-token KL mean | KL p95 | top-1 |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        ratio = "1.000" if r["bytes"] is None else f"{r['bytes'] / r['bytes_before']:.3f}"
        lines.append(
            f"| `{r['family']}` | {ratio} | {r['relmse_keys']:.5f} | {r['relmse_values']:.5f} "
            f"| {r['kl_mean']:.4f} | {r['kl_p95']:.4f} | {100 * r['top1']:.2f}% |"
        )
    (RESULTS / "migrate_kl.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(main())
