"""Where a server's generating loop spends a streamed token: loaded by a server process
when this folder leads its PYTHONPATH and ``KVSTORE_BENCH_LOOP_PROFILE`` names a folder.

``tools/bench/gpu/next.sh loopprofile`` runs ``serve_ttft.py`` with it (stock
``mlx_lm.server`` and ``kvstore serve`` alike): every ``BatchGenerator.next`` call's
start and end (``perf_counter``), how many prompt and generated responses it returned, and
(with ``KVSTORE_BENCH_LOOP_PROFILE_CPROFILE=1``) a ``cProfile`` of the whole generating
thread from its first ``next`` on, the server loop between calls included (from Python
3.12 on, cProfile sees every thread's calls once enabled: the HTTP threads' too). Written to
``<folder>/<pid>.json`` and ``<pid>.prof`` every 50 calls and at SIGTERM. With
``KVSTORE_BENCH_LOOP_PROFILE_SAMPLE=MS``, a thread samples every thread's Python stack
every ``MS`` ms from the first ``next`` on (``sys._current_frames``: where each thread is,
also while it waits in C code or for the GIL); those inside a call or gap over
``KVSTORE_BENCH_LOOP_PROFILE_SLOW_MS`` (100) are kept in ``samples``, and the summary
prints each thread's most common stacks there (one long event, which cProfile's totals
hide). Summarized by
``python3 -m tools.bench.gpu.loop_profile.summary <folder>``. A bench's probe, never
imported by kvstore.
"""

from __future__ import annotations

import os

_FOLDER = os.environ.get("KVSTORE_BENCH_LOOP_PROFILE")


def _install(folder: str) -> None:
    import atexit
    import collections
    import cProfile
    import importlib
    import json
    import signal
    import sys
    import threading
    import time

    generate = importlib.import_module("mlx_lm.generate")  # the package exports a function so named

    calls: list[tuple[float, float, int, int]] = []
    # (time, thread name, innermost frames), the last few seconds' (``recent``), and those
    # of each call or gap over ``slow_s`` (``samples``, read by the summary).
    recent: collections.deque[tuple[float, str, list[str]]] = collections.deque(maxlen=40000)
    samples: list[tuple[float, str, list[str]]] = []
    sample_ms = float(os.environ.get("KVSTORE_BENCH_LOOP_PROFILE_SAMPLE") or 0)
    slow_s = float(os.environ.get("KVSTORE_BENCH_LOOP_PROFILE_SLOW_MS") or 100) / 1e3
    profiled = os.environ.get("KVSTORE_BENCH_LOOP_PROFILE_CPROFILE") == "1"
    profiler = cProfile.Profile() if profiled else None
    state = {"thread": None}
    lock = threading.Lock()
    original = generate.BatchGenerator.next

    def dump(final: bool = False) -> None:
        """The files as they stand; the stack samples at the end alone (``final``):
        written every 50 calls, they held the generating thread 300-700 ms each time on
        the VM, the very kind of gap they are kept to explain."""
        with lock:
            path = os.path.join(folder, f"{os.getpid()}")
            with open(path + ".json", "w") as f:
                kept = samples if final else []
                document = {"argv": sys.argv, "calls": calls, "samples": kept}
                json.dump({**document, "slow_ms": slow_s * 1e3}, f)
            if profiler is not None and state["thread"] == threading.get_ident():
                profiler.disable()
                profiler.dump_stats(path + ".prof")
                profiler.enable()
            elif profiler is not None and state["thread"] is not None:
                # Another thread (SIGTERM's): the generating thread's profile as it stands.
                profiler.dump_stats(path + ".prof")

    def sample() -> None:
        names: dict[int, str] = {}
        while True:
            time.sleep(sample_ms / 1e3)
            now = time.perf_counter()
            for ident, frame in sys._current_frames().items():
                if ident == threading.get_ident():
                    continue
                if ident not in names:
                    names = {t.ident: t.name for t in threading.enumerate() if t.ident}
                stack = []
                while frame is not None and len(stack) < 10:
                    code = frame.f_code
                    where = code.co_filename.rsplit("/", 2)[-1]
                    stack.append(f"{where}:{frame.f_lineno} {code.co_name}")
                    frame = frame.f_back
                recent.append((now, names.get(ident, str(ident)), stack))

    def keep(start: float, end: float) -> None:
        samples.extend(x for x in list(recent) if start <= x[0] <= end)

    def next_call(self):  # type: ignore[no-untyped-def]
        if state["thread"] is None:
            state["thread"] = threading.get_ident()
            if profiler is not None:
                profiler.enable()
            if sample_ms > 0:
                threading.Thread(target=sample, name="loop-profile-sampler", daemon=True).start()
        start = time.perf_counter()
        if sample_ms > 0 and calls and start - calls[-1][1] > slow_s:
            keep(calls[-1][1], start)
        result = original(self)
        prompt, gen = result if isinstance(result, tuple) else ((), result)
        calls.append((start, time.perf_counter(), len(prompt), len(gen)))
        if sample_ms > 0 and calls[-1][1] - start > slow_s:
            keep(start, calls[-1][1])
        if len(calls) % 50 == 0:
            dump()
        return result

    generate.BatchGenerator.next = next_call
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame):  # type: ignore[no-untyped-def]
        dump(final=True)
        if callable(previous):
            previous(signum, frame)
        else:  # as the server would have ended without this hook
            signal.signal(signum, previous or signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, on_term)
    atexit.register(dump, final=True)


if _FOLDER:
    os.makedirs(_FOLDER, exist_ok=True)
    _install(_FOLDER)
