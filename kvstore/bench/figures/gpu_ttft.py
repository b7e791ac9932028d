"""G1 and G2: warm TTFT from the store, in a fresh process, against the cold prefill.

G1 (lossless), per prompt length (4096 and 16384 tokens), side by side:

* ``cold``: the full prefill (chunks of 2048) to the last token's logits, timed
  in this process after a warm-up;
* ``warm (ours)``: a fresh process (:mod:`~kvstore.bench.figures.gpu_session`)
  looks the prompt up in an LMDB store holding its KV, restores the
  ``tokens - 1`` stored tokens and computes the last one's logits;
* ``warm (mlx-lm)``: the same with mlx-lm's ``load_prompt_cache`` of the file its
  ``save_prompt_cache`` wrote.

G2, at 4096 tokens: ``warm (ours)`` from stores whose storage policy is
``kv:quant:8:64``, ``kv:quant:4:64``, ``kv:turboquant:4:4``, ``kv:turboquant:3:3``
(decoded into the model's plain caches), with the lossless restore and each
store's bytes in the same run.

Every session checks its logits against the cold prefill's (the argmax, and
the largest difference: a restore bit-exact to the prefill leaves only the
difference between a chunked prefill and one step). Bars (BENCHMARKS.md): G1
warm/cold <= 0.5 at both lengths; G2 q8 <= 0.35, TQ 4/4 <= 0.3, and every
lossy policy restores faster than lossless.
"""

from __future__ import annotations

import os
import statistics
from typing import Any

from kvstore.bench.figures import gpu_common as G
from kvstore.bench.figures.common import MIB
from kvstore.bench.harness import BenchContext, Figure, at_least, at_most
from kvstore.bench.results import FigureResult, Row

__all__ = ["G1", "G2", "POLICIES"]

POLICIES = ("kv:quant:8:64", "kv:quant:4:64", "kv:turboquant:4:4", "kv:turboquant:3:3")
#: Narrows G2's lossy policies (``kv:quant:8:64,kv:quant:4:64``, say): five fresh
#: sessions of each policy and of lossless outlast one device call (about 18 s a
#: session on the H200 at e2e0be6), so a run there takes them in two calls.
POLICIES_ENV = "KVSTORE_BENCH_G2_POLICIES"
#: Adds G1 rows whose sessions compute the prompt's last N tokens after restoring the
#: rest (``45``, say, or ``1,45``; the default, 1, is G1 as BENCHMARKS.md defines it):
#: a new question after a stored conversation. Those sessions warm up as ``kvstore
#: serve`` does, not at the timed shapes, which a server meets for the first time; the
#: bar judges only the rows of 1.
SUFFIX_ENV = "KVSTORE_BENCH_G1_SUFFIX"
WARM, COLD, PEER = "warm (ours)", "cold", "warm (mlx-lm)"
RATIO = "warm/cold"
FASTER = "lossless/this time"


def _median(samples: list[float]) -> float:
    return statistics.median(samples)


def _session_values(prefix: str, sessions: list[G.Session]) -> dict[str, float]:
    return {
        f"{prefix} lookup ms": _median([s.lookup_s for s in sessions]) * 1e3,
        f"{prefix} restore ms": _median([s.restore_s for s in sessions]) * 1e3,
        f"{prefix} forward ms": _median([s.forward_s for s in sessions]) * 1e3,
        # The restoring thread's own CPU time: what of the restore was its Python.
        f"{prefix} restore cpu ms": _median(
            [s.detail.get("restore_cpu_s", float("nan")) for s in sessions]
        )
        * 1e3,
        f"{prefix} max |logit diff|": max(s.max_abs_diff for s in sessions),
        f"{prefix} argmax agrees": float(all(s.argmax_equal for s in sessions)),
    }


def _check(sessions: list[G.Session], tokens: int, suffix: int = 1) -> None:
    short = [s.restored for s in sessions if s.restored != tokens - suffix]
    if short:
        raise AssertionError(f"[bench] a session restored {short[0]} of {tokens - suffix} tokens")


def _pending(ctx: BenchContext) -> str | None:
    return None if ctx.quick or G.on_gpu() else G.NEEDS_GPU


def run_g1(ctx: BenchContext) -> FigureResult:
    pending = _pending(ctx)
    if pending:
        return FigureResult(pending=pending)
    rows = []
    # The longest first: G2 then finds the 4096-token setup still prepared.
    for tokens, suffix in [
        (t, s) for t in sorted(G.prompt_lengths(ctx), reverse=True) for s in g1_suffixes()
    ]:
        setup = G.setup_for(ctx, tokens)
        setup.prepare()
        tail = "" if suffix == 1 else f" +{suffix}"
        ours = setup.run_sessions("lossless" + tail, "ours", suffix=suffix)
        peer = setup.run_sessions("mlx-lm" + tail, "mlx-lm", suffix=suffix)
        _check(ours, tokens, suffix)
        samples = {
            COLD: setup.cold,
            WARM: [s.total_s for s in ours],
            PEER: [s.total_s for s in peer],
        }
        cold = _median(setup.cold)
        values = {
            RATIO: _median(samples[WARM]) / cold,
            "mlx-lm warm/cold": _median(samples[PEER]) / cold,
            "ours vs mlx-lm": _median(samples[PEER]) / _median(samples[WARM]),
            **_session_values("ours", ours),
            **_session_values("mlx-lm", peer),
        }
        params = {"tokens": tokens, "suffix": suffix, "mib": setup.kv_bytes / MIB}
        params["staging"] = ours[0].staging
        roles = {COLD: "peer", WARM: "ours", PEER: "peer"}
        rows.append(Row(f"llama8b {tokens}{tail}", params, samples, roles, values=values))
    rows.sort(key=lambda r: (r.params["tokens"], r.params["suffix"]))
    return FigureResult(rows, notes=_notes(ctx))


