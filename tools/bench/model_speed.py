"""Figure: prefill and decode speed of kvstore.model vs mlx-lm, same weights, same cache family.

Both models are built from one config (``small`` by default): ours with
seeded weights, mlx-lm's own ``models/<arch>.py`` with those weights copied
in (the logits are checked equal first). Each family is measured two ways,
interleaved, ``--repeats`` times, ours and mlx-lm's alternating first:

- ``forward``: the same harness loop drives both models (chunked prefill of
  ``--prompt`` tokens, evaluating the caches after each chunk; then
  ``--decode`` greedy single-token steps), so only the model code differs;
  each side uses its own cache classes of the family. The two sides run
  interleaved chunk by chunk (and 8 decode steps by 8), so the load of a
  shared machine falls on both alike.
- ``generate``: each library's own generation loop, ``kvstore.model.generate``
  vs ``mlx_lm.generate.generate_step`` (same chunk size, greedy).

Reported: median tokens/s per side and the median of the per-repeat ratios
ours/mlx-lm (bar: >= 0.9). Raw samples go to ``--json`` (merged under the key
``model_speed``). Model compute depends ~10x on the BLAS (BENCHMARKS.md), so
the BLAS that ran is printed; report figures with OpenBLAS preloaded::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python tools/bench/model_speed.py
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from kvstore.caches import RotatingQuantizedKVCache
from kvstore.model import CachePolicy, Model, build_model, generate_tokens, prefill_chunks

CacheFactory = Callable[[], list[Any]]


def blas_in_use() -> str:
    """Which BLAS this process mapped (MLX's bundled one unless OpenBLAS was preloaded)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return f"unknown ({platform.system()})"
    if "openblas" in maps.lower():
        return "OpenBLAS (preloaded)"
    return "MLX bundled reference BLAS"


def mlx_lm_twin(ours: Model) -> Any:
    """mlx-lm's model of ``ours.config`` carrying ``ours``'s weights."""
    from mlx_lm.utils import MODEL_REMAPPING

    model_type = ours.config["model_type"]
    module = importlib.import_module(f"mlx_lm.models.{MODEL_REMAPPING.get(model_type, model_type)}")
    theirs = module.Model(module.ModelArgs.from_dict(ours.config))
    weights = dict(tree_flatten(ours.parameters()))
    if hasattr(theirs, "sanitize"):
        weights = theirs.sanitize(weights)  # settles tied embeddings (Gemma)
    theirs.load_weights(list(weights.items()), strict=True)
    theirs.set_dtype(ours.model.embed_tokens.weight.dtype)
    mx.eval(theirs.parameters())
    return theirs


def cache_factories(ours: Model, theirs: Any, family: str) -> tuple[CacheFactory, CacheFactory]:
    """(ours, mlx-lm's) cache factories for ``family``: ``plain`` or ``quant-<bits>-<group>``."""
    from mlx_lm.models import cache as lm_cache

    if family == "plain":
        return ours.make_cache, lambda: lm_cache.make_prompt_cache(theirs)
    _, bits, group = family.split("-")
    policy = CachePolicy(kv_bits=int(bits), kv_group_size=int(group))

    def theirs_quant() -> list[Any]:
        # mlx-lm has no windowed affine cache; its model takes ours (it routes on .bits).
        return [
            lm_cache.QuantizedKVCache(group_size=int(group), bits=int(bits))
            if layer["sliding_window"] is None
            else RotatingQuantizedKVCache(layer["sliding_window"], 0, int(group), int(bits))
            for layer in ours.layer_layout()
        ]

    return lambda: ours.make_cache(policy), theirs_quant


#: One side of the comparison: (name, model, cache factory).
Side = tuple[str, Any, CacheFactory]
Rates = dict[str, tuple[float, float]]  # side -> (prefill tok/s, decode tok/s)

DECODE_BLOCK = 8  # decode steps per interleaved slice


def forward_pair(sides: list[Side], tokens: mx.array, n_decode: int, chunk: int) -> Rates:
    """One harness loop drives both models, interleaved slice by slice (each
    prefill chunk, each block of decode steps) so that load on a shared
    machine hits both sides alike; the side going first alternates."""
    order = [(name, model, make()) for name, model, make in sides]
    spent = {name: [0.0, 0.0] for name, _, _ in sides}
    for begin, end in prefill_chunks(0, tokens.size, chunk, None):
        for name, model, caches in order:
            t0 = time.perf_counter()
            model(tokens[None, begin:end], cache=caches)
            mx.eval([c.state for c in caches])
            spent[name][0] += time.perf_counter() - t0
        order.reverse()
    last = {name: tokens[-1:] for name, _, _ in sides}
    for _ in range(0, n_decode, DECODE_BLOCK):
        for name, model, caches in order:
            t0 = time.perf_counter()
            y = last[name]
            for _ in range(DECODE_BLOCK):
                y = mx.argmax(model(y[None], cache=caches)[:, -1, :], axis=-1)
                y.item()
            last[name] = y
            spent[name][1] += time.perf_counter() - t0
        order.reverse()
    n_steps = -(-n_decode // DECODE_BLOCK) * DECODE_BLOCK
    return {name: (tokens.size / p, n_steps / d) for name, (p, d) in spent.items()}


def generate_ours(model: Model, caches: list[Any], tokens: mx.array, n: int, chunk: int):
    _, stats = generate_tokens(
        model, tokens, caches=caches, max_tokens=n + 1, chunk_size=chunk, block_size=None
    )
    return stats.prefill_tps, stats.decode_tps


def generate_mlx_lm(model: Any, caches: list[Any], tokens: mx.array, n: int, chunk: int):
    from mlx_lm.generate import generate_step

    t0 = time.perf_counter()
    steps = generate_step(
        tokens, model, max_tokens=n + 1, prompt_cache=caches, prefill_step_size=chunk
    )
    next(steps)
    t1 = time.perf_counter()
    for _ in steps:
        pass
    return tokens.size / (t1 - t0), n / (time.perf_counter() - t1)


def generate_pair(sides: list[Side], tokens: mx.array, n_decode: int, chunk: int) -> Rates:
    """Each library's own generation loop, one side after the other."""
    loops = {"ours": generate_ours, "mlx-lm": generate_mlx_lm}
    return {
        name: loops[name](model, make(), tokens, n_decode, chunk) for name, model, make in sides
    }


MODES = {"forward": forward_pair, "generate": generate_pair}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="small", help="named config (default: small)")
    parser.add_argument("--families", default="plain,quant-8-64")
    parser.add_argument("--modes", default="forward,generate")
    parser.add_argument("--prompt", type=int, default=4096, help="prompt tokens to prefill")
    parser.add_argument("--decode", type=int, default=64, help="decode steps timed")
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk size")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default="bench-results.json")
    args = parser.parse_args(argv)
    mx.set_default_device(mx.cpu)

    ours = build_model(args.config, seed=0)
    theirs = mlx_lm_twin(ours)
    vocab = ours.args.vocab_size
    tokens = mx.random.randint(0, vocab, (args.prompt,), key=mx.random.key(1)).astype(mx.int32)
    probe = tokens[None, :64]
    gap = mx.abs(ours(probe) - theirs(probe)).max().item()
    if gap > 1e-4:
        print(f"weights differ: max |logit gap| {gap}", file=sys.stderr)
        return 1

    blas = blas_in_use()
    print(
        f"config={args.config} prompt={args.prompt} decode={args.decode} chunk={args.chunk} "
        f"repeats={args.repeats} blas={blas} mlx={mx.__version__}"
    )
    samples: list[dict[str, Any]] = []
    summary: list[str] = []
    print(f"{'mode':<9}{'family':<12}{'side':<8}{'prefill tok/s':>15}{'decode tok/s':>14}")
    for mode in args.modes.split(","):
        run_pair = MODES[mode]
        for family in args.families.split(","):
            make_ours, make_theirs = cache_factories(ours, theirs, family)
            sides: list[Side] = [("ours", ours, make_ours), ("mlx-lm", theirs, make_theirs)]
            run_pair(sides, tokens[:256], DECODE_BLOCK, args.chunk)  # warm-up: compile, allocate
            rates: dict[str, list[tuple[float, float]]] = {"ours": [], "mlx-lm": []}
            for rep in range(args.repeats):
                for side, (prefill_tps, decode_tps) in run_pair(
                    sides if rep % 2 == 0 else sides[::-1], tokens, args.decode, args.chunk
                ).items():
                    rates[side].append((prefill_tps, decode_tps))
                    samples.append(
                        dict(
                            mode=mode,
                            family=family,
                            side=side,
                            repeat=rep,
                            prefill_tps=prefill_tps,
                            decode_tps=decode_tps,
                        )
                    )
            for side in ("ours", "mlx-lm"):
                med_p = statistics.median(r[0] for r in rates[side])
                med_d = statistics.median(r[1] for r in rates[side])
                print(f"{mode:<9}{family:<12}{side:<8}{med_p:>15.1f}{med_d:>14.1f}")
            ratio_p = statistics.median(o[0] / t[0] for o, t in zip(rates["ours"], rates["mlx-lm"]))
            ratio_d = statistics.median(o[1] / t[1] for o, t in zip(rates["ours"], rates["mlx-lm"]))
            print(f"{mode:<9}{family:<12}{'ratio':<8}{ratio_p:>15.3f}{ratio_d:>14.3f}")
            summary.append(f"{mode}/{family} prefill {ratio_p:.2f}x decode {ratio_d:.2f}x")

    out = Path(args.json)
    results = json.loads(out.read_text()) if out.is_file() else {}
    results["model_speed"] = dict(
        config=args.config,
        prompt=args.prompt,
        decode=args.decode,
        chunk=args.chunk,
        repeats=args.repeats,
        blas=blas,
        mlx=mx.__version__,
        samples=samples,
    )
    out.write_text(json.dumps(results, indent=1))
    print(
        f"model speed, ours/mlx-lm (median of paired ratios, bar 0.9; {blas}): "
        + "; ".join(summary)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
