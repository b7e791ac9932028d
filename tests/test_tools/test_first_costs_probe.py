"""``tools/bench/gpu/first_costs.py`` on this CPU with a tiny shape (``--quick``): it runs,
times the staging set-up's parts that exist without CUDA, and one hand-off per save."""

from __future__ import annotations

import re

import pytest

from kvstore.devices import default_is_cuda

from .bench_tools import run_bench_tool


@pytest.mark.parametrize("copies_first", [False, True])
def test_it_reports_the_set_up_and_every_hand_off(copies_first):
    argv = ["--quick", "--tokens", "768", "--step", "256"]
    done = run_bench_tool(
        "gpu/first_costs.py", *argv, *(["--copies-first"] if copies_first else [])
    )
    parts = re.findall(r"^staging: (.+): \d+\.\d ms$", done.stdout, re.M)
    assert parts[:2] == ["MLX's start (a first evaluation)", "import of the staging modules"]
    # Without CUDA the set-up stops after the imports (it has nothing to build there).
    assert len(parts) == (10 if default_is_cuda() else 2)
    saves = re.findall(r"^hand-off (\d+) \(to (\d+) tokens\): \d+\.\d\d ms$", done.stdout, re.M)
    assert saves == [("1", "256"), ("2", "512"), ("3", "768")]
    copies = re.findall(r"^copies: (.+): \d+\.\d\d ms$", done.stdout, re.M)
    assert len(copies) == (5 if copies_first else 0)
