"""P5: time to first token with the prompt's prefix stored, against a full prefill.

The reference model ``kvstore.model`` in its ``small`` config (seeded
weights, float32). A 4096-token prompt; an LMDB store holding its first 4032
tokens (saved by ``generate(..., store=)`` of those tokens). Timed side by
side, interleaved:

* ``ours``: ``generate(prompt, store=...)`` up to its first token: lookup,
  restore of 4032 tokens, prefill of the last 64, first token sampled (the
  store is opened read-only, so the call does not save afterwards);
* ``full prefill``: ``generate(prompt)`` up to its first token, no store.

Bar (BENCHMARKS.md): >= 20x. Model compute depends 10x on the BLAS MLX calls
(BENCHMARKS.md "The BLAS caveat"); the row records which one ran, and the
figure is meant to be measured with OpenBLAS preloaded. ``--quick`` uses a
1024-token prompt with 960 tokens stored (the same 64 left to compute).
"""

from __future__ import annotations

import shutil

import numpy as np

from kvstore.bench.harness import BenchContext, Case, Figure, Ratio, at_least
from kvstore.bench.results import FigureResult

__all__ = ["FIGURE", "PROMPT_TOKENS", "TO_COMPUTE", "MODEL"]

PROMPT_TOKENS = {"full": 4096, "quick": 1024}
#: Prompt tokens the store does not hold: the model computes them either way.
TO_COMPUTE = 64
CHUNK = 512
MODEL = "small"


def run(ctx: BenchContext) -> FigureResult:
    from kvstore.bench.machine import blas_info
    from kvstore.bridge import generate_tokens
    from kvstore.model import build_model
    from kvstore.store import namespace_for_model, open_store

    n = PROMPT_TOKENS["quick" if ctx.quick else "full"]
    stored = n - TO_COMPUTE
    model = build_model(MODEL, seed=0)
    prompt = np.random.default_rng(5).integers(0, model.args.vocab_size, n).tolist()
    namespace = namespace_for_model(model)
    path = ctx.scratch / "p5"
    url = f"lmdb://{path}"
    try:
        with open_store(url, block_size=ctx.sizes.block_tokens) as store:
            ctx.log(f"  storing {stored} tokens of the small model's KV")
            generate_tokens(model, prompt[:stored], store=store, max_tokens=1, chunk_size=CHUNK)
        with open_store(url, readonly=True) as store:

            def ours() -> None:
                _, stats = generate_tokens(
                    model, prompt, store=store, namespace=namespace, max_tokens=1, chunk_size=CHUNK
                )
                if stats.reused_tokens != stored:
                    raise AssertionError(f"[bench] reused {stats.reused_tokens} of {stored}")

            def full() -> None:
                generate_tokens(model, prompt, max_tokens=1, chunk_size=CHUNK)

            blas = blas_info()["mlx"]
            row = ctx.measure(
                f"{MODEL} {n} ({stored} stored)",
                {"model": MODEL, "tokens": n, "stored": stored, "blas": blas},
                [Case("ours", "ours", ours), Case("full prefill", "peer", full)],
                [Ratio("vs full prefill", "ours", "full prefill")],
            )
    finally:
        shutil.rmtree(path, ignore_errors=True)
    notes = [f"BLAS: {blas}"]
    if ctx.quick:
        notes.append(f"--quick: {n}-token prompt; the bar is defined at {PROMPT_TOKENS['full']}")
    return FigureResult([row], notes=notes)


FIGURE = Figure(
    "P5",
    "TTFT with 4032 of 4096 prompt tokens stored vs full prefill, reference model",
    "full prefill of the same prompt (same model, no store)",
    (at_least("vs full prefill", 20.0),),
    run,
)
