"""Summarize ``loop_profile``'s files: per server process, each run of
``BatchGenerator.next`` calls (a request's stream: calls less than a second apart), the
time inside ``next`` and between calls (the server loop: responses, detokenizing, the
queue to the HTTP thread), and the profile's top functions.

    python3 -m tools.bench.gpu.loop_profile.summary FOLDER [--top 25]
"""

from __future__ import annotations

import argparse
import json
import pstats
import statistics
import sys
from collections import Counter
from pathlib import Path
from typing import Any


def runs(calls: list[list[float]]) -> list[list[list[float]]]:
    """Calls split where the loop idled a second or more (between requests)."""
    out: list[list[list[float]]] = []
    for call in calls:
        if out and call[0] - out[-1][-1][1] < 1.0:
            out[-1].append(call)
        else:
            out.append([call])
    return out


def describe(run: list[list[float]]) -> str:
    inside = [(end - start) * 1e3 for start, end, *_ in run]
    between = [(b[0] - a[1]) * 1e3 for a, b in zip(run, run[1:])]
    generated = sum(int(c[3]) for c in run)
    first = ", ".join(f"{x:.1f}" for x in inside[:5])
    gaps = ", ".join(f"{x:.1f}" for x in between[:5])
    line = (
        f"  {len(run)} calls, {generated} tokens, {(run[-1][1] - run[0][0]) * 1e3:.0f} ms: "
        f"inside next median {statistics.median(inside):.2f} ms (first {first}; "
        f"longest {max(inside):.1f} at call {inside.index(max(inside)) + 1})"
    )
    if between:
        line += f"; between calls median {statistics.median(between):.2f} ms (first {gaps}), "
        line += f"longest {max(between):.1f} at call {between.index(max(between)) + 1}"
    return line


def slow_windows(calls: list[list[float]], over_ms: float) -> list[tuple[str, float, float]]:
    """Each ``next`` call, and each gap between calls of one run, that took over ``over_ms``:
    (what, start, end)."""
    out = []
    for run in runs(calls):
        for i, (start, end, *_) in enumerate(run):
            if (end - start) * 1e3 > over_ms:
                out.append((f"call {i + 1} inside next", start, end))
            if i + 1 < len(run) and (run[i + 1][0] - end) * 1e3 > over_ms:
                out.append((f"gap after call {i + 1}", end, run[i + 1][0]))
    return out


def print_samples(
    calls: list[list[float]], samples: list[list[Any]], over_ms: float, top: int = 3
) -> None:
    """For each slow window (over ``over_ms``: the probe's ``slow_ms``, the threshold its
    samples were kept by), each thread's most common stacks sampled in it."""
    for what, start, end in slow_windows(calls, over_ms):
        inside = [s for s in samples if start <= s[0] <= end]
        print(f"  {what}: {(end - start) * 1e3:.1f} ms, {len(inside)} samples")
        by_thread: dict[str, Counter[tuple[str, ...]]] = {}
        for _, thread, stack in inside:
            if stack and stack[0].endswith(" _worker"):  # an idle pool thread
                continue
            by_thread.setdefault(thread, Counter())[tuple(stack[:6])] += 1
        for thread, stacks in sorted(by_thread.items()):
            for stack, n in stacks.most_common(top):
                print(f"    {thread} x{n}: " + " < ".join(stack))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    for path in sorted(args.folder.glob("*.json")):
        data = json.loads(path.read_text())
        # argv: [".../kvstore/cli.py", "serve", ...] or [".../mlx_lm/__main__.py", "server", ...]
        name = "kvstore serve" if "serve" in data["argv"] else "mlx_lm.server"
        print(f"== {path.stem} ({name}): {len(data['calls'])} calls")
        for run in runs(data["calls"]):
            print(describe(run))
        if data.get("samples"):
            print_samples(data["calls"], data["samples"], data["slow_ms"])
        prof = path.with_suffix(".prof")
        if prof.exists():
            stats = pstats.Stats(str(prof), stream=sys.stdout)
            stats.sort_stats("tottime").print_stats(args.top)
            stats.sort_stats("cumulative").print_stats(args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
