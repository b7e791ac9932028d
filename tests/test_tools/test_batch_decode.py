"""``tools/bench/gpu/batch_decode.py`` on this CPU with its tiny stand-in (``--quick``):
each variant in a process of its own decodes the same tokens from the same prompt --
a one-token step of a one-request batch given no mask attends as the masked one does."""

from __future__ import annotations

import json

from .bench_tools import run_bench_tool


def test_every_variant_decodes_the_same_tokens_and_reports_its_steps():
    done = run_bench_tool(
        "gpu/batch_decode.py",
        *("--quick", "--steps", "4", "--cached", "300", "--rest", "20"),
        *("--variants", "batched,unmasked,plain"),
    )
    lines = done.stdout.splitlines()
    assert all(line.startswith("{") for line in lines), done.stdout  # no variant failed
    runs = [json.loads(line) for line in lines]
    assert [r["variant"] for r in runs] == ["batched", "unmasked", "plain"]
    assert len({tuple(r["tokens"]) for r in runs}) == 1 and len(runs[0]["tokens"]) == 4
    # BatchKVCache.merge copies the 300 rows into a buffer of exactly 300, which the 20
    # more grow by a step; mlx-lm's own prefill left 512 rows, room for them.
    assert [r["buffer_rows"] for r in runs] == [300 + 256, 300 + 256, 512]
    assert all(len(r["first_steps_ms"]) == 4 and r["rest_ms"] > 0 for r in runs)
