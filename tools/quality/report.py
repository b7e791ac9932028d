"""The gates (Level 1 of specs/turboquant.md, BENCHMARKS.md "Fidelity") and the tables."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["Gate", "check_gates", "render_markdown"]

#: A layer "has outlier channels" when its max/median channel magnitude reaches this.
OUTLIER_RATIO = 4.0
#: Level 1: TurboQuant relMSE within this of the Level-0 value for the same b and D.
LEVEL1_TOLERANCE = 0.15
#: Spec: mark ``center`` as recommended when ||mu|| / RMS(k - mu) exceeds this.
CENTER_RECOMMENDED = 3.0

# BENCHMARKS.md fidelity table (relMSE centre for the +-15% band, cosine floor,
# KL ceiling as a ratio to the affine family of the same width).
BENCH_TQ = {
    "turboquant 4/4": (0.0093, 0.995, "quant 4/64"),
    "turboquant 3/3": (0.034, 0.98, "quant 3/64"),
    "turboquant 2/2": (0.116, 0.91, "quant 2/64"),
}
# specs/turboquant.md Level 2 (attention-output cosine, attention KL).
SPEC_COS = {"turboquant 4/3": 0.987}
SPEC_ATTN_KL = {"quant 8/64": 0.001, "turboquant 4/4": 0.03, "turboquant 3/3": 0.12}


@dataclass(frozen=True)
class Gate:
    source: str
    name: str
    passed: bool
    detail: str


def _tq_families(results: dict[str, Any]) -> list[tuple[str, int, int]]:
    out = []
    for name in results["families"]:
        if name.startswith("turboquant") and "center" not in name:
            k, v = name.split()[1].split("/")
            out.append((name, int(k), int(v)))
    return out


def check_gates(source: dict[str, Any], level0: dict[str, float]) -> list[Gate]:
    """Every gate that applies to one source's results."""
    fams, src = source["families"], source["source"]
    d = source["head_dim"]
    gates: list[Gate] = []
    # Level 1: per layer and kind, within +-15% of Level 0 (same b, D, scale mode).
    for name, kbits, vbits in _tq_families(source):
        for kind, bits in (("k", kbits), ("v", vbits)):
            ref = level0[f"{kind}{bits}@{d}"]
            per_layer = fams[name]["per_layer"][f"relmse_{kind}"]
            worst = max(per_layer, key=lambda r: abs(r / ref - 1))
            gates.append(
                Gate(
                    src,
                    f"L1 {name} relMSE {kind.upper()} within ±15% of Level 0",
                    abs(worst / ref - 1) <= LEVEL1_TOLERANCE,
                    f"worst layer {worst:.5f} vs Level 0 {ref:.5f} ({worst / ref - 1:+.1%})",
                )
            )
    # Level 1: TurboQuant b-bit beats affine b-bit on keys, every outlier layer.
    outliers = [
        i for i, r in enumerate(source["layer_stats"]["outlier_ratio"]) if r >= OUTLIER_RATIO
    ]
    for bits in (4, 3, 2):
        tq, affine = fams.get(f"turboquant {bits}/{bits}"), fams.get(f"quant {bits}/64")
        if tq is None or affine is None:
            continue
        if not outliers:
            gates.append(
                Gate(
                    src,
                    f"L1 tq{bits} key relMSE < {affine['signature']}",
                    True,
                    f"no layer with outlier ratio >= {OUTLIER_RATIO} (not applicable)",
                )
            )
            continue
        t = [tq["per_layer"]["relmse_k"][i] for i in outliers]
        a = [affine["per_layer"]["relmse_k"][i] for i in outliers]
        gates.append(
            Gate(
                src,
                f"L1 tq{bits} key relMSE < {affine['signature']} on outlier layers {outliers}",
                all(x < y for x, y in zip(t, a)),
                "tq "
                + ", ".join(f"{x:.4f}" for x in t)
                + " vs affine "
                + ", ".join(f"{y:.4f}" for y in a),
            )
        )
    # BENCHMARKS fidelity table.
    q8 = fams.get("quant 8/64")
    if q8 is not None:
        worst = max(q8["relmse_k"], q8["relmse_v"])
        gates.append(Gate(src, "quant 8/64 relMSE <= 1e-4", worst <= 1e-4, f"{worst:.2e}"))
        gates.append(
            Gate(
                src,
                "quant 8/64 attention cosine median >= 0.9999",
                q8["cos_median"] >= 0.9999,
                f"{q8['cos_median']:.6f}",
            )
        )
        if "kl_mean" in q8:
            gates.append(
                Gate(
                    src,
                    "quant 8/64 next-token KL <= 0.001",
                    q8["kl_mean"] <= 0.001,
                    f"{q8['kl_mean']:.5f}",
                )
            )
    q4 = fams.get("quant 4/64")
    if q4 is not None:
        gates.append(
            Gate(
                src,
                "quant 4/64 attention cosine median >= 0.99",
                q4["cos_median"] >= 0.99,
                f"{q4['cos_median']:.5f}",
            )
        )
    for name, (centre, cos_floor, peer) in BENCH_TQ.items():
        fam = fams.get(name)
        if fam is None:
            continue
        if d == 128:  # the BENCHMARKS band is the D=128 table value
            for kind in ("k", "v"):
                r = fam[f"relmse_{kind}"]
                gates.append(
                    Gate(
                        src,
                        f"{name} relMSE {kind.upper()} {centre} ± 15%",
                        abs(r / centre - 1) <= LEVEL1_TOLERANCE,
                        f"{r:.5f} ({r / centre - 1:+.1%})",
                    )
                )
        gates.append(
            Gate(
                src,
                f"{name} attention cosine median >= {cos_floor}",
                fam["cos_median"] >= cos_floor,
                f"{fam['cos_median']:.5f}",
            )
        )
        if "kl_mean" in fam and peer in fams:
            ratio = fam["kl_mean"] / fams[peer]["kl_mean"]
            gates.append(
                Gate(
                    src,
                    f"{name} next-token KL <= 0.5 x {peer}",
                    ratio <= 0.5,
                    f"{fam['kl_mean']:.4f} vs {fams[peer]['kl_mean']:.4f} (ratio {ratio:.2f})",
                )
            )
    for name, floor in SPEC_COS.items():
        if name in fams:
            gates.append(
                Gate(
                    src,
                    f"spec L2 {name} attention cosine median >= {floor}",
                    fams[name]["cos_median"] >= floor,
                    f"{fams[name]['cos_median']:.5f}",
                )
            )
    for name, ceiling in SPEC_ATTN_KL.items():
        if name in fams:
            gates.append(
                Gate(
                    src,
                    f"spec L2 {name} attention KL <= {ceiling}",
                    fams[name]["attn_kl_mean"] <= ceiling,
                    f"{fams[name]['attn_kl_mean']:.5f}",
                )
            )
    return gates


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


