"""Interleaving, statistics, ratios and bar judging, on cases timed by a fake clock."""

from __future__ import annotations

import statistics

import pytest

from kvstore.bench.harness import (
    Bar,
    BenchContext,
    Case,
    Figure,
    Ratio,
    Sizes,
    at_least,
    at_most,
    evaluate,
    figure_status,
    measure_interleaved,
    ratio,
    run_figures,
)
from kvstore.bench.results import MET, MISSED, NOT_MEASURED, FigureResult, Row, Spread

from .helpers import MACHINE, FakeClock, context, scripted_cases


def test_cases_run_interleaved_with_the_first_case_rotating_and_warmup_first():
    clock, log = FakeClock(), []
    cases = scripted_cases(clock, {"a": [1] * 6, "b": [1] * 6, "c": [1] * 6}, log)
    measure_interleaved(cases, repeats=5, warmup=1, clock=clock)
    calls = [entry for entry in log if not entry.startswith("reset")]
    assert calls == [
        *"abc",  # warm-up, untimed
        *"abc",
        *"bca",
        *"cab",
        *"abc",
        *"bca",
    ]


def test_reset_runs_before_every_call_including_warmup():
    clock, log = FakeClock(), []
    cases = scripted_cases(clock, {"a": [1] * 7, "b": [1] * 7}, log)
    measure_interleaved(cases, repeats=5, warmup=2, clock=clock)
    assert log[:4] == ["reset a", "a", "reset b", "b"]
    assert len(log) == 2 * 2 * 7


def test_warmup_is_excluded_and_samples_stay_in_repetition_order():
    clock, log = FakeClock(), []
    costs = {"ours": [100, 1, 2, 3, 4, 5], "peer": [200, 10, 20, 30, 40, 50]}
    samples = measure_interleaved(scripted_cases(clock, costs, log), 5, clock=clock)
    assert samples == {"ours": [1, 2, 3, 4, 5], "peer": [10, 20, 30, 40, 50]}


def test_ratios_are_taken_per_repetition_then_the_median():
    samples = {"ours": [1.0, 2.0, 4.0, 1.0, 8.0], "peer": [3.0, 2.0, 20.0, 10.0, 8.0]}
    r = ratio(samples, "ours", "peer")
    assert r.per_rep == (3.0, 1.0, 5.0, 10.0, 1.0)
    assert r.median == 3.0
    # not the ratio of the medians, which mixes repetitions
    assert statistics.median(samples["peer"]) / statistics.median(samples["ours"]) != r.median


def test_measure_builds_a_row_and_leaves_out_ratios_of_cases_that_did_not_run(tmp_path):
    clock = FakeClock()
    ctx = context(tmp_path, clock)
    cases = scripted_cases(clock, {"mlx-lm load": [2] * 6, "memcpy": [1] * 6}, [])
    ratios = [
        Ratio("vs mlx-lm", "ours", "mlx-lm load"),
        Ratio("peer vs memcpy", "mlx-lm load", "memcpy"),
    ]
    row = ctx.measure("w 512", {"workload": "w", "tokens": 512}, cases, ratios, pending="no ours")
    assert set(row.ratios) == {"peer vs memcpy"}
    assert row.ratios["peer vs memcpy"].per_rep == (0.5,) * 5
    assert row.roles == {"mlx-lm load": "peer", "memcpy": "peer"}
    assert row.pending == "no ours"
    assert row.metric("peer vs memcpy") == 0.5
    assert row.metric("vs mlx-lm") is None


def test_duplicate_case_names_are_refused():
    run = Case("a", "peer", lambda: None)
    with pytest.raises(ValueError, match="unique"):
        measure_interleaved([run, run], 5)


def test_fewer_than_five_repeats_are_refused(tmp_path):
    with pytest.raises(ValueError, match="at least 5 repetitions; received repeats=4"):
        BenchContext(Sizes(("qwen0.5b",), (512,)), 4, tmp_path)


def test_spread_reports_median_quartiles_and_extremes():
    assert Spread.of([5, 1, 4, 2, 3]) == Spread(5, 3, 2, 4, 1, 5)
    assert Spread.of([7.0]) == Spread(1, 7.0, 7.0, 7.0, 7.0, 7.0)
    with pytest.raises(ValueError, match="at least one sample"):
        Spread.of([])


