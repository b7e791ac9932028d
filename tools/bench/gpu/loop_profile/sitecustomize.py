"""Where a server's generating loop spends a streamed token: loaded by a server process
when this folder leads its PYTHONPATH and ``KVSTORE_BENCH_LOOP_PROFILE`` names a folder.

``tools/bench/gpu/next.sh loopprofile`` runs ``serve_ttft.py`` with it (stock
``mlx_lm.server`` and ``kvstore serve`` alike): every ``BatchGenerator.next`` call's
start and end (``perf_counter``), how many prompt and generated responses it returned, and
(with ``KVSTORE_BENCH_LOOP_PROFILE_CPROFILE=1``) a ``cProfile`` of the whole generating
thread from its first ``next`` on, the server loop between calls included (from Python
3.12 on, cProfile sees every thread's calls once enabled: the HTTP threads' too). Written to
``<folder>/<pid>.json`` and ``<pid>.prof`` every 50 calls and at SIGTERM; summarized by
``python3 -m tools.bench.gpu.loop_profile.summary <folder>``. A bench's probe, never
imported by kvstore.
"""

from __future__ import annotations

import os

_FOLDER = os.environ.get("KVSTORE_BENCH_LOOP_PROFILE")


def _install(folder: str) -> None:
    import atexit
    import cProfile
    import importlib
    import json
    import signal
    import sys
    import threading
    import time

    generate = importlib.import_module("mlx_lm.generate")  # the package exports a function so named

    calls: list[tuple[float, float, int, int]] = []
    profiled = os.environ.get("KVSTORE_BENCH_LOOP_PROFILE_CPROFILE") == "1"
    profiler = cProfile.Profile() if profiled else None
    state = {"thread": None}
    lock = threading.Lock()
    original = generate.BatchGenerator.next

    def dump() -> None:
        with lock:
            path = os.path.join(folder, f"{os.getpid()}")
            with open(path + ".json", "w") as f:
                json.dump({"argv": sys.argv, "calls": calls}, f)
            if profiler is not None and state["thread"] == threading.get_ident():
                profiler.disable()
                profiler.dump_stats(path + ".prof")
                profiler.enable()
            elif profiler is not None and state["thread"] is not None:
                # Another thread (SIGTERM's): the generating thread's profile as it stands.
                profiler.dump_stats(path + ".prof")

    def next_call(self):  # type: ignore[no-untyped-def]
        if profiler is not None and state["thread"] is None:
            state["thread"] = threading.get_ident()
            profiler.enable()
        start = time.perf_counter()
        result = original(self)
        prompt, gen = result if isinstance(result, tuple) else ((), result)
        calls.append((start, time.perf_counter(), len(prompt), len(gen)))
        if len(calls) % 50 == 0:
            dump()
        return result

    generate.BatchGenerator.next = next_call
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame):  # type: ignore[no-untyped-def]
        dump()
        if callable(previous):
            previous(signum, frame)
        else:  # as the server would have ended without this hook
            signal.signal(signum, previous or signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, on_term)
    atexit.register(dump)


if _FOLDER:
    os.makedirs(_FOLDER, exist_ok=True)
    _install(_FOLDER)
