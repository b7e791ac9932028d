"""``tools/bench/disk_probe.py``: a durable write of N MiB, each way, timed."""

from __future__ import annotations

import os
import re
from pathlib import Path

from .bench_tools import run_bench_tool

WAYS = [
    "memcpy into fresh memory",
    "page cache, new file, not synced",
    "page cache, append + fdatasync",
    "page cache, overwrite + fdatasync",
    "page cache, append, writeback per 8 MiB",
    "page cache, append, writeback per 32 MiB",
    "overwrite in place, writeback per 32 MiB",
    "reserved (fallocate), write + fdatasync",
    "reserved, writeback per 32 MiB",
    "O_DIRECT, append + fdatasync",
    "O_DIRECT, overwrite + fdatasync",
]


def test_it_times_each_way_of_a_durable_write_and_names_the_file_system(tmp_path):
    done = run_bench_tool("disk_probe.py", "--mib", "1", "--repeats", "2", "--dir", str(tmp_path))
    head, rows = done.stdout.split("\n", 1)
    real = str(tmp_path.resolve()) + "/"
    mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    _mount, kind = max(
        ((m[1].rstrip("/") + "/", m[2]) for m in mounts if real.startswith(m[1].rstrip("/") + "/")),
        key=lambda found: len(found[0]),
    )
    blocks = os.statvfs(tmp_path).f_bsize
    assert head == f"1 MiB into {tmp_path} ({blocks}-byte blocks, {kind})"
    assert re.findall(r"^  (.+?) +\d+\.\d ms +\d+\.\d\d GB/s", rows, re.M) == WAYS
    assert list(tmp_path.iterdir()) == []  # its file is gone
