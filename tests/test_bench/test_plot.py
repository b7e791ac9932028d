"""The scaling plot, drawn from a synthetic results object (no run, no timing)."""

from __future__ import annotations

import sys

import pytest

from kvstore.bench.plot import SCALING_SERIES, Series, plot_scaling, scaling_points
from kvstore.bench.results import BenchResults

from .helpers import synthetic_results

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_points_are_medians_and_quartiles_by_prompt_length():
    results = synthetic_results()
    restore, load, prefill = SCALING_SERIES
    points = scaling_points(results, restore, "llama8b")
    assert [p[0] for p in points] == [512, 2048, 8192]
    tokens, median, q1, q3 = points[0]
    assert (
        median == pytest.approx(0.010) and q1 == pytest.approx(0.010) and q3 == pytest.approx(0.011)
    )
    # rows without a workload (the reference model's prefill) belong to every panel
    assert [p[0] for p in scaling_points(results, prefill, "llama8b")] == [512, 2048, 8192]
    assert scaling_points(results, Series("P9", "ours", "x"), "llama8b") == []


def test_plot_renders_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is in the dev extra; install '.[dev]'")
    path = plot_scaling(synthetic_results(), tmp_path / "scaling.png")
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000


def test_plot_of_results_without_its_series_is_refused(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is in the dev extra; install '.[dev]'")
    empty = BenchResults.from_dict({**synthetic_results().to_dict(), "figures": []})
    with pytest.raises(ValueError, match="Nothing to plot: no rows of P1 'ours'"):
        plot_scaling(empty, tmp_path / "x.png")


def test_without_matplotlib_the_error_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails
    with pytest.raises(ImportError, match=r"pip install 'mlx-kvstore\[plot\]'"):
        plot_scaling(synthetic_results(), tmp_path / "x.png")
