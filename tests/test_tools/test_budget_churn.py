"""``tools/bench/budget_churn.py``: a budgeted store's value file under churn."""

from __future__ import annotations

import re

from .bench_tools import run_bench_tool


def test_it_reports_the_file_against_the_budget_and_leaves_no_store(tmp_path):
    done = run_bench_tool(
        "budget_churn.py",
        *("--dir", str(tmp_path), "--budget-mib", "8", "--saves", "20"),
        *("--min-tokens", "300", "--max-tokens", "700"),
    )
    assert done.stdout.splitlines()[0] == "qwen0.5b, budget 8 MiB, 20 saves of 300-700 tokens"
    rows = re.findall(
        r"^ +(\d+) saves  file +([\d.]+) MiB  held +([\d.]+) MiB  free +([\d.]+) MiB in +\d+ "
        r"extents  LMDB +[\d.]+ MiB  \(\d+ s\)$",
        done.stdout,
        re.M,
    )
    assert [int(saves) for saves, *_ in rows] == list(range(2, 21, 2))
    assert all(float(held) <= 8 for _, _, held, _ in rows)  # the budget holds
    assert list(tmp_path.iterdir()) == []  # its store is gone
