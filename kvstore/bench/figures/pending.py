"""Figures whose parts are not on main yet: listed with their bars, measured later.

Each becomes a module of its own (like :mod:`.restore`) when its part
lands, and its line in :data:`kvstore.bench.figures.FIGURES` points there.
"""

from __future__ import annotations

from kvstore.bench.figures.common import pending_figure
from kvstore.bench.harness import at_least, at_most

__all__ = ["P4", "P5", "P6", "P8", "P10", "P11"]

_STORE = "needs the LMDB prefix store (kvstore.store, issue 5)"

P4 = pending_figure(
    "P4",
    "lookup latency, 32k-token prompt, store holding >= 100k blocks (1k/8k/32k tokens)",
    "none (absolute median)",
    (at_most("lookup ms", 2.0, unit=" ms"),),
    _STORE,
)
P5 = pending_figure(
    "P5",
    "TTFT with 4032 of 4096 prompt tokens stored vs full prefill, reference model",
    "full prefill of the same prompt",
    (at_least("vs full prefill", 20.0),),
    "needs the reference model (kvstore.model, issue 4) and the prefix store (issue 5)",
)
P6 = pending_figure(
    "P6",
    "stored bytes, 64 sessions sharing a 2048-token prefix + 256 own tokens each",
    "the unique tokens' bytes; the 64 mlx-lm prompt-cache files of the same sessions",
    (at_most("vs unique bytes", 1.05),),
    _STORE,
)
P8 = pending_figure(
    "P8",
    "2 processes restoring concurrently from one LMDB store",
    "1 process",
    (at_least("aggregate vs 1 process", 1.6),),
    _STORE,
)
P10 = pending_figure(
    "P10",
    "store open time with 100k blocks stored",
    "open with 10 blocks stored",
    (at_most("open 100k vs 10", 2.0),),
    _STORE,
)
P11 = pending_figure(
    "P11",
    "TurboQuant encode / decode throughput",
    "mx.quantize / mx.dequantize 4-bit g64 on the same tensors",
    (at_least("encode vs mx.quantize", 0.5), at_least("decode vs mx.dequantize", 0.5)),
    "needs the TurboQuant family (issue 7)",
)
