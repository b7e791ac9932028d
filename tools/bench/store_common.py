"""Shared helpers of the store benchmarks: interleaved timing, a table, bench-results.json.

Every figure is measured side by side with its reference in one process run:
the candidates are timed in turn, round after round (interleaved), and the
median of the rounds is reported, so machine noise hits all of them alike.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "interleaved",
    "median_ms",
    "write_results",
    "print_table",
    "fill_store",
    "per_workload",
]


def interleaved(
    candidates: dict[str, Callable[[], Any]], rounds: int, warmup: int = 1
) -> dict[str, list[float]]:
    """Seconds per call of each candidate, ``rounds`` samples each, taken in turn."""
    for _ in range(warmup):
        for fn in candidates.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return samples


def median_ms(samples: list[float]) -> float:
    return 1e3 * statistics.median(samples)


def print_table(title: str, header: list[str], rows: list[list[Any]], summary: str) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    print(f"\n{title}")
    for row in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(str(x).rjust(w) for x, w in zip(row, widths, strict=True)))
    print(summary)


def write_results(
    figure: str, data: dict[str, Any], path: str | os.PathLike[str] = "bench-results.json"
) -> None:
    """Merge ``data`` under ``figure`` into the results file (every raw sample included)."""
    p = Path(path)
    try:
        results = json.loads(p.read_text())
    except (OSError, ValueError):
        results = {}
    results[figure] = {"recorded": time.strftime("%Y-%m-%dT%H:%M:%S"), **data}
    p.write_text(json.dumps(results, indent=1))


def fill_store(
    store: Any, namespace: str, blocks: int, prompt_blocks: int, record: bytes, seed: int
) -> None:
    """Store about ``blocks`` blocks as random prompts of ``prompt_blocks`` blocks each."""
    import numpy as np

    rng = np.random.default_rng(seed)
    bsize = store.block_size
    done = 0
    while done < blocks:
        n = min(prompt_blocks, blocks - done)
        tokens = rng.integers(0, 150_000, n * bsize, dtype=np.uint32)
        store.put_blocks(namespace, tokens, lambda spans: [record] * len(spans))
        done += n


def per_workload(
    measure: Callable[..., tuple[list[list[Any]], dict[str, Any]]],
    workloads: dict[str, int],
    root: Path,
    rounds: int,
) -> tuple[list[list[Any]], dict[str, Any]]:
    """Table rows and raw results of ``measure(name, bytes_per_token, root, rounds, rng)``
    for every workload, with one seeded generator shared in order."""
    import numpy as np

    rng = np.random.default_rng(0)
    rows: list[list[Any]] = []
    results: dict[str, Any] = {}
    for name, per_token in workloads.items():
        more, results[name] = measure(name, per_token, root, rounds, rng)
        rows += more
    return rows, results
