"""The restoring thread's CPU time on the CUDA route, measured on a machine without a GPU.

    python -m tools.bench.route_cpu [--policy kv:turboquant:4:4] [--tokens 4096] [--repeats 15]

On the H200 a lossy restore is mostly its own thread's Python (18.6 of a 26.4 ms
TurboQuant 4/4 restore at 461576d: ``tools/bench/results/gpu/461576d/``), and that
Python is the same code on any machine. Here the route runs as on a GPU -- pages
"locked", records joined by a "gather", decoded, joined into the caches -- with a
transport that does no byte work (every kernel's output is zeros, the page locking
and the copies are bookkeeping; ``TurboQuantizer.decode`` lazy zeros), so what the
restoring thread spends is its Python and MLX's graph building alone. Prints that
thread's CPU time per restore (``time.thread_time``, median of ``--repeats``) and its
phases': a change to the route's Python is measured so, before and after, here.

Only a measurement: the bytes restored are zeros.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

#: (module, function) pairs whose CPU time is reported (each call on the restoring thread).
PHASES = (
    ("kvstore.store.kv.restore", "_headers"),
    ("kvstore.store.kv.restore", "_restorable"),
    ("kvstore.store.kv.restore", "_decoded"),
    ("kvstore.store.kv.restore", "_plans"),
    ("kvstore.store.kv.restore", "join_runs"),
    ("kvstore.store.kv.restore", "transcode_stacked"),
    ("kvstore.store.kv.restore", "run_plans"),
    ("kvstore.codecs.plans", "_row_names"),
    ("kvstore.codecs.cuda_pages", "gathered_flat"),
    ("kvstore.codecs.cuda_pages", "_segment_tables"),
    ("kvstore.codecs.cuda_pages", "views_in"),
)


class _Staging:
    """Device memory that holds nothing: its copies are bookkeeping."""

    address = 1 << 44

    def copy(self, offset: int, host: int, nbytes: int) -> None:
        pass

    def wait(self) -> None:
        pass

    def free(self) -> None:
        pass


class ZeroTransport:
    """A CUDA transport whose kernels make zeros and whose page locks are bookkeeping."""

    def slot(self, nbytes: int) -> Any:
        from kvstore.codecs import cuda

        return cuda.PinnedBuffer(nbytes, None)

    def to_device(self, slot: Any, nbytes: int) -> mx.array:
        return mx.zeros((nbytes,), mx.uint8)

    def to_host(self, array: mx.array, slot: Any, offset: int) -> None:
        pass

    def register(self, base: int, nbytes: int) -> int:
        return base

    def unregister(self, base: int) -> None:
        pass

    def staging(self, nbytes: int) -> _Staging:
        return _Staging()

    def gather(self, params: np.ndarray, nbytes: int) -> mx.array:
        return mx.zeros((nbytes,), mx.uint8)

    def gather_many(self, params: np.ndarray, nbytes: list[int]) -> list[mx.array]:
        return [mx.zeros((n,), mx.uint8) for n in nbytes]

    def assemble(self, params: np.ndarray, buffers: Any, nbytes: int) -> mx.array:
        return mx.zeros((nbytes,), mx.uint8)

    def assemble_many(self, params: np.ndarray, buffers: Any, nbytes: list[int]) -> list[mx.array]:
        return [mx.zeros((n,), mx.uint8) for n in nbytes]


def _route_on_zeros() -> None:
    """This process's CUDA route set up on :class:`ZeroTransport`, its trial passed."""
    from kvstore.codecs import cuda, cuda_pages
    from kvstore.turboquant.quantizer import TurboQuantizer

    cuda.TRANSPORT = ZeroTransport()  # type: ignore[assignment]
    cuda_pages.GATHER_MIN_BYTES = 0
    cuda_pages._WORKS, cuda_pages._JOINS_WORK = True, True

    def decode(
        self: Any, codes: mx.array, scales: mx.array, dtype: Any = mx.float32, mu: Any = None
    ) -> mx.array:
        return mx.zeros((*codes.shape[:-1], self.dim), dtype)

    TurboQuantizer.decode = decode  # type: ignore[method-assign]


def _timed(times: dict[str, list[float]], owner: Any, name: str) -> None:
    real: Callable[..., Any] = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        try:
            return real(*args, **kwargs)
        finally:
            times[name].append(time.thread_time() - start)

    setattr(owner, name, timed)


def main() -> int:
    import importlib

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="kv:turboquant:4:4")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    from kvstore.bench.workloads import KVShape, SyntheticKV
    from kvstore.caches import KVCache
    from kvstore.codecs import cuda_pages
    from kvstore.store import open_store

    kv = SyntheticKV(KVShape("llama8b", layers=args.layers, kv_heads=8, head_dim=128), args.tokens)
    caches = kv.ours()
    options: dict[str, Any] = {"map_size": 1 << 34, "touch_interval": 0}
    if args.policy != "lossless":
        options["storage_policy"] = args.policy
    prompt = list(range(args.tokens + 1))
    with tempfile.TemporaryDirectory(prefix="route-cpu-") as scratch:
        with open_store(f"lmdb://{scratch}/s", **options) as store:
            store.save("ns", prompt[:-1], caches)
            store.flush()
        del caches, kv
        _route_on_zeros()
        times: dict[str, list[float]] = defaultdict(list)
        for module, name in PHASES:
            _timed(times, importlib.import_module(module), name)
        rows: list[dict[str, float]] = []
        with open_store(f"lmdb://{scratch}/s", readonly=True) as store:
            for i in range(args.repeats + 2):  # the first two warm MLX and the parses
                times.clear()
                match = store.lookup("ns", prompt)
                start = time.thread_time()
                restored = store.restore(match, [KVCache() for _ in range(args.layers)])
                mx.eval([c.keys for c in restored])
                spent = time.thread_time() - start
                assert restored[0].offset == args.tokens, restored[0].offset
                cuda_pages.settle()
                if i >= 2:
                    rows.append({"restore": spent, **{k: sum(v) for k, v in times.items()}})
    print(
        f"{args.policy}, {args.tokens} tokens, {args.layers} layers: the restoring thread's "
        f"CPU ms, median of {len(rows)}"
    )
    for key in rows[0]:
        print(f"  {key:18} {1e3 * statistics.median(r.get(key, 0.0) for r in rows):7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
