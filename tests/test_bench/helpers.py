"""Deterministic stand-ins for time: a clock the cases themselves advance."""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvstore.bench.harness import BenchContext, Case, Sizes
from kvstore.bench.results import BenchResults, FigureRecord, FigureResult, RatioResult, Row

#: What run_figures records as the machine when a test gives it one.
MACHINE = {
    "machine": {"cpu": "test cpu", "usable_cpus": 2, "memory_bytes": 2**30, "blas": {"mlx": "x"}},
    "versions": {"mlx": "0"},
    "git": {"revision": "0" * 40, "branch": "test", "dirty": False},
}


class FakeClock:
    """A clock that only moves when a case says it spent time."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def spend(self, seconds: float) -> None:
        self.now += seconds


def scripted_cases(
    clock: FakeClock, costs: dict[str, Sequence[float]], log: list[str]
) -> list[Case]:
    """Cases whose i-th call (warm-up included) takes ``costs[name][i]`` seconds and is logged."""
    calls = dict.fromkeys(costs, 0)

    def make(name: str) -> Case:
        def run() -> None:
            log.append(name)
            clock.spend(costs[name][calls[name]])
            calls[name] += 1

        return Case(
            name,
            "ours" if name == "ours" else "peer",
            run,
            reset=lambda: log.append(f"reset {name}"),
        )

    return [make(name) for name in costs]


def context(tmp_path, clock=None, repeats: int = 5, sizes: Sizes | None = None) -> BenchContext:
    """A context for small runs: real time unless ``clock`` is given (nothing asserts on it)."""
    return BenchContext(
        sizes=sizes or Sizes(("qwen0.5b",), (256, 512)),
        repeats=repeats,
        scratch=tmp_path,
        quick=True,
        log=lambda message: None,
        clock=clock or time.perf_counter,
    )


def synthetic_results() -> BenchResults:
    """A run with P1 (ours and the peer at three lengths) and P5 rows, no timing involved."""
    p1_rows = []
    for tokens in (512, 2048, 8192):
        scale = tokens / 512
        p1_rows.append(
            Row(
                f"llama8b {tokens}",
                {"workload": "llama8b", "tokens": tokens, "mib": 64.0 * scale},
                samples={
                    "ours": [0.010 * scale * f for f in (1.0, 1.1, 0.9, 1.0, 1.2)],
                    "mlx-lm load": [0.030 * scale * f for f in (1.0, 1.0, 1.1, 0.9, 1.0)],
                },
                roles={"ours": "ours", "mlx-lm load": "peer"},
                ratios={"vs mlx-lm": RatioResult("ours", "mlx-lm load", (3.0, 2.7, 3.7, 2.7, 2.5))},
            )
        )
    p5_rows = [
        Row(
            f"prefill {tokens}",
            {"tokens": tokens},
            samples={"full prefill": [0.5 * tokens / 512] * 5},
            roles={"full prefill": "peer"},
        )
        for tokens in (512, 2048, 8192)
    ]

    def record(fid: str, rows: list[Row]) -> FigureRecord:
        return FigureRecord(
            fid, f"figure {fid}", "peer", [], "reported", FigureResult(rows), [], 0.0
        )

    return BenchResults(
        created="2026-01-01T00:00:00+00:00",
        command=["kvstore", "bench"],
        quick=False,
        repeats=5,
        machine=MACHINE["machine"],
        versions=MACHINE["versions"],
        git=MACHINE["git"],
        figures=[record("P1", p1_rows), record("P5", p5_rows)],
    )
