"""An encode's verdict on its rows: one byte, the worse the larger.

So that the maximum over rows, blocks or tensors is the whole's verdict: one
reduction on the device (the CUDA encode kernel writes a byte per row), one
``max`` on the host.
"""

from __future__ import annotations

__all__ = ["FINE", "NOT_FINITE", "WIDE_SCALE"]

#: Every row encodes as asked.
FINE = 0
#: Some scale's magnitude passes the float16 limit: every scale is stored as float32.
WIDE_SCALE = 1
#: Some vector is not finite (NaN or Inf, or a norm beyond float32): an error.
NOT_FINITE = 2
