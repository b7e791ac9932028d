"""``python -m tools.quality.options``: do the spec's TurboQuant options help values?

The fidelity study (``python -m tools.quality``) finds TurboQuant's next-token KL
on pycode-lm at 0.54x (4/4) and 0.50x (3/3) of affine of the same width against
a 0.5x bar, the remainder coming from values. This measures, on the same
windows and protocol (float32 model, 1024 prefill bytes, next 256 as one
chunk, KL(plain || family) per position), the options the spec allows for
values: the scale mode (``ls`` default, ``matched``, ``l2``), two RHT rounds,
and float32 scales -- each alone, against the defaults and affine in the
same run. Per family: next-token KL and its ratio to affine of the same
width, KL with only values through the family (keys exact), and values'
relative MSE on the prefill.

Writes ``results/options.json`` and ``results/options.md``. OpenBLAS makes it
~10x faster (BENCHMARKS.md "BLAS caveat").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from kvstore.caches import KVCache
from tools.quality.families import Family, OneSidedKVCache, through_cache
from tools.quality.metrics import Samples, kl_divergence, relmse
from tools.quality.pycode import _log_softmax, _run, load_pycode, recording_attention
from tools.quality.run import DEFAULT_MODEL, HERE

__all__ = ["OPTION_FAMILIES", "evaluate_options", "main"]


def _variants(bits: int) -> list[Family]:
    name = f"turboquant {bits}/{bits}"
    return [
        Family(name, bits, bits),
        Family(f"{name} V matched", bits, bits, value_scale_mode="matched"),
        Family(f"{name} V l2", bits, bits, value_scale_mode="l2"),
        Family(f"{name} 2 rounds", bits, bits, rounds=2),
        Family(f"{name} fp32 scales", bits, bits, scale_dtype="float32"),
    ]


#: Affine references, then each TurboQuant width with its defaults and one option changed.
OPTION_FAMILIES: tuple[Family, ...] = (
    Family("quant 4/64", 4, 4, group=64),
    Family("quant 3/64", 3, 3, group=64),
    *_variants(4),
    *_variants(3),
)


def evaluate_options(
    model_dir: Path,
    families: tuple[Family, ...] = OPTION_FAMILIES,
    windows: int = 8,
    prefill: int = 1024,
    continuation: int = 256,
    log: Any = print,
) -> dict[str, Any]:
    """Next-token KL (all and values only) and values' relMSE of each family on pycode-lm."""
    model, config, module, data, starts = load_pycode(model_dir, windows, prefill + continuation)
    head_dim, layers = int(config["head_dim"]), len(model.layers)
    span = prefill + continuation + 1
    samples = Samples()
    for w, start in enumerate(starts):
        tick = time.perf_counter()
        tokens = mx.array(data[start : start + span].astype(np.int32))
        pre, chunk = tokens[:prefill], tokens[prefill : prefill + continuation]
        caches = [KVCache() for _ in range(layers)]
        with recording_attention(module) as calls:
            model(pre[None], cache=caches)
        values = [call[2].astype(mx.float32) for call in calls[:layers]]
        logp0 = _log_softmax(model(chunk[None], cache=caches)[0])
        mx.eval(logp0, values)
        for fam in families:
            logp = _run(model, [fam.make(head_dim) for _ in range(layers)], pre, chunk)
            samples.add((fam.name, "kl"), kl_divergence(logp0, logp))
            one = _run(model, [OneSidedKVCache(fam, "v") for _ in range(layers)], pre, chunk)
            samples.add((fam.name, "kl_v_only"), kl_divergence(logp0, one))
            for v in values:
                samples.add(
                    (fam.name, "relmse_v"), relmse(v, through_cache(fam.make(head_dim), v, v)[1])
                )
        log(f"options window {w + 1}/{len(starts)} {time.perf_counter() - tick:.1f}s")
    out: dict[str, Any] = {}
    per_window = {
        fam.name: samples.values((fam.name, "kl")).reshape(len(starts), -1).mean(axis=1)
        for fam in families
    }
    for fam in families:
        reference = f"quant {fam.kbits}/64"
        default = f"turboquant {fam.kbits}/{fam.vbits}"
        kl, ref = samples.mean((fam.name, "kl")), samples.mean((reference, "kl"))
        out[fam.name] = {
            "kl_per_window": per_window[fam.name].tolist(),
            # Paired with the defaults window by window: is a difference more than the
            # protocol's sensitivity to any small change of the encoding?
            "windows_better_than_default": int(np.sum(per_window[fam.name] < per_window[default]))
            if default in per_window and not fam.is_affine
            else None,
            "signature": fam.signature(head_dim),
            "kl_mean": kl,
            "kl_vs_affine": kl / ref,
            "kl_v_only": samples.mean((fam.name, "kl_v_only")),
            "kl_v_only_vs_affine": samples.mean((fam.name, "kl_v_only"))
            / samples.mean((reference, "kl_v_only")),
            "relmse_v": samples.mean((fam.name, "relmse_v")),
        }
    return {"source": "pycode-lm", "windows": starts, "prefill": prefill, "families": out}


def render(report: dict[str, Any]) -> str:
    lines = [
        "# TurboQuant options for values on pycode-lm",
        "",
        f"Command: `{report['command']}` ({report['blas']}, {report['seconds']} s). "
        f"{len(report['windows'])} windows of {report['prefill']} prefill bytes + 256; "
        "ratios are to affine g64 of the same width in the same run (bar: <= 0.5).",
        "",
        "| family | next-token KL | vs affine | windows better than defaults "
        "| KL, values only | vs affine | relMSE V |",
        "|---|---|---|---|---|---|---|",
    ]
    windows = len(report["windows"])
    for name, f in report["families"].items():
        better = f["windows_better_than_default"]
        is_default = name == " ".join(name.split()[:2])  # "turboquant 4/4", no option
        paired = "" if better is None or is_default else f"{better}/{windows}"
        lines.append(
            f"| {name} | {f['kl_mean']:.4f} | {f['kl_vs_affine']:.3f} | {paired} "
            f"| {f['kl_v_only']:.4f} | {f['kl_v_only_vs_affine']:.3f} | {f['relmse_v']:.5f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.quality.options", description=__doc__)
    parser.add_argument(
        "--model-dir", type=Path, default=Path(os.environ.get("PYCODE_LM", DEFAULT_MODEL))
    )
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args(argv)
    mx.set_default_device(mx.cpu)
    started = time.perf_counter()
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    report = evaluate_options(args.model_dir, windows=args.windows, log=log)
    report["command"] = "python -m tools.quality.options" + (
        "" if argv is None else " " + " ".join(argv)
    )
    report["blas"] = (
        "OpenBLAS (LD_PRELOAD)" if "openblas" in os.environ.get("LD_PRELOAD", "") else "MLX bundled"
    )
    report["seconds"] = round(time.perf_counter() - started, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "options.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "options.md").write_text(render(report))
    print(render(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
