"""``kvstore bench``: argument parsing, and a quick P7 run end to end, in process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.bench.figures import FIGURES
from kvstore.bench.results import RESULTS_FILE, SCHEMA, BenchResults
from kvstore.cli import SUBCOMMANDS, build_parser, main

ROOT = Path(__file__).resolve().parents[2]


def test_bench_is_a_subcommand_and_parses_its_options(tmp_path):
    assert "bench" in SUBCOMMANDS
    args = build_parser().parse_args(
        ["bench", "--quick", "--only", "p1, P7", "--repeats", "6", "--out", str(tmp_path)]
    )
    assert (args.quick, args.only, args.repeats, args.out) == (True, ["P1", "P7"], 6, tmp_path)
    defaults = build_parser().parse_args(["bench"])
    assert (defaults.quick, defaults.only, defaults.repeats, defaults.out) == (
        False,
        None,
        None,
        Path("."),
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--repeats", "4"],
            "must be an integer >= 5 (a figure is a median of >= 5); received '4'",
        ),
        (["--repeats", "many"], "received 'many'"),
        (["--only", "P1,P99"], "Unknown figure(s) P99; known: P1, P2"),
        (["--only", ","], "Unknown figure(s) (none given)"),
    ],
)
def test_bad_options_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["bench", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_list_names_every_figure(capsys):
    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == list(FIGURES)


def test_quick_p7_runs_end_to_end_and_writes_valid_results(tmp_path, capsys):
    out_dir = tmp_path / "results"
    assert main(["bench", "--quick", "--only", "P7", "--out", str(out_dir)]) == 0
    captured = capsys.readouterr()
    data = json.loads((out_dir / RESULTS_FILE).read_text())
    assert data["schema"] == SCHEMA
    assert data["command"] == ["kvstore", "bench", "--quick", "--only", "P7", "--out", str(out_dir)]
    assert data["quick"] is True and data["repeats"] == 5
    assert {"cpu", "usable_cpus", "memory_bytes", "os", "python", "blas"} <= set(data["machine"])
    assert {"mlx", "mlx-lm", "numpy", "lmdb"} <= set(data["versions"])
    assert [f["id"] for f in data["figures"]] == ["P7"]
    results = BenchResults.from_dict(data)
    table = captured.out.rstrip("\n").splitlines()
    assert table[-1] == data["summary"]["line"] == results.summary_line()
    assert table[-1].startswith("summary: ")
    assert f"wrote {out_dir / RESULTS_FILE}" in captured.err


def test_plot_without_plottable_figures_says_so_and_still_succeeds(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(["bench", "--quick", "--only", "P3", "--plot", "--out", str(tmp_path)]) == 0
    assert "no plot: [bench plot] Nothing to plot" in capsys.readouterr().err
    assert not (tmp_path / "bench-scaling.png").exists()


def test_tools_script_is_the_same_command():
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench" / "run.py"), "--list"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert [line.split()[0] for line in done.stdout.splitlines()] == list(FIGURES)
