"""``tools/bench/save_parts.py``: a save's records written whole or in parts, timed."""

from __future__ import annotations

import re

from .bench_tools import run_bench_tool


def test_it_times_each_way_and_leaves_no_file(tmp_path):
    done = run_bench_tool(
        "save_parts.py",
        *("--dir", str(tmp_path), "--mib", "1", "--records", "2", "3"),
        *("--part-mib", "1", "--repeats", "2"),
    )
    assert re.findall(r"^(\d) records of 1 MiB into (.+)$", done.stdout, re.M) == [
        ("2", str(tmp_path)),
        ("3", str(tmp_path)),
    ]
    ways = re.findall(r"^  (.+?) +\d+\.\d ms  \((\d+), (\d+)\)$", done.stdout, re.M)
    assert [way for way, *_ in ways] == [
        "whole",
        "whole on the pool",
        "in parts of 1 MiB",
        "no copy, no checksum",
        "not synced",
    ] * 2
    assert list(tmp_path.iterdir()) == []  # its file is gone
