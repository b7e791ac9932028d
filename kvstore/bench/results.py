"""The results model: what a benchmark run measured, and its ``bench-results.json`` form.

A run (:class:`BenchResults`) holds, per figure (:class:`FigureRecord`), the
rows it measured (:class:`Row`: every raw sample of every case, the
per-repetition ratios, derived values), each bar checked against them
(:class:`Check`) and the figure's status. Everything round-trips through
JSON (:meth:`BenchResults.to_dict` / :meth:`BenchResults.from_dict`), so a
table or plot can be redrawn from a stored run.

Statuses: a check is ``met``, ``missed`` or ``not measured yet`` (with the
reason). A figure is ``met`` when every check is, ``missed`` when any
is, ``partial`` when some are met and the rest not measured yet,
``reported`` when it has no bar and measured rows, ``not measured yet``
when nothing its bars need was measured, and ``error`` when it raised.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

__all__ = [
    "SCHEMA",
    "RESULTS_FILE",
    "MET",
    "MISSED",
    "NOT_MEASURED",
    "CheckStatus",
    "Spread",
    "RatioResult",
    "Row",
    "FigureResult",
    "Check",
    "FigureRecord",
    "BenchResults",
]

#: Version of the ``bench-results.json`` layout.
SCHEMA = "kvstore-bench/1"
#: The file a run writes into its output directory.
RESULTS_FILE = "bench-results.json"

MET: Final = "met"
MISSED: Final = "missed"
NOT_MEASURED: Final = "not measured yet"
CheckStatus = Literal["met", "missed", "not measured yet"]


@dataclass(frozen=True)
class Spread:
    """Median and spread of samples: quartiles (inclusive method) and extremes."""

    n: int
    median: float
    q1: float
    q3: float
    min: float
    max: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> Spread:
        """The spread of ``samples`` (at least one)."""
        if not samples:
            raise ValueError("[bench] A spread needs at least one sample; received none.")
        data = sorted(samples)
        median = statistics.median(data)
        q1, _, q3 = (
            statistics.quantiles(data, n=4, method="inclusive")
            if len(data) > 1
            else (
                median,
                median,
                median,
            )
        )
        return cls(len(data), median, q1, q3, data[0], data[-1])


@dataclass(frozen=True)
class RatioResult:
    """``reference`` time over ``subject`` time, one value per repetition (> 1: subject faster).

    Each repetition's own ratio is taken before the median, so load that
    drifts between repetitions hits both cases of a pair alike and cancels.
    """

    subject: str
    reference: str
    per_rep: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.per_rep)

    @property
    def spread(self) -> Spread:
        return Spread.of(self.per_rep)


@dataclass
class Row:
    """One measured configuration of a figure (a workload at a prompt length, a family...).

    Attributes:
        label: how the table names the row (``"llama8b 2048"``).
        params: what was measured (``workload``, ``tokens``, ``mib``...).
        samples: case name -> seconds per call, in repetition order (warm-up excluded).
        roles: case name -> ``ours``, ``peer`` or ``limit``.
        ratios: name -> per-repetition ratio of two cases.
        values: name -> a derived number (bytes per token, time per MiB spread...).
        pending: why this row's own part is not measured yet (None: it is).
    """

    label: str
    params: dict[str, Any] = field(default_factory=dict)
    samples: dict[str, list[float]] = field(default_factory=dict)
    roles: dict[str, str] = field(default_factory=dict)
    ratios: dict[str, RatioResult] = field(default_factory=dict)
    values: dict[str, float] = field(default_factory=dict)
    pending: str | None = None

    def metric(self, name: str) -> float | None:
        """A ratio's median or a value called ``name``; None when this row has neither."""
        if name in self.ratios:
            return self.ratios[name].median
        return self.values.get(name)

    def spread(self, case: str) -> Spread:
        """Median and spread of ``case``'s samples."""
        return Spread.of(self.samples[case])

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "params": self.params,
            "samples": self.samples,
            "stats": {case: asdict(self.spread(case)) for case in self.samples},
            "roles": self.roles,
            "ratios": {
                name: {
                    "subject": r.subject,
                    "reference": r.reference,
                    "per_rep": list(r.per_rep),
                    "median": r.median,
                    "min": min(r.per_rep),
                    "max": max(r.per_rep),
                }
                for name, r in self.ratios.items()
            },
            "values": self.values,
            "pending": self.pending,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Row:
        return cls(
            label=d["label"],
            params=dict(d["params"]),
            samples={k: list(v) for k, v in d["samples"].items()},
            roles=dict(d["roles"]),
            ratios={
                name: RatioResult(r["subject"], r["reference"], tuple(r["per_rep"]))
                for name, r in d["ratios"].items()
            },
            values=dict(d["values"]),
            pending=d["pending"],
        )


