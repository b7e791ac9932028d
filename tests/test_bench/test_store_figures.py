"""The prefix-store figures (P1-P6, P8, P10) run their real paths on small sizes.

Structure only: which cases ran, what the rows carry, that scratch files
go. Nothing here asserts on a time.
"""

from __future__ import annotations

import pytest

from kvstore.bench.figures import concurrent, dedup_bytes, lookup, restore, save, ttft
from kvstore.bench.harness import Sizes, evaluate
from kvstore.bench.results import NOT_MEASURED

from .helpers import context

SMALL = Sizes(("qwen0.5b",), (256, 512))


def test_p1_restores_from_the_store_next_to_the_peers(tmp_path):
    result = restore.FIGURE.run(context(tmp_path, sizes=SMALL))
    *prompts, scaling = result.rows
    for row in prompts:
        assert list(row.samples) == [
            "ours",
            "mlx-lm load",
            "memcpy",
            "mlx-lm load + step",
            "ours + step",
        ]
        assert {"vs mlx-lm", "vs memcpy", "with the first step vs mlx-lm"} <= set(row.ratios)
    assert "ours s/MiB max/min" in scaling.values
    assert result.pending is None
    assert all(c.status != NOT_MEASURED for c in evaluate(restore.FIGURE, result))
    assert list(tmp_path.iterdir()) == []  # stores and files removed


@pytest.mark.parametrize("figure", [save.P2, save.P3])
def test_p2_and_p3_save_into_the_store_next_to_mlx_lm(figure, tmp_path):
    result = figure.run(context(tmp_path, sizes=SMALL))
    *prompts, _ = result.rows
    for row in prompts:
        assert list(row.samples) == ["ours", "mlx-lm save", "mlx-lm save+fsync"]
        assert set(row.ratios) == {"vs mlx-lm save", "vs mlx-lm save+fsync"}
    assert all(c.value is not None for c in evaluate(figure, result))
    assert list(tmp_path.iterdir()) == []


def test_p4_and_p10_fill_a_store_and_time_lookups_and_opens(tmp_path, monkeypatch):
    monkeypatch.setitem(lookup.FILL_BLOCKS, "quick", 300)
    p4 = lookup.P4.run(context(tmp_path))
    assert [r.params["tokens"] for r in p4.rows] == [1024, 8192, 32768, 32768]
    assert [r.params["miss"] for r in p4.rows] == [False, False, False, True]
    assert all(r.params["stored_blocks"] >= 300 + 32768 // 256 for r in p4.rows)
    assert all(len(next(iter(r.samples.values()))) >= 50 for r in p4.rows)
    (check,) = evaluate(lookup.P4, p4)  # the bar judges the stored 32k prompt only
    assert check.row == "32k tokens"
    p10 = lookup.P10.run(context(tmp_path))
    assert (
        set(p10.rows[0].samples) == {"big", "small"} and "open big vs small" in p10.rows[0].values
    )
    assert list(tmp_path.iterdir()) == []


def test_p5_times_a_restored_prompt_against_a_full_prefill(tmp_path, monkeypatch):
    monkeypatch.setattr(ttft, "MODEL", "tiny")
    monkeypatch.setitem(ttft.PROMPT_TOKENS, "quick", 600)
    result = ttft.FIGURE.run(context(tmp_path))
    (row,) = result.rows
    assert row.params["stored"] == 600 - ttft.TO_COMPUTE and row.params["blas"]
    assert set(row.samples) == {"ours", "full prefill"} and "vs full prefill" in row.ratios
    assert any(note.startswith("BLAS: ") for note in result.notes)


def test_p6_counts_what_64_sessions_sharing_a_prompt_store(tmp_path, monkeypatch):
    monkeypatch.setattr(dedup_bytes, "SESSIONS", 3)
    result = dedup_bytes.FIGURE.run(context(tmp_path))
    (row,) = result.rows
    assert row.params == {"workload": "qwen0.5b", "sessions": 3, "blocks": 8 + 3}
    assert row.values["vs unique bytes"] == pytest.approx(1.0, abs=0.01)  # headers only
    assert row.values["mlx-lm files vs stored"] > 2
    assert list(tmp_path.iterdir()) == []


def test_p8_runs_one_and_two_worker_processes(tmp_path, monkeypatch):
    monkeypatch.setattr(concurrent, "TOKENS", 512)
    monkeypatch.setattr(concurrent, "RESTORES", 2)
    result = concurrent.FIGURE.run(context(tmp_path))
    (row,) = result.rows
    assert set(row.samples) == {"1 process", "2 processes"}
    assert row.values[concurrent.AGGREGATE] == pytest.approx(2 * row.ratios["2 vs 1 time"].median)
