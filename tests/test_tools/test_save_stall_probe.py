"""``tools/bench/gpu/save_stall.py`` on this CPU (``--quick``: a tiny model): every save
behind is reported with its steps and the writer's parts, each timed where it ran."""

from __future__ import annotations

import re

from .bench_tools import run_bench_tool


def test_it_reports_each_save_with_its_steps_and_the_writers_parts():
    done = run_bench_tool("gpu/save_stall.py", "--quick", "--saves", "2")
    assert re.search(r"^Device\(cpu, 0\): 300 tokens; a step alone \d+\.\d\d ms", done.stdout, re.M)
    saves = re.findall(
        r"^save (\d): hand-off \d+\.\d ms, done after \d+ ms; (\d+) steps, median",
        done.stdout,
        re.M,
    )
    assert [n for n, _ in saves] == ["1", "2"] and all(int(steps) >= 1 for _, steps in saves)
    # The parts of a save that run off the device, timed in every save (the first
    # block of 256 tokens: one record written, put and committed).
    for part in ("write_records", "lmdb put", "lmdb commit"):
        found = re.findall(rf"^    {part}: (\d+) calls, \d+\.\d ms in all", done.stdout, re.M)
        assert len(found) == 2 and all(int(n) >= 1 for n in found), part


def test_churn_makes_and_saves_mlx_lm_caches_between_saves_and_reports_memory():
    """``--churn``: G3's peer (fresh mlx-lm caches saved by save_prompt_cache) before each
    save, and MLX's memory counters printed there."""
    done = run_bench_tool("gpu/save_stall.py", "--quick", "--saves", "2", "--churn")
    lines = done.stdout.splitlines()
    memory = [i for i, line in enumerate(lines) if line.startswith("    MLX memory: active ")]
    saves = [i for i, line in enumerate(lines) if line.startswith("save ")]
    assert len(memory) == 2 and len(saves) == 2
    assert all(m < s for m, s in zip(memory, saves))  # each before its save
    assert re.search(r"active \d+ MiB, cached \d+, peak [1-9]\d*$", lines[memory[0]])
