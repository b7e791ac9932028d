"""One fresh session of G1/G2: a new process restores a prompt and computes its first token.

    python -m kvstore.bench.figures.gpu_session SPEC_JSON

``SPEC_JSON`` (from :meth:`~kvstore.bench.figures.gpu_common.GpuSetup.spec`):
``case`` (``"ours"``: an LMDB store at ``url``; ``"mlx-lm"``: the
``save_prompt_cache`` file at ``file``), the model ``config``, the prompt
(``tokens``, a ``.npy``), the cold prefill's last logits (``logits``) and the
``namespace``.

The process builds the seeded model, then warms the kernels the timed part
runs -- the forward of one token over a cache as long as the prompt (zeros),
or, where the spec's ``suffix`` leaves more than the last token to compute, only
what ``kvstore serve`` warms a model up with (a 32-token prefill and one step on
fresh caches: a server meets each suffix's shape for the first time) -- and, for
``ours``, a restore of the prompt's first block (MLX's own first
calls and the staging kernels load there, and the page route's trial, waited
for: ``cuda_pages.trial_done``) -- and gives MLX's buffer cache
back, so the timed restore allocates like a new session. Timed: lookup +
restore + the forward of the last prompt token (the last ``suffix`` tokens, the rest
restored), to its logits evaluated.
Prints one JSON line: the times, the tokens restored, and whether the
logits agree with the cold prefill's (argmax, largest difference).
"""

from __future__ import annotations

import gc
import json
import sys
import time
from typing import Any

import numpy as np


def run(spec: dict[str, Any]) -> dict[str, Any]:
    import mlx.core as mx

    from kvstore.bench.figures.gpu_common import build
    from kvstore.codecs import cuda

    model = build(spec["config"])
    prompt = np.load(spec["tokens"])
    reference = np.load(spec["logits"]).reshape(-1)
    n = len(prompt)
    suffix = int(spec.get("suffix", 1))
    last = mx.array(prompt[None, -suffix:].astype(np.int32))
    if suffix == 1:  # Warm-up: the timed forward's kernels at its length, on zeros.
        caches = model.make_cache()
        for cache in caches:
            shape = (1, spec["config"]["num_key_value_heads"], n - 1, spec["config"]["head_dim"])
            dtype = model.model.embed_tokens.weight.dtype
            cache.update_and_fetch(mx.zeros(shape, dtype), mx.zeros(shape, dtype))
        mx.eval(model(last, caches))
        del caches
    else:  # kvstore serve's warm-up, not the timed shapes
        from kvstore.serve.warmup import build_kernels

        build_kernels(model)
    store = None
    from mlx_lm.models.cache import (
        load_prompt_cache,
    )  # imported before the clock, as a server has it

    if spec["case"] == "ours":
        from kvstore.store import open_store

        store = open_store(spec["url"], readonly=True)
        head = prompt[: min(n, store.block_size + 1)]
        mx.eval(
            [
                c.keys
                for c in store.restore(store.lookup(spec["namespace"], head), model.make_cache())
            ]
        )
        from kvstore.codecs import cuda_pages

        cuda_pages.trial_done()  # the warm-up's trial of the page route, not raced
    gc.collect()
    mx.clear_cache()

    collections = _Collections()
    gc.callbacks.append(collections)
    t0 = time.perf_counter()
    if store is not None:
        match = store.lookup(spec["namespace"], prompt).truncated(n - suffix)
        t1, cpu1, usage1 = time.perf_counter(), time.thread_time(), thread_usage()
        restored = store.restore(match, model.make_cache())
    else:
        t1, cpu1, usage1 = time.perf_counter(), time.thread_time(), thread_usage()
        restored = load_prompt_cache(spec["file"])
        for cache in restored:  # the file holds all but the last token
            cache.trim(cache.offset - (n - suffix))
    returned = time.perf_counter()
    mx.eval([c.keys for c in restored])
    t2, cpu2, usage2 = time.perf_counter(), time.thread_time(), thread_usage()
    held = int(restored[0].offset)
    logits = model(last, restored)[:, -1]
    built, cpu_built = time.perf_counter(), time.thread_time()
    mx.eval(logits)
    t3 = time.perf_counter()
    gc.callbacks.remove(collections)
    got = np.asarray(logits.astype(mx.float32)).reshape(-1)
    if store is not None:
        store.close()
    return {
        "total_s": t3 - t0,
        "lookup_s": t1 - t0,
        "restore_s": t2 - t1,
        "forward_s": t3 - t2,
        "restored": held,
        "argmax_equal": bool(int(got.argmax()) == int(reference.argmax())),
        "max_abs_diff": float(np.max(np.abs(got - reference))),
        "staging": bool(cuda.available()),
        # This thread's CPU time in the restore: far under restore_s, it waited (for the
        # GIL, the driver, the device) rather than ran.
        "detail": {
            "tokens": n,
            "suffix": suffix,
            "restore_cpu_s": cpu2 - cpu1,
            # Until the call returned: the rest of restore_s is the device finishing
            # what the call queued (and, for mlx-lm's file, its lazy load).
            "restore_call_s": returned - t1,
            # Python's collections in the timed part (generation, seconds): a full one
            # in a process with a model loaded costs milliseconds, and G2's sessions
            # fall in two groups ~8-10 ms apart (f3c28c9): which one a session is in.
            "collections": collections.done,
            # The restoring thread's page faults and context switches in the restore
            # (Linux): at d0ceccd its CPU time varied by up to 8 ms between sessions
            # for the same work; whether it faulted or was switched out more says why.
            "restore_thread": {k: usage2[k] - usage1[k] for k in usage1},
            # The forward's graph built (the model call, Python on this thread) apart
            # from its evaluation: in G2 at b6c3868 fresh sessions' forwards spread
            # 10.6-17.4 ms where one process's took 9-10 after any restore.
            "forward_build_s": built - t2,
            "forward_build_cpu_s": cpu_built - cpu2,
        },
    }


def thread_usage() -> dict[str, int]:
    """The calling thread's minor faults and voluntary and involuntary context switches
    so far (``getrusage(RUSAGE_THREAD)``); empty where the platform has no such call."""
    import resource

    who = getattr(resource, "RUSAGE_THREAD", None)
    if who is None:  # macOS
        return {}
    usage = resource.getrusage(who)
    return {"faults": usage.ru_minflt, "waits": usage.ru_nvcsw, "preempted": usage.ru_nivcsw}


class _Collections:
    """A ``gc.callbacks`` entry noting each collection's generation and duration."""

    def __init__(self) -> None:
        self.done: list[tuple[int, float]] = []
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.done.append((int(info["generation"]), time.perf_counter() - self._start))


def main(argv: list[str]) -> int:
    print(json.dumps(run(json.loads(argv[0]))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
