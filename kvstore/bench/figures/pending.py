"""Figures whose parts are not on main yet: listed with their bars, measured later.

Each becomes a module of its own (like :mod:`.restore`) when its part
lands, and its line in :data:`kvstore.bench.figures.FIGURES` points there.
"""

from __future__ import annotations

from kvstore.bench.figures.common import pending_figure
from kvstore.bench.harness import at_least

__all__ = ["P11"]

P11 = pending_figure(
    "P11",
    "TurboQuant encode / decode throughput",
    "mx.quantize / mx.dequantize 4-bit g64 on the same tensors",
    (at_least("encode vs mx.quantize", 0.5), at_least("decode vs mx.dequantize", 0.5)),
    "needs the TurboQuant family (issue 7)",
)
