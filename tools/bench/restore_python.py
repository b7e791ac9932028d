"""The restore thread's Python on the CUDA page route, measured on any machine.

On the H200 the restore's own thread is the critical path of a 4096-token restore
(``tools/bench/results/gpu/e2e0be6/``): header parse, tensor views, plans and the
gather's segment words run before the first kernel starts. This runs the same code
here with a stand-in transport whose registrations and kernels cost nothing (pages
"locked" at once, each gather a lazy zero array), so each phase's time is the Python
alone. It saves 4096 tokens of a llama-8B-shaped cache (32 layers, 8 KV heads of 128,
16 records) under a storage policy, restores it a few times in this process (headers
parsed afresh each time), and prints each phase's median.

    .venv/bin/python -m tools.bench.restore_python [--policy kv:quant:8:64] [--repetitions 5]
        [--session] [--no-checks] [--profile N] [--shape qwen0.5b] [--tokens 8192] [--cpu-route]

``--no-checks`` leaves the store's checks out (the restoring thread alone: steadier on
two cores), ``--profile N`` adds cProfile's N costliest functions, and ``--cpu-route``
with ``--shape``/``--tokens`` measures the restore as a machine without CUDA runs it
(P1's: host buffers written from the store's pages).

Each phase's wall time and the restoring thread's CPU time in it (``time.thread_time``;
on the H200 that thread's CPU was 18.6 of a 26.4 ms TurboQuant 4/4 restore at
``461576d``: the lossy restores are its Python). TurboQuant's decode is a lazy zero
array of its size too (on the device it is one kernel), so neither figure holds a
decode; ``run_plans`` still evaluates the zeros on this machine's CPU, off that thread
but in its wall time. On a noisy host compare runs of the code before and after a
change alternately.
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import os
import pstats
import statistics
import tempfile
import time
from typing import Any

import mlx.core as mx
import numpy as np

from kvstore.bench.workloads import WORKLOADS, SyntheticKV, attended_arrays
from kvstore.caches import KVCache
from kvstore.codecs import cuda, cuda_pages, gather_tables, one_buffer, plans, record
from kvstore.store import open_store
from kvstore.store.kv import restore
from kvstore.turboquant.quantizer import TurboQuantizer
from tools.bench.gpu.restore_profile import Timeline  # one way of timing a wrapped call

TOKENS = 4096


class FreeTransport:
    """A CUDA transport that does nothing: pages are "locked" at their own addresses,
    and a gather is a lazy zero array of its size (its bytes are not the rows)."""

    def slot(self, nbytes: int) -> cuda.PinnedBuffer:
        return cuda.PinnedBuffer(nbytes, None)

    def to_device(self, slot: cuda.PinnedBuffer, nbytes: int) -> mx.array:
        return mx.array(slot.array[:nbytes].copy())

    def to_host(self, array: mx.array, slot: cuda.PinnedBuffer, offset: int) -> None:
        data = np.asarray(array)
        slot.array[offset : offset + data.nbytes] = data

    def addresses(self, arrays: Any) -> list[int]:
        self._held = [np.asarray(array) for array in arrays]
        return [int(held.ctypes.data) for held in self._held]

    def copy_down(self, address: int, slot: cuda.PinnedBuffer, offset: int, nbytes: int) -> None:
        ctypes.memmove(int(slot.array.ctypes.data) + offset, address, nbytes)

    def register(self, base: int, nbytes: int) -> int:
        return base

    def unregister(self, base: int) -> None:
        pass

    def staging(self, nbytes: int) -> FreeStaging:
        return FreeStaging()

    def gather(self, params: np.ndarray, nbytes: int) -> mx.array:
        return mx.zeros((nbytes,), mx.uint8)

    def gather_many(self, params: np.ndarray, nbytes: Any) -> list[mx.array]:
        return [mx.zeros((n,), mx.uint8) for n in nbytes]

    def assemble(self, params: np.ndarray, buffers: Any, nbytes: int) -> mx.array:
        return mx.zeros((nbytes,), mx.uint8)

    def assemble_many(self, params: np.ndarray, buffers: Any, nbytes: Any) -> list[mx.array]:
        return [mx.zeros((n,), mx.uint8) for n in nbytes]


class FreeStaging:
    """Device memory that costs nothing: copies into it do nothing."""

    address = 0

    def copy(self, offset: int, host: int, nbytes: int) -> None:
        pass

    def copy_now(self, offset: int, host: int, nbytes: int) -> None:
        pass

    def wait(self) -> None:
        pass

    def free(self) -> None:
        pass


#: The phases timed: (module, function) on the restore's path.
PHASES: tuple[tuple[Any, str], ...] = (
    (restore, "_headers"),
    (restore, "_restorable"),
    (restore, "_host_alike"),
    (restore, "_decoded"),
    (restore, "_plans"),
    (restore, "join_runs"),
    (restore, "joined_alike"),
    (restore, "joined_records"),
    (plans, "_row_names"),
    (cuda_pages, "gathered_flat"),
    (gather_tables, "host_layout"),
    (gather_tables, "segment_tables"),
    (cuda_pages._DeviceTable, "params"),
    (cuda_pages, "_group_buffers"),
    (cuda_pages, "views_in"),
    (one_buffer, "views_in"),
    (restore, "transcode_stacked"),
    (restore, "run_plans"),
)


def _free_decode(
    self: TurboQuantizer, codes: mx.array, scales: mx.array, dtype: Any = mx.float32, mu: Any = None
) -> mx.array:
    """TurboQuant's decode as a lazy zero array of its size (on the device: one kernel)."""
    return mx.zeros((*codes.shape[:-1], self.dim), dtype)


