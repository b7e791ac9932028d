"""``tools/bench/copy_floor.py``: the parts a verified restore cannot skip, each timed."""

from __future__ import annotations

import re

from .bench_tools import run_bench_tool

PARTS = [
    "copy, one thread",
    "copy, two threads",
    "xxh3 of the mapped bytes, one thread",
    "copy then xxh3 per MiB, two threads",
    "copy into fresh memory, one thread",
]


def test_it_times_each_part_of_a_verified_copy_at_each_size(tmp_path):
    done = run_bench_tool(
        "copy_floor.py", "--mib", "1", "2", "--repeats", "2", "--dir", str(tmp_path)
    )
    sizes = re.split(r"^(\d+) MiB$", done.stdout, flags=re.M)[1:]
    assert sizes[0::2] == ["1", "2"]
    for rows in sizes[1::2]:
        assert re.findall(r"^  (.+?) +\d+\.\d ms +\d+\.\d\d GB/s$", rows, re.M) == PARTS
    assert list(tmp_path.iterdir()) == []  # its file is gone
