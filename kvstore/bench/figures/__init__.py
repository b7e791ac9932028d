"""Every figure of BENCHMARKS.md, in one table.

Adding one is a module with a ``Figure`` and its line here. A figure whose
parts do not exist yet can be listed with ``common.pending_figure`` (the table
then shows it as not measured yet, with the reason).
"""

from __future__ import annotations

from kvstore.bench.figures import (
    concurrent,
    decode,
    decode_speed,
    dedup_bytes,
    first_restore,
    gpu_namespace,
    gpu_save,
    gpu_ttft,
    lookup,
    redis_restore,
    restore,
    save,
    stored_bytes,
    ttft,
    turboquant_speed,
)
from kvstore.bench.harness import Figure

__all__ = ["FIGURES"]

#: Figure id -> figure, in the order a run measures and prints them.
FIGURES: dict[str, Figure] = {
    "P1": restore.FIGURE,
    "P2": save.P2,
    "P3": save.P3,
    "P4": lookup.P4,
    "P5": ttft.FIGURE,
    "P6": dedup_bytes.FIGURE,
    "P7": stored_bytes.FIGURE,
    "P8": concurrent.FIGURE,
    "P9": redis_restore.FIGURE,
    "P10": lookup.P10,
    "P11": turboquant_speed.FIGURE,
    "D1": decode.FIGURE,
    "D2": first_restore.FIGURE,
    # On a GPU (BENCHMARKS.md "On a GPU"; tools/bench/gpu/run.sh runs them there).
    "G1": gpu_ttft.G1,
    "G2": gpu_ttft.G2,
    "G3": gpu_save.G3,
    "G4": gpu_namespace.G4,
    "G5": decode_speed.FIGURE,
}
