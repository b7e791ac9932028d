"""Which part of a save behind stalls the decode steps it overlaps.

    python3 tools/bench/gpu/save_stall.py [--tokens 4096] [--saves 4] [--quick]

G3 on an H100 (``results/gpu/0133522-h100/``): the steps a generating thread took while
the writer committed a save had a step's usual time at the median (9.4 ms, alone 9.4),
but the longest took 43 ms at 4096 tokens and 193 ms at 16384: about the time the whole
save's bytes take over PCIe, and with the GIL's switch interval at 0.5 ms the same (42.5):
not the writer's Python. Here every step is timed with its start, and the writer's parts
where they run: the arena's pinned buffer (``cuda.new_buffer``), the payloads built on
the device and downloaded, the records hashed, LMDB's puts and commits. Each step over
twice the median is printed with the parts it overlaps, and each save's parts summed.

With ``--churn``, before each save the device memory is churned as G3's sequence
churns it: mlx-lm caches made fresh from the same rows (``* 1``) and saved with
``save_prompt_cache`` (G3's peer), then dropped; MLX's active, cached and peak memory
are printed before each save. (At 16384 tokens a save under ``auto`` stalled one step
176-251 ms in G3 -- even with nothing stacked, runs of one record -- and not here
without it: ``results/gpu/4ac01ae-h100/``.) Python's garbage collections are parts too
(``gc gen0``..``gc gen2``): the ``auto`` path keeps each cut piece until the save ends.

Without CUDA (``--quick``: a tiny model) the same runs on the CPU's path.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: (part, thread name, start, end) of each timed call, in perf_counter seconds.
SPANS: list[tuple[str, str, float, float]] = []
_LOCK = threading.Lock()


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            with _LOCK:
                SPANS.append((name, threading.current_thread().name, start, time.perf_counter()))

    return wrapper


def _gc_spans() -> None:
    """Each of Python's garbage collections as a part (``gc gen2``: a full one), on
    whichever thread ran it: a collection holds the GIL every other thread waits for."""
    import gc

    began: dict[int, float] = {}

    def callback(phase: str, info: dict[str, int]) -> None:
        me = threading.get_ident()
        if phase == "start":
            began[me] = time.perf_counter()
        elif me in began:
            with _LOCK:
                SPANS.append(
                    (
                        f"gc gen{info['generation']}",
                        threading.current_thread().name,
                        began.pop(me),
                        time.perf_counter(),
                    )
                )

    gc.callbacks.append(callback)


def instrument() -> None:
    """Wrap the writer's parts where the library looks them up."""
    _gc_spans()
    from kvstore.codecs import arena, cuda
    from kvstore.store.engines import lmdb as lmdb_engine
    from kvstore.store.kv import save

    cuda.new_buffer = timed("pinned buffer", cuda.new_buffer)
    cuda.download = timed("download", cuda.download)
    arena.device_payload = timed("device payload", arena.device_payload)
    arena.write_record = timed("hash + head", arena.write_record)
    save.write_records = timed("write_records", save.write_records)
    # write_records' own parts: its evaluations (the pieces; on the copy route the
    # payloads, through download_later's addresses), the payloads stacked, the blocks cut.
    arena.mx = _TimedEval(arena.mx, "eval (pieces)")
    cuda.download_later = timed("download_later (payloads evaluated)", cuda.download_later)
    save.stacked_payloads = timed("stacked payloads (graph)", save.stacked_payloads)
    save.plan_record = timed("plan", save.plan_record)
    from kvstore.store.kv import writer

    writer.HandedOff.layers = timed("cut layers", writer.HandedOff.layers)  # type: ignore[method-assign]
    view = lmdb_engine._LMDBView
    view.put = timed("lmdb put", view.put)  # type: ignore[method-assign]
    backend = lmdb_engine.LMDBBackend
    backend._commit = timed("lmdb commit", backend._commit)  # type: ignore[method-assign]


