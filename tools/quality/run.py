"""``python -m tools.quality``: the TurboQuant fidelity study on real K/V.

Writes ``results/quality.json`` (every figure) and ``results/quality.md``
(the table and the gates). Needs the ``mlx-lm`` and ``quality`` extras
(``pip install -e '.[quality]'``); preloading OpenBLAS makes it ~10x faster
(BENCHMARKS.md "BLAS caveat").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import mlx.core as mx

import kvstore
from tools.quality.families import FAMILIES
from tools.quality.metrics import level0_relmse
from tools.quality.report import CENTER_RECOMMENDED, check_gates, gates_json, render_markdown

HERE = Path(__file__).resolve().parent
DEFAULT_MODEL = Path(__file__).resolve().parents[3] / "shared" / "fixtures" / "pycode-lm"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.quality", description=__doc__)
    parser.add_argument(
        "--model-dir", type=Path, default=Path(os.environ.get("PYCODE_LM", DEFAULT_MODEL))
    )
    parser.add_argument("--windows", type=int, default=8, help="pycode-lm windows (>= 4)")
    parser.add_argument("--minilm-windows", type=int, default=8)
    parser.add_argument(
        "--sources", default="pycode,minilm", help="comma-separated: pycode, minilm"
    )
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument(
        "--render", action="store_true", help="only rewrite quality.md from quality.json"
    )
    args = parser.parse_args(argv)
    if args.render:
        saved = json.loads((args.out / "quality.json").read_text())
        (args.out / "quality.md").write_text(render_markdown(saved))
        return 0
    mx.set_default_device(mx.cpu)
    sources = set(args.sources.split(","))
    started = time.perf_counter()
    report: dict = {
        "command": "python -m tools.quality" + ("" if argv is None else " " + " ".join(argv)),
        "kvstore": kvstore.__version__,
        "mlx": mx.__version__,
        "blas": "OpenBLAS (LD_PRELOAD)"
        if "openblas" in os.environ.get("LD_PRELOAD", "")
        else "MLX bundled",
    }
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    if "pycode" in sources:
        from tools.quality.pycode import evaluate_pycode

        report["pycode"] = evaluate_pycode(args.model_dir, FAMILIES, windows=args.windows, log=log)
    if "minilm" in sources:
        from tools.quality.minilm import evaluate_minilm

        text = (args.model_dir / "heldout.txt").read_bytes()
        report["minilm"] = evaluate_minilm(text, FAMILIES, windows=args.minilm_windows, log=log)
    results = [report[s] for s in ("pycode", "minilm") if s in report]
    report["level0"] = {
        f"{kind}{bits}@{r['head_dim']}": level0_relmse(bits, r["head_dim"], kind)
        for r in results
        for kind in ("k", "v")
        for bits in (2, 3, 4)
    }
    gates = [g for r in results for g in check_gates(r, report["level0"])]
    report["gates"] = gates_json(gates)
    report["center_recommended"] = {
        r["source"]: max(r["layer_stats"]["mean_to_spread"]) > CENTER_RECOMMENDED for r in results
    }
    report["seconds"] = round(time.perf_counter() - started, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quality.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "quality.md").write_text(render_markdown(report))
    failed = [g for g in gates if not g.passed]
    print(
        f"{len(gates) - len(failed)} passed, {len(failed)} failed gates; "
        f"wrote {args.out / 'quality.md'} in {report['seconds']}s"
    )
    for g in failed:
        print(f"  FAIL [{g.source}] {g.name}: {g.detail}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
