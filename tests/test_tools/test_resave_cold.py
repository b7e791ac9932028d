"""``tools/bench/resave_cold.py``: a re-save of a stored prompt timed in the bench's cold
conditions runs, re-saves without writing (it raises if a block is written), and reports
each step asked for."""

from __future__ import annotations

import re

from .bench_tools import run_bench_tool


def test_it_times_the_re_save_and_its_steps():
    done = run_bench_tool(
        "resave_cold.py", "--tokens", "300", "--repeats", "2", "--no-fsync", "--parts"
    )
    assert done.stdout.splitlines()[0] == (
        "qwen0.5b 300, after the peer's unsynced save, median of 2:"
    )
    steps = re.findall(r"^  (.+): \d+\.\d us$", done.stdout, re.M)
    assert steps == [
        "store.save",
        "as_tokens",
        "check_caches",
        "BlockEncoder (signatures)",
        "stored_already (hashing, one read)",
    ]