Column = tuple[str, Callable[[dict[str, Any]], str]]
#: Columns every source has, then those only a causal LM has.
KV_COLUMNS: list[Column] = [
    ("signature", lambda f: f"`{f['signature']}`"),
    ("relMSE K", lambda f: f"{f['relmse_k']:.5f}"),
    ("relMSE V", lambda f: f"{f['relmse_v']:.5f}"),
    ("attn cos median", lambda f: f"{f['cos_median']:.5f}"),
    ("attn cos p5", lambda f: f"{f['cos_p5']:.5f}"),
    ("attn KL", lambda f: f"{f['attn_kl_mean']:.5f}"),
]
NEXT_TOKEN_COLUMNS: list[Column] = [
    ("next-token KL mean", lambda f: f"{f['kl_mean']:.4f}"),
    ("KL p95", lambda f: f"{f['kl_p95']:.4f}"),
    ("top-1", lambda f: f"{f['top1']:.2%}"),
    ("ΔPPL", lambda f: f"{f['delta_ppl']:+.2%}"),
    ("bytes/token", lambda f: str(f["bytes_per_token"])),
    ("× bf16", lambda f: f"{f['x_bf16']:.3f}"),
]

ATTRIBUTION_COLUMNS: list[Column] = [
    ("next-token KL, K only", lambda f: f"{f['kl_k_only']:.4f}"),
    ("V only", lambda f: f"{f['kl_v_only']:.4f}"),
    ("both", lambda f: f"{f['kl_mean']:.4f}"),
    ("attn cos median, K only", lambda f: f"{f['cos_k_only_median']:.5f}"),
    ("V only", lambda f: f"{f['cos_v_only_median']:.5f}"),
    ("both", lambda f: f"{f['cos_median']:.5f}"),
]


def _table(families: dict[str, dict[str, Any]], columns: list[Column]) -> list[str]:
    """A markdown table: one row per family, one column per ``(header, format)``."""
    rows = [_row(["family", *(h for h, _ in columns)]), _row(["---"] * (1 + len(columns)))]
    for name, f in families.items():
        rows.append(_row([name, *(fmt(f) for _, fmt in columns)]))
    return rows


