"""Recurrent checkpoints in block records (issue 16): what a save can store, what a
restore can use.

A hybrid model's recurrent layers (Gated-DeltaNet, Mamba: families of
:data:`~kvstore.family.RECURRENT_STATE`) keep no row per token, only a state at
one position. A block record carries their *checkpoint at its end* -- every
recurrent layer's state after the block's last token, next to the attention
layers' rows of the block -- or none of them (the layer is ``None`` in the
record). A prefix is reusable to a block's end only where a record carries
one: the attention layers are restored to that point, the recurrent ones from
the checkpoint, and the rest of the prompt is recomputed.

* Save: the positions a save can checkpoint (:func:`checkpoint_positions`)
  are those where every recurrent layer has a state -- captured during prefill
  or decode (``captured[(layer, position)]``, a snapshot with ``start == stop``)
  or its live state, which is at its ``offset`` (a stock mlx-lm
  ``ArraysCache`` keeps none: it is where the model's KV layers are). The
  store asks the encoder for them at block ends (``BlockSpan.checkpoint``),
  and :func:`checkpoint_layers` gives the layers' snapshots, all or none.
* Restore: a recurrent layer needs the last block of the match, whole, with a
  checkpoint at its end (:func:`checkpoint_block`, :func:`usable_checkpoint`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvstore.abc.cache import is_recurrent_cache
from kvstore.abc.codec import KVCodec, Snapshot
from kvstore.abc.store import BlockRef, Match
from kvstore.codecs.header import LayerEntry
from kvstore.codecs.recurrent import checkpoint_position
from kvstore.errors import CapabilityError
from kvstore.signature import parse_signature

__all__ = [
    "recurrent_layers",
    "recurrent_signatures",
    "live_positions",
    "checkpoint_positions",
    "checkpoint_layers",
    "checkpoint_block",
    "usable_checkpoint",
]


def recurrent_layers(caches: Sequence[Any]) -> list[int]:
    """Indices of the layers whose caches hold recurrent state."""
    return [i for i, c in enumerate(caches) if is_recurrent_cache(c)]


def recurrent_signatures(signatures: Sequence[str]) -> tuple[int, ...]:
    """Indices of the layers whose caches' ``signatures`` (known ones) are of recurrent state:
    :func:`recurrent_layers` for a save that has read them already."""
    # A model's layers share a few signatures: each distinct one asked once.
    recurrent = {s for s in set(signatures) if parse_signature(s).family.holds_recurrent_state}
    return tuple(i for i, s in enumerate(signatures) if s in recurrent) if recurrent else ()


def live_positions(caches: Sequence[Any], tokens: int) -> dict[int, int]:
    """Where each recurrent layer's live state is: its ``offset``; for a cache that
    keeps none (mlx-lm's ``ArraysCache``), the offset of the model's KV layers,
    or ``tokens`` in a model without any.

    Raises:
        CapabilityError: such a cache in a model whose KV layers disagree on their offset.
    """
    kv = {int(c.offset) for c in caches if not is_recurrent_cache(c)}
    out = {}
    for i in recurrent_layers(caches):
        held = checkpoint_position(caches[i])
        if held is None:
            if len(kv) > 1:
                raise CapabilityError(
                    f"[save] Layer {i}'s recurrent cache keeps no offset and the KV layers "
                    f"disagree on theirs ({sorted(kv)}): where its state is is unknown.",
                    layer=i,
                )
            held = kv.pop() if kv else tokens
            kv = {held}
        out[i] = held
    return out


def checkpoint_positions(
    caches: Sequence[Any],
    captured: Mapping[tuple[int, int], Snapshot],
    tokens: int,
    layers: Sequence[int],
) -> frozenset[int]:
    """Positions in ``(0, tokens]`` where every recurrent layer (``layers``, as
    :func:`recurrent_signatures` finds them) has a state to store: a captured checkpoint,
    or its live state. Empty for a model without recurrent layers."""
    if not layers:
        return frozenset()
    live = live_positions(caches, tokens)
    found = None
    for i in layers:
        held = {p for (layer, p), snap in captured.items() if layer == i and snap.tokens == 0}
        held.add(live[i])
        found = held if found is None else found & held
    assert found is not None
    return frozenset(p for p in found if 0 < p <= tokens)


def checkpoint_layers(
    caches: Sequence[Any],
    codecs: Sequence[KVCodec],
    captured: Mapping[tuple[int, int], Snapshot],
    position: int,
    live: Mapping[int, int],
) -> dict[int, Snapshot] | None:
    """Every recurrent layer's checkpoint at ``position`` (captured, else live), or
    ``None`` when one of them has none there (a record carries all or none)."""
    out = {}
    for i in recurrent_layers(caches):
        snap = captured.get((i, position))
        if snap is None or snap.tokens != 0:
            if live.get(i) != position:
                return None
            snap = codecs[i].snapshot(caches[i], position, position)
        out[i] = snap
    return out


def checkpoint_block(match: Match) -> tuple[BlockRef, ...]:
    """The block a recurrent layer is restored from: the match's last, if the match
    ends where it does (its checkpoint is at its end); else none (not restorable)."""
    if not match.blocks:
        return ()
    last = match.blocks[-1]
    return (last,) if not last.trimmed and last.stop == match.tokens else ()


def usable_checkpoint(entry: LayerEntry | None, ref: BlockRef, signature: str) -> bool:
    """Whether a record's layer ``entry`` is a checkpoint of ``signature`` at ``ref``'s end."""
    end = ref.start + ref.stored_rows
    return (
        entry is not None
        and not ref.trimmed
        and entry.start == entry.stop == end
        and entry.signature == signature
    )
