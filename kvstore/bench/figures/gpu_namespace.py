"""G4: the namespace of the llama-8B model, in memory and from a model directory.

* ``in memory``: ``namespace_for_model(model)`` of the 8B model object (16 GB of
  bfloat16 weights on the device), its per-object memo cleared before each
  call: every call hashes every parameter (:mod:`kvstore.bridge.digests`);
* ``directory, cold``: ``namespace_for_model(directory)`` of a model directory
  with no digest cache (the weight files hashed);
* ``directory, cached``: the same with the digests cached on disk (a restart).

The directory is the 8B's shape cut to 2 layers (its files are what the cost
of a cached fingerprint depends on: a few ``stat`` calls and the digest cache;
writing 16 GB of weights would only cost the device time). The first call of
a process is reported too (it loads the digest kernel). Bars: in memory <= 1 s;
cached directory <= 50 ms.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from typing import Any, cast

from kvstore.bench.figures import gpu_common as G
from kvstore.bench.harness import BenchContext, Figure, at_most
from kvstore.bench.results import FigureResult, Row
from kvstore.cache_dir import CACHE_DIR

__all__ = ["G4"]

IN_MEMORY, COLD, CACHED = "in memory", "directory, cold", "directory, cached"


def _timed(fn: Any, repeats: int) -> list[float]:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def _in_memory(ctx: BenchContext, config: dict[str, Any]) -> tuple[float, list[float], int]:
    """(first call, repeated calls, parameter bytes) of the model object's namespace."""
    from mlx.utils import tree_flatten

    from kvstore.bridge import namespace as N

    model = G.build(config)
    leaves = cast(list[tuple[str, Any]], tree_flatten(model.parameters()))
    params = sum(int(v.nbytes) for _, v in leaves)

    def in_memory() -> None:
        N._FINGERPRINTS.clear()  # the per-object memo: every call hashes every parameter
        N.namespace_for_model(model)

    start = time.perf_counter()
    in_memory()
    first = time.perf_counter() - start
    return first, _timed(in_memory, ctx.repeats), params


def run(ctx: BenchContext) -> FigureResult:
    if not (ctx.quick or G.on_gpu()):
        return FigureResult(pending=G.NEEDS_GPU)
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from kvstore.bridge import namespace as N
    from kvstore.bridge.fingerprint import digest_cache_path

    config = G.model_config(ctx)
    first, memory, params = _in_memory(ctx, config)
    mx.clear_cache()

    directory = ctx.scratch / "g4-model"
    cache_dir = ctx.scratch / "g4-digests"
    small = {**config, "num_hidden_layers": min(2, config["num_hidden_layers"])}
    model = G.build(small)
    directory.mkdir(parents=True, exist_ok=True)
    import json

    (directory / "config.json").write_text(json.dumps(small))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(directory / "model.safetensors"), weights)
    files = sum(p.stat().st_size for p in directory.iterdir())
    del model, weights
    previous = os.environ.get(CACHE_DIR)
    os.environ[CACHE_DIR] = str(cache_dir)
    try:

        def cold() -> None:
            # The digests only: the folder also keeps compiled CUDA kernels.
            digest_cache_path().unlink(missing_ok=True)
            N.namespace_for_model(directory)

        cold_samples = _timed(cold, ctx.repeats)
        cached = _timed(lambda: N.namespace_for_model(directory), ctx.repeats)
    finally:
        if previous is None:
            os.environ.pop(CACHE_DIR, None)
        else:
            os.environ[CACHE_DIR] = previous
        shutil.rmtree(directory, ignore_errors=True)
        shutil.rmtree(cache_dir, ignore_errors=True)
    samples = {IN_MEMORY: memory, COLD: cold_samples, CACHED: cached}
    values = {
        "in memory s": statistics.median(memory),
        "in memory first call s": first,
        "in memory GB/s": params / statistics.median(memory) / 1e9,
        "directory cold s": statistics.median(cold_samples),
        "directory cached ms": statistics.median(cached) * 1e3,
    }
    row = Row(
        "llama8b",
        {"params_gib": params / (1 << 30), "directory_gib": files / (1 << 30)},
        samples,
        {k: "ours" for k in samples},
        values=values,
    )
    notes = [f"the directory is the model cut to {small['num_hidden_layers']} layers"]
    return FigureResult([row], notes=notes)


G4 = Figure(
    "G4",
    "namespace of the llama-8B model: in memory; of its directory (cold, cached digests)",
    "- (absolute)",
    (at_most("in memory s", 1.0, unit=" s"), at_most("directory cached ms", 50.0, unit=" ms")),
    run,
)
