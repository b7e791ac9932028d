"""P7: stored bytes per token by family, against bfloat16.

For each workload, one block of 256 tokens (the store's default block
size) is prefilled into our caches, each layer's snapshot is transcoded
into the family (a sliding-window layer into the family's windowed
variant) and every layer is encoded into one record with
:func:`kvstore.codecs.encode_record`, header and alignment included: the
bytes a store would hold. The figure is those bytes per token over the
workload's bfloat16 bytes per token.

A family whose codec is not registered (TurboQuant until issue 7 lands)
is listed as not measured yet, with the registry's message; it is measured
as soon as its codec registers, with no change here.
"""

from __future__ import annotations

from kvstore.bench.harness import BenchContext, Figure, at_most
from kvstore.bench.results import FigureResult, Row
from kvstore.bench.workloads import WORKLOADS, synthetic_kv, windowed_signature
from kvstore.errors import CapabilityError, UnknownSignatureError

__all__ = ["FIGURE", "FAMILIES", "METRIC"]

#: Each family measured and its bar: the largest stored/bf16 ratio allowed (None: reported).
FAMILIES: dict[str, float | None] = {
    "kv:plain": None,
    "kv:quant:8:64": 0.54,
    "kv:quant:4:64": 0.29,
    "kv:turboquant:3:3": 0.20,
    "kv:turboquant:2:2": 0.14,
}
METRIC = "vs bf16"


def measure(workload: str, tokens: int) -> list[Row]:
    from kvstore.codecs import encode_record, snapshot, transcode

    kv = synthetic_kv(workload, tokens)
    caches = kv.ours()
    plain = [snapshot(cache, 0, tokens) for cache in caches]
    rows = []
    for family in FAMILIES:
        params = {"workload": workload, "family": family, "tokens": tokens}
        label = f"{workload} {family}"
        try:
            layers = [
                transcode(snap, windowed_signature(family) if kv.shape.is_sliding(i) else family)
                for i, snap in enumerate(plain)
            ]
        except UnknownSignatureError as exc:
            rows.append(
                Row(
                    label,
                    params,
                    pending=f"no codec registered for '{getattr(exc, 'found', family)}' yet",
                )
            )
            continue
        except CapabilityError as exc:  # a codec without a dense form cannot be a target
            rows.append(Row(label, params, pending=str(exc)))
            continue
        record = encode_record(layers, meta={"workload": workload, "family": family})
        per_token = len(record) / tokens
        values = {"bytes/token": per_token, METRIC: per_token / kv.shape.bytes_per_token}
        rows.append(Row(label, params, values=values))
    return rows


def run(ctx: BenchContext) -> FigureResult:
    rows = []
    for workload in WORKLOADS:  # sizes only: cheap, so every workload in every run
        ctx.log(f"  {workload}: {len(FAMILIES)} families, {ctx.sizes.block_tokens} tokens")
        rows += measure(workload, ctx.sizes.block_tokens)
    notes = [
        f"one record of a {ctx.sizes.block_tokens}-token block, header and padding included",
        "a family is measured as soon as its codec registers (TurboQuant: issue 7)",
    ]
    return FigureResult(rows, notes=notes)


FIGURE = Figure(
    "P7",
    "stored bytes per token by family",
    "bfloat16 keys and values of the same tokens",
    tuple(
        at_most(METRIC, bound, where={"family": family})
        for family, bound in FAMILIES.items()
        if bound is not None
    ),
    run,
)
