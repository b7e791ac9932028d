"""D2: a new session's first restore, against mlx-lm's first load, each in a fresh process.

P1 repeats its restores in one process, whose buffers are warm after the first. A new
session reloads a prompt once, into memory its process has never touched: every page
of its caches is faulted in as it is written (on the CI microVMs at 1.4-2 GB/s, the
machine line's "new memory faulted in"). Per workload and prompt length, the prompt is
saved once into an LMDB store and by mlx-lm's ``save_prompt_cache`` into a file (both
then in the page cache), and ``ctx.repeats`` fresh processes of each, in turn, time
(:mod:`~kvstore.bench.figures.fresh_restore`):

* ``ours first``: the store opened read-only, lookup + restore + arrays evaluated;
* ``mlx-lm first``: ``load_prompt_cache`` + arrays evaluated;
* ``ours first + step``, ``mlx-lm first + step``: each, then its first decode step
  (:func:`~kvstore.bench.workloads.first_step`, timed in the same process), what a new
  session waits for before its first token besides the forward: a cache whose step must
  copy it pays that copy into memory its process faults in.

Each process imports everything, evaluates once and (ours) opens the store before its
clock starts, as a server that has just started has, so neither side counts the
interpreter's start. The processes may write Python's bytecode caches (an installed
package has them; without, each would compile the modules it imports lazily on its
clock), and ``ctx.warmup`` untimed processes of each side run first. No bar of its
own: P1 judges restores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import ExitStack
from typing import Any

from kvstore.bench.figures import store_cases
from kvstore.bench.figures.common import per_prompt_run, prompt_cache_file, prompt_params
from kvstore.bench.harness import BenchContext, Figure, ratio
from kvstore.bench.results import Row
from kvstore.bench.workloads import SyntheticKV, cache_nbytes

__all__ = ["FIGURE", "OURS", "PEER"]

OURS, PEER = "ours first", "mlx-lm first"
OURS_STEP, PEER_STEP = f"{OURS} + step", f"{PEER} + step"
RATIO = "vs mlx-lm"
STEP_RATIO = "with the first step vs mlx-lm"
#: How long one fresh process may take (imports included).
PROCESS_TIMEOUT_S = 300


def fresh_process(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one fresh process of ``spec`` and parse its report."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    done = subprocess.run(
        [sys.executable, "-m", "kvstore.bench.figures.fresh_restore", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=PROCESS_TIMEOUT_S,
        env=env,
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"[bench] D2's fresh {spec['case']} process failed ({done.returncode}): "
            f"{done.stderr.strip()[-2000:]}"
        )
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def measure(ctx: BenchContext, kv: SyntheticKV) -> Row:
    base = {"workload": kv.shape.name, "tokens": kv.tokens}
    with ExitStack() as stack:
        caches = kv.ours()
        nbytes = cache_nbytes(caches)
        name = f"d2-{kv.shape.name}-{kv.tokens}"
        store = stack.enter_context(store_cases.open_bench_store(ctx, name, nbytes))
        store.save(store_cases.NS, store_cases.prompt_tokens(kv)[: kv.tokens], caches)
        store.flush()
        url = f"lmdb://{ctx.scratch / name}"
        del caches
        store.close()  # each process opens it afresh
        path = stack.enter_context(prompt_cache_file(ctx, kv.mlx_lm(), name))
        specs = {
            OURS: {**base, "case": "ours", "url": url, "namespace": store_cases.NS},
            PEER: {**base, "case": "mlx-lm", "file": str(path)},
        }
        ctx.log(f"  {kv.label}: {OURS}, {PEER} x {ctx.repeats} fresh processes each")
        for _ in range(ctx.warmup):
            for case in (OURS, PEER):
                fresh_process(specs[case])
        samples: dict[str, list[float]] = {OURS: [], PEER: [], OURS_STEP: [], PEER_STEP: []}
        stepped = {OURS: OURS_STEP, PEER: PEER_STEP}
        for rep in range(ctx.repeats):
            order = [OURS, PEER] if rep % 2 == 0 else [PEER, OURS]
            for case in order:
                report = fresh_process(specs[case])
                if report["tokens"] != kv.tokens:
                    raise AssertionError(
                        f"[bench] a fresh {case} held {report['tokens']} of {kv.tokens} tokens"
                    )
                samples[case].append(report["seconds"])
                samples[stepped[case]].append(report["seconds"] + report["step_seconds"])
    return Row(
        kv.label,
        prompt_params(kv, nbytes),
        samples,
        {OURS: "ours", PEER: "peer", OURS_STEP: "ours", PEER_STEP: "peer"},
        {
            RATIO: ratio(samples, OURS, PEER),
            STEP_RATIO: ratio(samples, OURS_STEP, PEER_STEP),
        },
    )


FIGURE = Figure(
    "D2",
    "a new session's first restore: a fresh process restores the prompt once",
    "mlx-lm load_prompt_cache + mx.eval in a fresh process (file in the page cache)",
    (),
    per_prompt_run(measure),
)
