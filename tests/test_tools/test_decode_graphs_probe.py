"""``tools/bench/gpu/decode_graphs.py`` on this CPU with its tiny stand-in (``--quick``):
it runs, and says how many buffer sizes each call stepped over."""

from __future__ import annotations

import re

from .bench_tools import run_bench_tool


def test_each_call_reports_the_sizes_up_to_its_context():
    done = run_bench_tool("gpu/decode_graphs.py", "--quick", "--up-to", "255,600")
    assert re.search(r"^warm-up \(build_kernels\): \d+ ms$", done.stdout, re.M)
    counts = re.findall(r"^up_to (\d+): (\d+) sizes in \d+ ms$", done.stdout, re.M)
    assert counts == [("255", "0"), ("600", "3")]  # 600 tokens: buffers of 256, 512, 768
