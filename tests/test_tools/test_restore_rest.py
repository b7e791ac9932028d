"""``tools/bench/restore_rest.py``: a restore and the prompt's rest through its caches."""

from __future__ import annotations

from tests.test_tools.bench_tools import run_bench_tool


def test_it_restores_and_writes_the_rest_in_the_room_left():
    done = run_bench_tool(
        "restore_rest.py", "--restored", "200", "--rest", "100", "--repeats", "2", "--layers", "2"
    )
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines[:3]] == ["restore", "the rest's update", "both"]
    assert lines[3] == "restored 200 of 300 tokens; buffer rows after: 512"