@dataclass
class FigureResult:
    """What a figure's ``run(ctx)`` returns.

    Attributes:
        rows: the measured rows (peer baselines count: they are measured).
        pending: why the figure's own part is not measured yet (None: it is).
        notes: one-line remarks the table prints under the figure.
    """

    rows: list[Row] = field(default_factory=list)
    pending: str | None = None
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Check:
    """One bar judged on one row (or, when nothing was measured, on none)."""

    bar: str
    metric: str
    row: str | None
    value: float | None
    status: CheckStatus
    reason: str | None = None


@dataclass
class FigureRecord:
    """A figure's description, what it measured and how its bars fared."""

    id: str
    title: str
    peer: str
    bars: list[dict[str, Any]]
    status: str
    result: FigureResult
    checks: list[Check]
    elapsed_s: float
    error: str | None = None

    def bar_statuses(self) -> dict[str, str]:
        """Each bar's overall status: missed if any row missed it, met if every row met it."""
        out: dict[str, str] = {}
        for bar in self.bars:
            statuses = {c.status for c in self.checks if c.bar == bar["text"]}
            if MISSED in statuses:
                out[bar["text"]] = MISSED
            elif statuses == {MET}:
                out[bar["text"]] = MET
            else:
                out[bar["text"]] = NOT_MEASURED
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "title": self.title,
            "peer": self.peer,
            "bars": self.bars,
            "status": self.status,
            "pending": self.result.pending,
            "notes": self.result.notes,
            "error": self.error,
            "elapsed_s": self.elapsed_s,
            "checks": [asdict(c) for c in self.checks],
            "rows": [row.to_dict() for row in self.result.rows],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FigureRecord:
        result = FigureResult([Row.from_dict(r) for r in d["rows"]], d["pending"], list(d["notes"]))
        return cls(
            id=d["id"],
            title=d["title"],
            peer=d["peer"],
            bars=[dict(b) for b in d["bars"]],
            status=d["status"],
            result=result,
            checks=[Check(**c) for c in d["checks"]],
            elapsed_s=d["elapsed_s"],
            error=d["error"],
        )


@dataclass
class BenchResults:
    """One run of the harness: settings, machine, every figure."""

    created: str
    command: list[str]
    quick: bool
    repeats: int
    machine: dict[str, Any]
    versions: dict[str, str | None]
    git: dict[str, Any] | None
    figures: list[FigureRecord] = field(default_factory=list)

    def figure(self, figure_id: str) -> FigureRecord | None:
        return next((f for f in self.figures if f.id == figure_id), None)

    def summary(self) -> dict[str, Any]:
        """Bars counted by status, and the figures in each figure status."""
        bars = {MET: 0, MISSED: 0, NOT_MEASURED: 0}
        figures: dict[str, list[str]] = {}
        for record in self.figures:
            for status in record.bar_statuses().values():
                bars[status] += 1
            figures.setdefault(record.status, []).append(record.id)
        return {"bars": bars, "figures": figures}

    def summary_line(self) -> str:
        """The table's last line: bars met/missed/not measured yet, and which figures."""
        s = self.summary()
        bars, figures = s["bars"], s["figures"]
        parts = [
            f"{bars[MET]} bars met, {bars[MISSED]} missed, {bars[NOT_MEASURED]} not measured yet"
        ]
        for status in ("missed", "error", "met", "partial", "reported", NOT_MEASURED):
            if figures.get(status):
                parts.append(f"{status}: {' '.join(figures[status])}")
        return "summary: " + "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "created": self.created,
            "command": self.command,
            "quick": self.quick,
            "repeats": self.repeats,
            "machine": self.machine,
            "versions": self.versions,
            "git": self.git,
            "summary": {**self.summary(), "line": self.summary_line()},
            "figures": [f.to_dict() for f in self.figures],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BenchResults:
        if d.get("schema") != SCHEMA:
            raise ValueError(
                f"[bench] Not a {SCHEMA} results file (schema {d.get('schema')!r}); "
                f"rerun 'kvstore bench' to write one."
            )
        return cls(
            created=d["created"],
            command=list(d["command"]),
            quick=d["quick"],
            repeats=d["repeats"],
            machine=dict(d["machine"]),
            versions=dict(d["versions"]),
            git=d["git"],
            figures=[FigureRecord.from_dict(f) for f in d["figures"]],
        )

    def write(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``bench-results.json`` into ``directory`` (created if missing); its path."""
        path = Path(directory) / RESULTS_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> BenchResults:
        """Read a results file written by :meth:`write`."""
        return cls.from_dict(json.loads(Path(path).read_text()))
