"""Speculative decoding with prompt-lookup drafting on pycode-lm's held-out text.

For each of ``--windows`` windows of ``heldout.txt`` (the ``json/`` and
``email/`` packages, unseen in training): prefill ``--prompt`` bytes, then
generate ``--tokens`` bytes greedily, once without drafts and once with
prompt-lookup drafting for each ``num_draft_tokens`` in ``--gamma``,
interleaved, ``--repeats`` times each, in one process. The model is cast to
float32, as in BENCHMARKS.md's fidelity protocol (MLX's CPU backend has no
bfloat16 GEMM, so a multi-token forward in bfloat16 costs many one-token
ones). Reported per setting: draft tokens proposed and accepted, the
acceptance rate, the target forwards of the decode and tokens per target
forward (counts: the same on every machine), and the decode time relative to
the plain run of the same window and repetition (the median ratio;
BENCHMARKS.md: ratios side by side, never absolute times). Every speculative
run's tokens are checked equal to the plain run's (greedy output is exactly
the same).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        .venv/bin/python -m tools.bench.speculative

Writes ``tools/bench/results/speculative.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from kvstore.bench.machine import blas_info
from kvstore.model import generate_tokens, load_model

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT.parent / "shared" / "fixtures" / "pycode-lm"
RESULTS = Path(__file__).resolve().parent / "results"


def windows(text: bytes, count: int, prompt: int, tokens: int) -> list[np.ndarray]:
    """``count`` prompts of ``prompt`` bytes, evenly spaced over the held-out text."""
    span = prompt + tokens
    starts = np.linspace(0, len(text) - span, count).astype(int)
    return [np.frombuffer(text[s : s + prompt], dtype=np.uint8).astype(np.int64) for s in starts]


def run(args: argparse.Namespace) -> dict[str, Any]:
    model, _ = load_model(MODEL_DIR, dtype=mx.float32 if args.float32 else None)
    text = (MODEL_DIR / "heldout.txt").read_bytes()
    prompts = windows(text, args.windows, args.prompt, args.tokens)
    settings = [None, *args.gamma]
    samples: dict[str, list[dict[str, Any]]] = {str(g): [] for g in settings}
    for w, prompt in enumerate(prompts):
        generate_tokens(model, prompt, max_tokens=8)  # warm-up (kernels, allocator)
        for rep in range(args.repeats):
            plain_tokens = None
            for gamma in settings:
                kwargs: dict[str, Any] = {"max_tokens": args.tokens}
                if gamma is not None:
                    kwargs.update(draft="prompt-lookup", num_draft_tokens=gamma)
                t0 = time.perf_counter()
                out, stats = generate_tokens(model, prompt, **kwargs)
                wall = time.perf_counter() - t0
                if gamma is None:
                    plain_tokens = out
                elif out != plain_tokens:
                    raise RuntimeError(f"[speculative] window {w}: greedy output differs")
                samples[str(gamma)].append(
                    {
                        "window": w,
                        "repeat": rep,
                        "decode_s": stats.decode_s,
                        "wall_s": wall,
                        "generated": stats.generated_tokens,
                        "target_forwards": stats.target_forwards,
                        "draft_tokens": stats.draft_tokens,
                        "accepted_tokens": stats.accepted_tokens,
                    }
                )
    return {"samples": samples, "settings": [str(g) for g in settings]}


def summarise(raw: dict[str, Any]) -> list[dict[str, Any]]:
    plain = {(s["window"], s["repeat"]): s for s in raw["samples"]["None"]}
    rows = []
    for name in raw["settings"]:
        runs = raw["samples"][name]
        # Counts are deterministic: one repetition per window carries them.
        first = [s for s in runs if s["repeat"] == 0]
        drafted = sum(s["draft_tokens"] for s in first)
        accepted = sum(s["accepted_tokens"] for s in first)
        forwards = sum(s["target_forwards"] for s in first)
        generated = sum(s["generated"] - 1 for s in first)
        ratios = [s["decode_s"] / plain[(s["window"], s["repeat"])]["decode_s"] for s in runs]
        rows.append(
            {
                "gamma": None if name == "None" else int(name),
                "draft_tokens": drafted,
                "accepted_tokens": accepted,
                "acceptance_rate": accepted / drafted if drafted else 0.0,
                "target_forwards": forwards,
                "tokens_per_target_forward": generated / forwards if forwards else 0.0,
                "decode_time_vs_plain": statistics.median(ratios),
                "speedup": 1 / statistics.median(ratios),
            }
        )
    return rows


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        "# Speculative decoding, prompt-lookup drafting, pycode-lm held-out text",
        "",
        f"{meta['windows']} windows of `heldout.txt`, {meta['prompt']}-byte prompts, "
        f"{meta['tokens']} greedy tokens each, {meta['repeats']} interleaved repetitions; "
        f"dtype {meta['dtype']}; BLAS: {meta['blas']}; git {meta['git']}; {meta['machine']}.",
        "Greedy output with drafts was checked equal to the plain run's in every run.",
        "",
        "| num_draft_tokens | drafted | accepted | acceptance | target forwards "
        "| tokens / forward | decode time vs plain (median) | speed-up |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        gamma = "— (plain)" if r["gamma"] is None else str(r["gamma"])
        lines.append(
            f"| {gamma} | {r['draft_tokens']} | {r['accepted_tokens']} | "
            f"{r['acceptance_rate']:.1%} | {r['target_forwards']} | "
            f"{r['tokens_per_target_forward']:.2f} | {r['decode_time_vs_plain']:.2f}x | "
            f"{r['speedup']:.2f}x |"
        )
    lines += ["", f"Reproduce: `{meta['command']}`", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=6)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--gamma", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument(
        "--stored-dtype",
        dest="float32",
        action="store_false",
        help="keep pycode-lm's bfloat16 (MLX's CPU has no bfloat16 GEMM: a multi-token "
        "forward costs many one-token ones there, so drafts cannot pay off)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    mx.set_default_device(mx.cpu)
    raw = run(args)
    rows = summarise(raw)
    git = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    meta = {
        "windows": args.windows,
        "prompt": args.prompt,
        "tokens": args.tokens,
        "repeats": args.repeats,
        "dtype": "float32" if args.float32 else "bfloat16 (stored)",
        "blas": blas_info()["mlx"],
        "git": git,
        "machine": f"{platform.machine()} {platform.processor() or ''} Python "
        f"{platform.python_version()}".strip(),
        "command": "LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 "
        ".venv/bin/python -m tools.bench.speculative" + ("" if args.float32 else " --stored-dtype"),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "speculative.json").write_text(
        json.dumps({"meta": meta, "rows": rows, **raw}, indent=1)
    )
    text = markdown(rows, meta)
    (args.out / "speculative.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