def run_g2(ctx: BenchContext) -> FigureResult:
    pending = _pending(ctx)
    if pending:
        return FigureResult(pending=pending)
    tokens = min(G.prompt_lengths(ctx))
    setup = G.setup_for(ctx, tokens)
    setup.prepare()
    lossless = setup.run_sessions("lossless", "ours")
    reference = _median([s.total_s for s in lossless])
    cold = _median(setup.cold)
    rows = []
    for policy in ("lossless", *lossy_policies()):
        sessions = setup.run_sessions(policy, "ours", policy)
        _check(sessions, tokens)
        warm = [s.total_s for s in sessions]
        values: dict[str, Any] = {
            RATIO: _median(warm) / cold,
            FASTER: reference / _median(warm),
            "stored MiB": setup.stored_bytes[policy] / MIB,
            "bytes vs lossless": setup.stored_bytes[policy] / setup.stored_bytes["lossless"],
            **_session_values("ours", sessions),
        }
        # Each policy's figure as it is measured: G2 writes its results only at its end,
        # and a device call that runs out first would otherwise leave nothing.
        ctx.log(
            f"  {policy}: warm/cold {values[RATIO]:.4f}, restore "
            f"{values['ours restore ms']:.2f} ms, lossless/this {values[FASTER]:.3f}"
        )
        params = {"tokens": tokens, "policy": policy, "lossy": policy != "lossless"}
        rows.append(
            Row(
                f"llama8b {tokens} {policy}",
                params,
                {COLD: setup.cold, WARM: warm},
                {COLD: "peer", WARM: "ours"},
                values=values,
            )
        )
    return FigureResult(rows, notes=_notes(ctx))


def g1_suffixes() -> tuple[int, ...]:
    """G1's suffixes: 1, or those :data:`SUFFIX_ENV` names."""
    named = os.environ.get(SUFFIX_ENV, "1")
    try:
        chosen = tuple(int(n) for n in named.split(",") if n.strip())
    except ValueError:
        chosen = ()
    if not chosen or min(chosen) < 1:
        raise ValueError(
            f"[bench] {SUFFIX_ENV}={named!r}: expected token counts of 1 or more, "
            f"comma-separated (1 is G1 as defined; 45 a new question after a restore)."
        )
    return chosen


def lossy_policies() -> tuple[str, ...]:
    """G2's lossy policies: :data:`POLICIES`, or those :data:`POLICIES_ENV` names."""
    named = os.environ.get(POLICIES_ENV)
    if not named:
        return POLICIES
    chosen = tuple(p.strip() for p in named.split(",") if p.strip())
    unknown = [p for p in chosen if p not in POLICIES]
    if unknown or not chosen:
        raise ValueError(
            f"[bench] {POLICIES_ENV}={named!r} names {', '.join(unknown) or 'no policy'}; "
            f"G2 measures {', '.join(POLICIES)}: name some of those, comma-separated."
        )
    return chosen


def _notes(ctx: BenchContext) -> list[str]:
    env = G.environment()
    notes = [f"device {env.get('gpu') or env['device']}, CUDA staging {env['cuda_staging']}"]
    if env["settings"]:
        notes.append("settings: " + " ".join(f"{k}={v}" for k, v in env["settings"].items()))
    if ctx.quick:
        notes.append("--quick: a tiny model and 300 tokens (a smoke run; the bars are for a GPU)")
    return notes


G1 = Figure(
    "G1",
    "warm TTFT from the store (fresh process, lossless) vs cold prefill, llama-8B shape",
    "the cold prefill (chunks of 2048); mlx-lm save_prompt_cache/load_prompt_cache + the "
    "same forward",
    (at_most(RATIO, 0.5, where={"suffix": 1}, unit=""),),
    run_g1,
)

G2 = Figure(
    "G2",
    "warm TTFT with lossy storage policies (fresh process), llama-8B shape, 4096 tokens",
    "the cold prefill; the lossless restore",
    (
        at_most(RATIO, 0.35, where={"policy": "kv:quant:8:64"}, unit=""),
        at_most(RATIO, 0.3, where={"policy": "kv:turboquant:4:4"}, unit=""),
        at_least(FASTER, 1.0, where={"lossy": True}),
    ),
    run_g2,
)