class _TimedEval:
    """A stand-in for a module's ``mx`` whose ``eval`` is timed (the rest passes through)."""

    def __init__(self, mx: Any, name: str) -> None:
        self._mx = mx
        self.eval = timed(name, mx.eval)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._mx, name)


def churn(caches: list[Any], tokens: int, path: Path) -> None:
    """What G3's peer case does between our saves: fresh mlx-lm caches of the same rows
    (new device buffers), saved by ``save_prompt_cache``, dropped."""
    from mlx_lm.models.cache import save_prompt_cache

    from kvstore.bench.figures.gpu_save import _mlx_lm_caches  # G3's own

    save_prompt_cache(str(path), _mlx_lm_caches(caches, tokens))
    path.unlink(missing_ok=True)


def memory_line(mx: Any) -> str:
    mib = 1 << 20
    return (
        f"    MLX memory: active {mx.get_active_memory() / mib:.0f} MiB, cached "
        f"{mx.get_cache_memory() / mib:.0f}, peak {mx.get_peak_memory() / mib:.0f}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--churn", action="store_true", help="G3's peer saves between saves")
    args = parser.parse_args()

    import mlx.core as mx

    from kvstore.bench.figures import gpu_common as G
    from kvstore.store import open_store

    instrument()
    tokens = 300 if args.quick else args.tokens
    model = G.build(G.TINY if args.quick else G.LLAMA8B)
    caches = model.make_cache()
    prompt = mx.array(list(range(1, tokens + 1)), mx.int32)[None]
    G.prefill(model, prompt, caches)
    token = mx.array([[7]], mx.int32)

    def step() -> tuple[float, float]:
        start = time.perf_counter()
        mx.eval(model(token, caches))
        end = time.perf_counter()
        for cache in caches:
            cache.trim(1)
        return start, end

    for _ in range(3):
        step()
    alone = [b - a for a, b in (step() for _ in range(10))]
    usual = statistics.median(alone)
    print(f"{mx.default_device()}: {tokens} tokens; a step alone {usual * 1e3:.2f} ms (median)")
    with tempfile.TemporaryDirectory() as tmp:
        store = open_store(
            f"lmdb://{Path(tmp) / 'store'}",
            touch_interval=0,
            map_size=4 * sum(c.nbytes for c in caches) + (256 << 20),
        )
        namespace = "stall"
        toks = list(range(1, tokens + 1))
        for n in range(args.saves):
            store.delete(namespace)
            store.flush()
            if args.churn:
                churn(caches, tokens, Path(tmp) / "peer.safetensors")
                print(memory_line(mx))
            SPANS.clear()
            began = time.perf_counter()
            handle = store.save_behind(namespace, toks, caches)
            handed = time.perf_counter()
            steps = [step()]
            while not handle.done():
                steps.append(step())
            store.flush()
            ended = time.perf_counter()
            durations = [b - a for a, b in steps]
            print(
                f"save {n + 1}: hand-off {(handed - began) * 1e3:.1f} ms, done after "
                f"{(ended - began) * 1e3:.0f} ms; {len(steps)} steps, median "
                f"{statistics.median(durations) * 1e3:.2f} ms, longest {max(durations) * 1e3:.1f}"
            )
            spans = list(SPANS)
            totals: dict[str, list[float]] = {}
            for name, _, a, b in spans:
                totals.setdefault(name, []).append(b - a)
            for name, values in totals.items():
                print(
                    f"    {name}: {len(values)} calls, {sum(values) * 1e3:.1f} ms in all, "
                    f"longest {max(values) * 1e3:.1f}"
                )
            for a, b in steps:
                if b - a > 2 * usual and b - a > usual + 2e-3:
                    over = [
                        f"{name} [{(max(sa, a) - a) * 1e3:.1f}-{(min(sb, b) - a) * 1e3:.1f}]"
                        for name, _, sa, sb in spans
                        if sa < b and sb > a
                    ]
                    print(
                        f"    step at +{(a - began) * 1e3:.0f} ms took {(b - a) * 1e3:.1f} ms; "
                        f"overlapping (ms into the step): {', '.join(over) or 'nothing timed'}"
                    )
        store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