def test_bars_are_predicates_and_their_text_names_the_rows_they_judge():
    bar = at_most("vs bf16", 0.54, where={"family": "kv:quant:8:64"})
    assert bar.text == "vs bf16 <= 0.54x [kv:quant:8:64]"
    assert bar.check(0.54) and not bar.check(0.55)
    assert at_least("vs mlx-lm", 1.5).text == "vs mlx-lm >= 1.5x"
    assert at_least("vs mlx-lm", 1.5).check(1.5) and not at_least("vs mlx-lm", 1.5).check(1.49)
    assert at_most("lookup ms", 2, unit=" ms").text == "lookup ms <= 2 ms"


def _figure(*bars: Bar) -> Figure:
    return Figure("PX", "a figure", "a peer", bars, lambda ctx: FigureResult())


def test_evaluate_judges_rows_with_the_metric_and_reports_pending_ones():
    rows = [
        Row("a", {"family": "f"}, values={"m": 0.5}),
        Row("b", {"family": "f"}, values={"m": 0.7}),
        Row("c", {"family": "g"}, values={"m": 9.0}),  # not this bar's rows
        Row("d", {"family": "f"}, pending="its codec is missing"),
        Row("scaling", {"family": "f"}, values={"other": 1.0}),  # neither: ignored
    ]
    checks = evaluate(_figure(at_most("m", 0.6, where={"family": "f"})), FigureResult(rows))
    assert [(c.row, c.value, c.status, c.reason) for c in checks] == [
        ("a", 0.5, MET, None),
        ("b", 0.7, MISSED, None),
        ("d", None, NOT_MEASURED, "its codec is missing"),
    ]


def test_a_bar_no_row_judged_is_not_measured_with_the_figures_reason():
    checks = evaluate(
        _figure(at_least("vs mlx-lm", 1.5)), FigureResult([Row("peer only")], "no store")
    )
    assert [(c.row, c.value, c.status, c.reason) for c in checks] == [
        (None, None, NOT_MEASURED, "no store")
    ]


@pytest.mark.parametrize(
    ("statuses", "rows", "expected"),
    [
        ([MET, MET], [], MET),
        ([MET, MISSED, NOT_MEASURED], [], MISSED),
        ([MET, NOT_MEASURED], [], "partial"),
        ([NOT_MEASURED], [Row("peer")], NOT_MEASURED),
        ([], [Row("r")], "reported"),
        ([], [], NOT_MEASURED),
    ],
)
def test_figure_status(statuses, rows, expected):
    from kvstore.bench.results import Check

    checks = [Check("bar", "m", None, None, s) for s in statuses]
    assert figure_status(checks, FigureResult(rows)) == expected


def test_run_figures_records_a_failing_figure_and_runs_the_rest(tmp_path):
    def boom(ctx):
        raise RuntimeError("no luck")

    def fine(ctx):
        return FigureResult([Row("r", values={"m": 1.0})])

    figures = [
        Figure("PA", "fails", "peer", (at_least("m", 1),), boom),
        Figure("PB", "works", "peer", (at_least("m", 1), at_most("m", 0.5)), fine),
    ]
    results = run_figures(figures, context(tmp_path), command=["kvstore", "bench"], machine=MACHINE)
    a, b = results.figures
    assert (a.status, a.error) == ("error", "RuntimeError: no luck")
    assert [c.status for c in a.checks] == [NOT_MEASURED]
    assert "the figure failed: RuntimeError: no luck" in a.checks[0].reason
    assert b.status == MISSED
    assert b.bar_statuses() == {"m >= 1x": MET, "m <= 0.5x": MISSED}
    assert results.summary()["bars"] == {MET: 1, MISSED: 1, NOT_MEASURED: 1}
    assert results.summary_line() == (
        "summary: 1 bars met, 1 missed, 1 not measured yet; missed: PB; error: PA"
    )
    assert results.machine == MACHINE["machine"] and results.git == MACHINE["git"]
