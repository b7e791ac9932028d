"""G3: durable saves against mlx-lm's ``save_prompt_cache``, and how long a save holds the
generating thread.

Per prompt length (4096 and 16384 tokens; the llama-8B caches the cold prefill
left on the device), side by side, interleaved:

* ``ours (durable)``: ``store.save_behind`` of the prompt into an LMDB store (a
  prefix it does not hold), then ``store.flush()``, which returns once the
  commit is synced (``durability="group"``, the default): the whole save;
* ``mlx-lm save``: ``save_prompt_cache`` of the same KV (mlx-lm's own caches,
  made fresh on the device before each call, as generation leaves them) to a
  new file, not synced;
* ``mlx-lm save+fsync``: the same, then ``fsync``: what the host's disk makes a
  durable save cost (context for the bar, as in P2, not the bar);
* at 4096 tokens, the same durable save under the storage policies
  ``kv:quant:8:64`` and ``kv:turboquant:4:4`` (encoded on the device).

Values: ``held ms``, the longest time ``save_behind`` kept the caller (the
generating thread) over the repetitions; ``step ms`` and ``step with save ms``,
one decode step of the model alone and right after a hand-off (the writer
then busy), so what a save costs the next token shows, and ``step during save
ms`` / ``longest step during save ms``, the median and longest of every step
taken while the writer commits (``steps during save`` of them); ``tq/lossless``, the
TurboQuant policy's save over the lossless one. Bars (BENCHMARKS.md, issue 13):
durable save >= 1.0x mlx-lm's; held <= 5 ms; a TurboQuant-policy save <= 1.5x a
lossless one.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from kvstore.bench.figures import gpu_common as G
from kvstore.bench.figures.common import MIB
from kvstore.bench.harness import BenchContext, Case, Figure, Ratio, at_least, at_most
from kvstore.bench.results import FigureResult
from kvstore.files import fsync_path

__all__ = ["G3"]

OURS, PEER, PEER_SYNCED = "ours (durable)", "mlx-lm save", "mlx-lm save+fsync"
POLICY_CASES = {"kv:quant:8:64": "ours q8 (durable)", "kv:turboquant:4:4": "ours tq4/4 (durable)"}
HELD = "held ms"


def _mlx_lm_caches(caches: list[Any], n: int) -> list[Any]:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    out = []
    for cache in caches:
        mine = KVCache()
        mine.update_and_fetch(cache.keys[:, :, :n] * 1, cache.values[:, :, :n] * 1)
        out.append(mine)
    mx.eval([c.keys for c in out])
    return out


def _save_case(setup: G.GpuSetup, name: str, policy: str, held: list[float]) -> tuple[Case, Any]:
    from kvstore.store import open_store

    kw: dict[str, Any] = {"map_size": 3 * setup.kv_bytes + (256 << 20)}
    if policy != "lossless":
        kw["storage_policy"] = policy
    slug = name.replace(" ", "-").replace("(", "").replace(")", "").replace("/", "")
    store = open_store(f"lmdb://{setup.directory / ('g3-' + slug)}", touch_interval=0, **kw)
    assert setup.caches is not None and setup.prompt is not None

    caches = setup.caches

    def run() -> None:
        handle = store.save_behind(setup.namespace, setup.prompt, caches)
        held.append(handle.held_s)
        store.flush()
        if not handle.result().written:
            raise AssertionError("[bench] a new save found every block stored")

    def reset() -> None:
        store.delete(setup.namespace)
        store.flush()

    return Case(name, "ours", run, reset=reset), store


def _peer_case(setup: G.GpuSetup, path: Any, save_prompt_cache: Any, synced: bool) -> Case:
    """mlx-lm's save of the same KV, into caches made fresh on the device before each call;
    ``synced``: then ``fsync`` (:data:`PEER_SYNCED`)."""
    state: dict[str, Any] = {}
    assert setup.caches is not None

    def peer() -> None:
        save_prompt_cache(str(path), state["caches"])
        if synced:
            fsync_path(path)

    def fresh() -> None:
        path.unlink(missing_ok=True)
        state["caches"] = _mlx_lm_caches(setup.caches, setup.tokens)  # type: ignore[arg-type]

    return Case(PEER_SYNCED if synced else PEER, "peer", peer, reset=fresh)


def _steps(setup: G.GpuSetup, store: Any) -> dict[str, float]:
    """A decode step alone, right after a hand-off (medians of the repetitions), and
    every step a generating thread takes while the writer commits the save (their
    median and longest over the repetitions): what a save behind costs the tokens it
    overlaps (the writer's Python holds the GIL up to a switch interval at a time)."""
    import mlx.core as mx

    model, caches = setup.model, setup.caches
    assert caches is not None and setup.prompt is not None
    token = mx.array([[int(setup.prompt[-1])]], mx.int32)

    def step() -> float:
        t = time.perf_counter()
        mx.eval(model(token, caches))
        elapsed = time.perf_counter() - t
        for cache in caches:
            cache.trim(1)
        return elapsed

    step()
    alone, loaded, during = [], [], []
    for _ in range(setup.ctx.repeats):
        alone.append(step())
        store.delete(setup.namespace)
        store.flush()
        handle = store.save_behind(setup.namespace, setup.prompt, caches)
        loaded.append(step())
        while not handle.done():
            during.append(step())
        store.flush()
    return {
        "step ms": statistics.median(alone) * 1e3,
        "step with save ms": statistics.median(loaded) * 1e3,
        "steps during save": float(len(during)),
        "step during save ms": statistics.median(during or loaded) * 1e3,
        "longest step during save ms": max(during or loaded) * 1e3,
    }


def run(ctx: BenchContext) -> FigureResult:
    if not (ctx.quick or G.on_gpu()):
        return FigureResult(pending=G.NEEDS_GPU)
    from mlx_lm.models.cache import save_prompt_cache

    rows = []
    for tokens in sorted(G.prompt_lengths(ctx)):
        setup = G.setup_for(ctx, tokens)
        setup.prepare()
        assert setup.caches is not None
        helds: dict[str, list[float]] = {OURS: []}
        case, store = _save_case(setup, OURS, "lossless", helds[OURS])
        cases, stores = [case], [store]
        if tokens == min(G.prompt_lengths(ctx)):
            for policy, name in POLICY_CASES.items():
                helds[name] = []
                case, other = _save_case(setup, name, policy, helds[name])
                cases.append(case)
                stores.append(other)
        path = setup.directory / "g3-mlx-lm.safetensors"
        cases += [_peer_case(setup, path, save_prompt_cache, synced) for synced in (False, True)]
        ratios = [
            Ratio(f"{c.name} vs mlx-lm save", c.name, PEER) for c in cases if c.role == "ours"
        ]
        ratios.append(Ratio(f"{OURS} vs mlx-lm save+fsync", OURS, PEER_SYNCED))
        row = ctx.measure(
            f"llama8b {tokens}", {"tokens": tokens, "mib": setup.kv_bytes / MIB}, cases, ratios
        )
        row.values[HELD] = max(helds[OURS]) * 1e3
        for name, held in helds.items():
            row.values[f"{name} held ms"] = max(held) * 1e3
        tq = POLICY_CASES["kv:turboquant:4:4"]
        if tq in row.samples:  # the policies are saved at the shortest length only
            row.values["tq/lossless"] = statistics.median(row.samples[tq]) / statistics.median(
                row.samples[OURS]
            )
        row.values.update(_steps(setup, stores[0]))
        row.values["durable save vs mlx-lm save"] = row.ratios[f"{OURS} vs mlx-lm save"].median
        for store in stores:
            store.close()
        path.unlink(missing_ok=True)
        rows.append(row)
    G.release_all()
    notes = ["held: the longest hand-off over the repetitions (save_behind's return)"]
    if ctx.quick:
        notes.append("--quick: a tiny model and 300 tokens (a smoke run; the bars are for a GPU)")
    return FigureResult(rows, notes=notes)


G3 = Figure(
    "G3",
    "durable save (write-behind, synced) and the time it holds the generating thread",
    "mlx-lm save_prompt_cache of the same KV (not synced; and, for context, the same plus fsync)",
    (
        at_least("durable save vs mlx-lm save", 1.0),
        at_most(HELD, 5.0, unit=" ms"),
        at_most("tq/lossless", 1.5),
    ),
    run,
)