def render_markdown(report: dict[str, Any]) -> str:
    """The committed table: one section per source, then per-layer keys, then gates."""
    lines = [
        "# TurboQuant fidelity on real K/V",
        "",
        f"Generated by `{report['command']}` (kvstore {report['kvstore']}, mlx {report['mlx']}, "
        f'BLAS: {report["blas"]}). Definitions: `specs/turboquant.md` "Quality metrics"; '
        'protocol and bars: `BENCHMARKS.md` "Fidelity".',
        "",
    ]
    py = report.get("pycode")
    if py:
        lines += [
            f"## pycode-lm (trained byte-level Llama, {py['layers']} layers, "
            f"{py['kv_heads']} KV heads, head_dim {py['head_dim']})",
            "",
            f"Float32 model; {len(py['windows'])} held-out windows, each: prefill "
            f"{py['prefill']} bytes with the cache under test, then {py['continuation']} bytes "
            "as one chunk; KL(plain ‖ test) per position of that chunk. K/V/attention "
            "metrics on each window's prefill K/V "
            "(post-RoPE keys, as the cache stores them). Bytes per token: all layers, K and V, "
            f"stored encoding (bf16: {py['bf16_bytes_per_token']} B).",
            "",
            *_table(py["families"], KV_COLUMNS + NEXT_TOKEN_COLUMNS),
        ]
        lines += [
            "",
            "Per layer (keys, means over windows): channel outlier ratio (max/median mean |k|), "
            "‖μ‖/RMS(k − μ), ‖k − μ‖²/‖k‖² on the continuation's keys with μ estimated as "
            "`center` does (first 512 prefill tokens; > 1: centering adds error there), key "
            "relMSE; informative key error ‖k − k̂‖²/‖k − μ‖² in brackets.",
            "",
        ]
        names = [n for n in py["families"] if n != "quant 8/64"]
        lines.append(_row(["layer", "outlier ratio", "‖μ‖/RMS", "late ‖k − μ‖²/‖k‖²", *names]))
        lines.append(_row(["---"] * (4 + len(names))))
        stats = py["layer_stats"]
        for i in range(py["layers"]):
            cells = [
                str(i),
                f"{stats['outlier_ratio'][i]:.1f}",
                f"{stats['mean_to_spread'][i]:.2f}",
                f"{stats['centred_late_ratio'][i]:.2f}",
            ]
            for n in names:
                pl = py["families"][n]["per_layer"]
                cells.append(f"{pl['relmse_k'][i]:.4f} [{pl['k_informative'][i]:.4f}]")
            lines.append(_row(cells))
        lines.append("")
    if py and any("kl_k_only" in f for f in py["families"].values()):
        attributed = {n: f for n, f in py["families"].items() if "kl_k_only" in f}
        lines += [
            "Where the error comes from: the same runs with only the keys, or only the values, "
            "through the family (the other side exact). Median of the largest attention weight "
            f"per query: {py['attention_peak_median']:.3f} (1 = all weight on one key).",
            "",
            *_table(attributed, ATTRIBUTION_COLUMNS),
            "",
        ]
    ml = report.get("minilm")
    if ml:
        lines += [
            f"## all-MiniLM-L6-v2 (trained BERT encoder, {ml['layers']} layers, "
            f"{ml['heads']} heads, head_dim {ml['head_dim']})",
            "",
            f"{ml['windows']} windows of {ml['tokens_per_window']} tokens of held-out text; "
            "bidirectional attention. Affine groups are 32 (64 does not fit D=32). "
            "Encoder checked against "
            f"sentence-transformers: {_check_text(ml['reference_check'])}.",
            "",
            *_table(ml["families"], KV_COLUMNS),
        ]
        lines += [
            "",
            "Key channel outlier ratio per layer: "
            + ", ".join(f"{r:.1f}" for r in ml["layer_stats"]["outlier_ratio"]),
            "",
        ]
    lines += [
        "## Level 0 references (random unit vectors, the default scale mode of each kind)",
        "",
    ]
    lines.append(", ".join(f"{k} {v:.5f}" for k, v in report["level0"].items()))
    lines += ["", "## Gates", ""]
    lines.append(_row(["source", "gate", "result", "measured"]))
    lines.append(_row(["---"] * 4))
    for g in report["gates"]:
        lines.append(
            _row([g["source"], g["name"], "PASS" if g["passed"] else "**FAIL**", g["detail"]])
        )
    recommend = report.get("center_recommended", {})
    lines += [
        "",
        "Key mean-centering recommended (spec: some layer with ‖μ‖/RMS(k − μ) > 3): "
        + ", ".join(f"{k}: {'yes' if v else 'no'}" for k, v in recommend.items()),
        "",
    ]
    return "\n".join(lines) + "\n"


def _check_text(check: dict[str, Any]) -> str:
    if not check.get("ran"):
        return f"not run ({check.get('reason')})"
    return f"minimum embedding cosine {check['min_cosine']:.6f}"


def gates_json(gates: list[Gate]) -> list[dict[str, Any]]:
    return [asdict(g) for g in gates]