def _skip_checks(store: Any) -> None:
    """``store`` (and the stores it wraps) with a ``verify`` that accepts every record."""
    inner = store
    while inner is not None:
        if hasattr(inner, "_verify"):
            inner._verify = lambda view: None
        inner = getattr(inner, "_store", None) or getattr(inner, "_inner", None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default=None, help="a storage policy (default: lossless)")
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument(
        "--session",
        action="store_true",
        help="keep the headers' template between repetitions, as a session's warm-up does",
    )
    parser.add_argument(
        "--no-checks",
        action="store_true",
        help="the store's checks skipped: the restoring thread's Python alone, no thread "
        "beside it parsing or hashing (steadier on a 2-core machine)",
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="also print the N functions the restoring thread spent most time in (cProfile)",
    )
    parser.add_argument(
        "--shape",
        choices=["llama8b", "qwen0.5b"],
        default="llama8b",
        help="the KV's shape (P1's workloads without a sliding window)",
    )
    parser.add_argument("--tokens", type=int, default=TOKENS)
    parser.add_argument(
        "--cpu-route",
        action="store_true",
        help="the restore as on a machine without CUDA (host buffers, a real decode), "
        "not the page route with a free transport",
    )
    args = parser.parse_args(argv)
    # The store is gone when the run ends: each run's is ~1 GiB at 8192 tokens.
    with tempfile.TemporaryDirectory(prefix="restore-python-") as folder:
        return _measured(args, folder)


def _measured(args: argparse.Namespace, folder: str) -> int:
    profile = cProfile.Profile() if args.profile else None
    tokens, layers = args.tokens, WORKLOADS[args.shape].layers
    kv = SyntheticKV(WORKLOADS[args.shape], tokens)
    url = f"lmdb://{folder}/s"
    options = {} if args.policy is None else {"storage_policy": args.policy}
    with open_store(url, map_size=1 << 34, touch_interval=0, **options) as store:
        store.save("ns", list(range(tokens)), kv.ours())
        store.flush()
    previous = cuda.TRANSPORT, cuda_pages._WORKS, cuda_pages._JOINS_WORK
    originals = [(owner, name, getattr(owner, name)) for owner, name in PHASES]
    if not args.cpu_route:
        # The route taken, untried, its joins on the device as on a GPU that passed the try.
        cuda.TRANSPORT, cuda_pages._WORKS, cuda_pages._JOINS_WORK = FreeTransport(), True, True
        originals.append((TurboQuantizer, "decode", TurboQuantizer.decode))
        TurboQuantizer.decode = _free_decode  # type: ignore[method-assign]
    timeline = Timeline()
    for owner, name in PHASES:
        timeline.wrap(owner, name)
    runs: list[tuple[dict[str, float], dict[str, float]]] = []
    try:
        with open_store(url, readonly=True) as store:
            if args.no_checks:
                _skip_checks(store)
            for i in range(args.repetitions + 1):  # the first warms up
                if args.session:  # as a session after its warm-up: the template kept
                    record.forget_parsed_headers(keep_templates=True)
                else:
                    record.forget_parsed_headers()
                timeline.events.clear()
                timeline.cpu.clear()
                match = store.lookup("ns", list(range(tokens + 1)))
                start, cpu = time.perf_counter(), time.thread_time()
                if profile is not None and i:
                    profile.enable()
                caches = store.restore(match, [KVCache() for _ in range(layers)])
                if profile is not None and i:
                    profile.disable()
                # What attention reads (keys would zero a restored cache's unwritten room).
                mx.eval(attended_arrays(caches))
                wall = {name: p["sum_ms"] for name, p in timeline.summary().items()}
                own = {name: p["cpu_ms"] for name, p in timeline.summary().items()}
                wall["restore"] = 1e3 * (time.perf_counter() - start)
                own["restore"] = 1e3 * (time.thread_time() - cpu)
                cuda_pages.settle()
                if i:
                    runs.append((wall, own))
    finally:
        for owner, name, original in originals:
            setattr(owner, name, original)
        cuda.TRANSPORT, cuda_pages._WORKS, cuda_pages._JOINS_WORK = previous
    print(
        f"{args.policy or 'lossless'}: {tokens} tokens of {args.shape} "
        f"{'on the CPU route' if args.cpu_route else 'on the page route with a free transport'}, "
        f"median of {len(runs)} (ms; the restoring thread's CPU beside):"
    )
    for name in ["restore", *(name for _, name in PHASES)]:
        walls = [wall[name] for wall, _ in runs if name in wall]
        cpus = [own[name] for _, own in runs if name in own]
        if walls:
            print(
                f"  {name:18} {statistics.median(walls):8.2f}  cpu {statistics.median(cpus):7.2f}"
            )
    if profile is not None:  # its times are inflated by the profiling: compare shares
        pstats.Stats(profile).sort_stats(
            os.environ.get("RESTORE_PYTHON_SORT", "tottime")
        ).print_stats(args.profile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
