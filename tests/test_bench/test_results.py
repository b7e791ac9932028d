"""The results model: bench-results.json round trip, schema, table and summary line."""

from __future__ import annotations

import json

import pytest

from kvstore.bench.harness import Figure, at_least, at_most, run_figures
from kvstore.bench.report import format_number, format_seconds, format_table
from kvstore.bench.results import RESULTS_FILE, SCHEMA, BenchResults, FigureResult, Row

from .helpers import MACHINE, context, synthetic_results

TOP_KEYS = {
    "schema",
    "created",
    "command",
    "quick",
    "repeats",
    "machine",
    "versions",
    "git",
    "summary",
    "figures",
}
FIGURE_KEYS = {
    "id",
    "title",
    "peer",
    "bars",
    "status",
    "pending",
    "notes",
    "error",
    "elapsed_s",
    "checks",
    "rows",
}
ROW_KEYS = {"label", "params", "samples", "stats", "roles", "ratios", "values", "pending"}


def _run(tmp_path) -> BenchResults:
    def measured(ctx):
        return FigureResult(
            [
                Row(
                    "w 512",
                    {"tokens": 512},
                    {"ours": [1.0, 2.0, 3.0, 4.0, 5.0]},
                    {"ours": "ours"},
                    values={"m": 2.0},
                )
            ],
            notes=["a note"],
        )

    figures = [
        Figure("PA", "measured", "peer", (at_least("m", 1.5),), measured),
        Figure(
            "PB", "waiting", "peer", (at_most("m", 1),), lambda ctx: FigureResult(pending="later")
        ),
    ]
    return run_figures(
        figures, context(tmp_path), command=["kvstore", "bench", "--quick"], machine=MACHINE
    )


def test_results_file_holds_raw_samples_stats_checks_and_summary(tmp_path):
    path = _run(tmp_path).write(tmp_path / "out")
    assert path == tmp_path / "out" / RESULTS_FILE
    data = json.loads(path.read_text())
    assert set(data) == TOP_KEYS and data["schema"] == SCHEMA
    assert data["command"] == ["kvstore", "bench", "--quick"]
    pa, pb = data["figures"]
    assert set(pa) == FIGURE_KEYS
    (row,) = pa["rows"]
    assert set(row) == ROW_KEYS
    assert row["samples"] == {"ours": [1.0, 2.0, 3.0, 4.0, 5.0]}
    assert row["stats"]["ours"] == {
        "n": 5,
        "median": 3.0,
        "q1": 2.0,
        "q3": 4.0,
        "min": 1.0,
        "max": 5.0,
    }
    assert pa["checks"] == [
        {
            "bar": "m >= 1.5x",
            "metric": "m",
            "row": "w 512",
            "value": 2.0,
            "status": "met",
            "reason": None,
        }
    ]
    assert (pb["status"], pb["pending"], pb["rows"]) == ("not measured yet", "later", [])
    assert data["summary"] == {
        "bars": {"met": 1, "missed": 0, "not measured yet": 1},
        "figures": {"met": ["PA"], "not measured yet": ["PB"]},
        "line": "summary: 1 bars met, 0 missed, 1 not measured yet; met: PA; not measured yet: PB",
    }


def test_results_round_trip_through_json(tmp_path):
    for results in (_run(tmp_path), synthetic_results()):
        again = BenchResults.load(results.write(tmp_path))
        assert again.to_dict() == results.to_dict()


def test_loading_another_schema_is_refused(tmp_path):
    (tmp_path / "x.json").write_text(json.dumps({"schema": "something/9"}))
    with pytest.raises(ValueError, match="Not a kvstore-bench/1 results file"):
        BenchResults.load(tmp_path / "x.json")


def test_table_ends_with_the_summary_line_and_shows_every_figure(tmp_path):
    results = _run(tmp_path)
    lines = format_table(results).splitlines()
    assert lines[-1] == results.summary_line()
    text = "\n".join(lines)
    assert "PA  measured  [met]" in text
    assert "PB  waiting  [not measured yet]" in text
    assert "not measured yet: later" in text
    assert "w 512  ours 3 s [2 s-4 s]  m 2  <- m >= 1.5x: met" in text
    assert "note: a note" in text
    assert "machine: test cpu, 2 cpus, 1 GiB" in lines[1]


def test_number_formats():
    assert format_seconds(2.5) == "2.5 s"
    assert format_seconds(0.0123) == "12.3 ms"
    assert format_seconds(4.5e-5) == "45 us"
    assert format_seconds(3e-9) == "3 ns"
    assert format_number(131072.4) == "131,072"
    assert format_number(0.53179) == "0.5318"
