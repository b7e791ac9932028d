"""Re-encoding one record: its selected layers into their target family.

A record holds every layer of a model for one block of tokens
(:mod:`kvstore.codecs.record`). Selected layers go through
:func:`~kvstore.codecs.transcode.transcode_measured` (dense rows, then the
target codec), which also measures what was lost; the other layers are
carried over as the bytes they were. The record's own ``meta`` is kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.abc.codec import Snapshot
from kvstore.codecs.record import decode_record, encode_record, read_header, snapshot_to_mlx
from kvstore.codecs.transcode import transcode_measured
from kvstore.store.maintenance.migrate.targets import LayerSelection, layer_target
from kvstore.store.maintenance.transfer import family_label

__all__ = ["LayerChange", "Recoded", "plan_layers", "recode_record"]


@dataclass(frozen=True)
class LayerChange:
    """One layer of one record converted, and what it lost.

    Attributes:
        tokens: rows of the layer in this record (weights the error means).
        rel_mse: ``(keys, values)`` relative MSE, mean over vectors; 0.0 when exact.
    """

    layer: int
    source: str
    target: str
    tokens: int
    rel_mse: tuple[float, float] = (0.0, 0.0)


@dataclass(frozen=True)
class Recoded:
    """A record after re-encoding.

    Attributes:
        record: the new bytes, or ``None`` when the record stays as it is.
        family: the index family label of the new record.
        changes: the layers converted (empty for a plain re-encode).
    """

    record: bytes | None
    family: str
    changes: tuple[LayerChange, ...]


def plan_layers(
    signatures: Sequence[str | None], to: str | None, layers: LayerSelection
) -> list[str | None]:
    """The target signature of each layer (``None`` where absent); unselected layers keep theirs."""
    return [
        sig if sig is None or to is None or not layers.selects(i, sig) else layer_target(sig, to, i)
        for i, sig in enumerate(signatures)
    ]


def recode_record(
    record: Any, *, to: str | None, layers: LayerSelection, reencode: bool = False
) -> Recoded:
    """Convert the selected layers of ``record`` to ``to``'s family.

    Args:
        record: a whole record (bytes-like); its checksums are verified.
        to: the target signature (``None``: no family change).
        layers: which layers to convert.
        reencode: write a new record even when no layer changes (a format upgrade).

    Raises:
        CorruptEntryError, FormatVersionError: the record does not decode.
        UnknownSignatureError, CapabilityError, EncodingError: a layer cannot be
            converted to its target family.
    """
    header = read_header(record)
    sources = [None if layer is None else layer.signature for layer in header.layers]
    targets = plan_layers(sources, to, layers)
    decoded = decode_record(record)  # verifies the payload checksum
    if targets == sources and not reencode:
        return Recoded(None, family_label(sources), ())
    out: list[Snapshot | None] = []
    changes: list[LayerChange] = []
    for i, (snap, target) in enumerate(zip(decoded.layers, targets)):
        if snap is None or target is None or target == snap.signature:
            out.append(snap)
            continue
        result = transcode_measured(snapshot_to_mlx(snap), target)  # type: ignore[arg-type]
        out.append(result.snapshot)
        errors = result.relative_mse
        changes.append(
            LayerChange(i, snap.signature, target, snap.tokens, (errors["keys"], errors["values"]))
        )
    return Recoded(encode_record(out, meta=header.meta), family_label(targets), tuple(changes))
