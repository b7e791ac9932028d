"""P7: stored bytes per token by family, against bfloat16.

For each workload, one block of 256 tokens (the store's default block
size) is prefilled into our caches, each layer's snapshot is transcoded
into the family (a sliding-window layer into the family's windowed
variant) and every layer is encoded into one record with
:func:`kvstore.codecs.encode_record`, header and alignment included: the
bytes a store would hold. The figure is those bytes per token over the
workload's bfloat16 bytes per token.

Each row also gives the family's formula (bits per value: 16 raw; ``b + 32/g``
affine with bfloat16 scales and biases; ``b + 16/D`` TurboQuant with float16
scales, spec ``specs/turboquant.md``) and the record's row tensors over it,
which is exactly 1 when the stored rows cost what the formula says; the rest
of a record is its header and padding.

A family whose codec is not registered is listed as not measured yet, with
the registry's message; it is measured as soon as its codec registers, with
no change here.
"""

from __future__ import annotations

from kvstore.bench.harness import BenchContext, Figure, at_most
from kvstore.bench.results import FigureResult, Row
from kvstore.bench.workloads import WORKLOADS, synthetic_kv, windowed_signature
from kvstore.caches.turboquant import TURBOQUANT_FAMILY
from kvstore.errors import CapabilityError, UnknownSignatureError
from kvstore.signature import parse_signature
from kvstore.turboquant.quantizer import bits_per_value

__all__ = ["FIGURE", "FAMILIES", "METRIC", "formula_bits_per_value"]

#: Each family measured and its bar: the largest stored/bf16 ratio allowed (None: reported).
FAMILIES: dict[str, float | None] = {
    "kv:plain": None,
    "kv:quant:8:64": 0.54,
    "kv:quant:4:64": 0.29,
    "kv:turboquant:3:3": 0.20,
    "kv:turboquant:2:2": 0.14,
    # MLX microscaling (issue 14): b + 8/g bits per value, reported beside affine.
    "kv:mxfp8": None,
    "kv:mxfp4": None,
    "kv:nvfp4": None,
}
METRIC = "vs bf16"
_RAW_BITS = 16


def formula_bits_per_value(signature: str, head_dim: int) -> float:
    """Stored bits per key/value element of a family's rows, from its layout:
    16 raw; ``b + 32/g`` affine (bfloat16 scales and biases per group of g);
    ``b + 8/g`` microscaling (one 8-bit scale per group, no biases); the mean of
    keys' and values' ``b + 16/D`` for TurboQuant (float16 scales)."""
    sig = parse_signature(signature)
    quantization = sig.family.quantization(sig)
    if quantization is not None and quantization.mode == "affine":
        return sig.bits + 2 * _RAW_BITS / sig.group_size
    if quantization is not None:  # microscaling: one 8-bit scale per group, no biases
        return quantization.bits + 8 / quantization.group_size
    if sig.family.growing_kind == TURBOQUANT_FAMILY.kind:
        return (bits_per_value(sig.kbits, head_dim) + bits_per_value(sig.vbits, head_dim)) / 2
    return float(_RAW_BITS)


def _row_bytes(record: bytes, tokens: int) -> int:
    """Bytes of the record's row tensors ``[B, H, tokens, ...]`` (not its side tensors)."""
    from kvstore.codecs import read_header

    return sum(
        t.nbytes
        for layer in read_header(record).layers
        if layer is not None
        for t in layer.tensors
        if len(t.shape) >= 3 and t.shape[2] == tokens
    )


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
        bf16_per_token = kv.shape.bytes_per_token
        formula = formula_bits_per_value(family, kv.shape.head_dim) / _RAW_BITS
        values = {
            "bytes/token": per_token,
            METRIC: per_token / bf16_per_token,
            "formula vs bf16": formula,
            "rows/formula": _row_bytes(record, tokens) / (tokens * bf16_per_token * formula),
        }
        rows.append(Row(label, params, values=values))
    return rows


def run(ctx: BenchContext) -> FigureResult:
    rows = []
    for workload in WORKLOADS:  # sizes only: cheap, so every workload in every run
        ctx.log(f"  {workload}: {len(FAMILIES)} families, {ctx.sizes.block_tokens} tokens")
        rows += measure(workload, ctx.sizes.block_tokens)
    notes = [
        f"one record of a {ctx.sizes.block_tokens}-token block, header and padding included",
        "formula: bits per value of the family's layout (TurboQuant b + 16/D: above the "
        "bars at head_dim 64); rows/formula = the record's row tensors over it (1 = exact)",
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
