"""Live caches -> stored blocks: one record per block, every layer of the model in it.

A save asks the store which blocks of the prompt are missing
(:meth:`~kvstore.abc.store.PrefixStore.put_blocks` deduplicates) and encodes
only those. A block's record holds one snapshot per layer
(:func:`kvstore.codecs.encode_record`), each the layer's rows for the
block's tokens, in the encoding the store's storage policy chooses
(:mod:`kvstore.store.kv.policy`). A sliding-window layer that no longer
holds a block's rows is stored as ``None`` in that block: a restore then
reuses the block only where that layer does not need it.

A sliding window forgets rows as prefill moves on, so
:class:`kvstore.bridge.capture.BlockCapture` (an ``on_prefill_chunk`` callback)
snapshots each completed block of such layers while the window still holds it;
the save takes those snapshots instead of asking the live cache.

A hybrid model's recurrent layers (issue 16) are stored as checkpoints at
block ends, all of them or none in a record (:mod:`.checkpoints`): at every
position where each has a state -- captured (``captured[(layer, position)]``,
a snapshot with ``start == stop``) or live -- the store is asked for one, and
a stored block there that lacks it is upgraded.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import mlx.core as mx

from kvstore.abc.cache import is_recurrent_cache, signature_string
from kvstore.abc.codec import KVCodec, Snapshot
from kvstore.abc.store import BlockSpan, PrefixStore, SaveResult
from kvstore.codecs import codec_for, cuda, get_codec
from kvstore.codecs.arena import write_records
from kvstore.codecs.arrays import as_numpy_all
from kvstore.codecs.growing import GrowingKVCodec
from kvstore.codecs.host_stacks import spread_packed
from kvstore.codecs.record import RecordPlan, plan_record
from kvstore.codecs.stacked_payloads import Cut, stacked_payloads
from kvstore.errors import CapabilityError
from kvstore.knobs import choice_from_env
from kvstore.signature import UNKNOWN
from kvstore.store import keys as K
from kvstore.store.kv.checkpoints import (
    checkpoint_layers,
    checkpoint_positions,
    live_positions,
    recurrent_signatures,
)
from kvstore.store.kv.policy import apply_policy, stored_signature

__all__ = ["save_caches", "check_caches", "BlockEncoder", "Captured"]

#: How a save's payloads are built on a CUDA GPU (``KVSTORE_CUDA_SAVE_PAYLOADS``):
#: ``record``, each record's on its own (a few kernels per tensor piece, ~2000 for a
#: 4096-token llama-8B save); ``stacked``, a run of blocks cut alike a run at a time
#: (:mod:`kvstore.codecs.stacked_payloads`); ``auto`` (the default), stacked where one
#: copy of each byte does it (a lossless model's keys and values) in a save of at most
#: :data:`AUTO_STACKED_BYTES`, record by record otherwise. On H100 hosts
#: (tools/bench/results/gpu/4ac01ae-h100/): a 4096-token save stacked took 276-292 ms
#: where record by record took 324-345, and the longest decode step beside it 15-17 ms
#: where it took 33-54; where the pieces take two copies (``kv:quant:8:64``) stacking
#: took 11-45 % longer (ffbfa55-h100/). Copying each record's bytes from the whole tensors
#: its blocks were cut from straight into the pinned arena, without building payloads,
#: lost to ``auto`` twice, by a kernel (G3 16384 1.76 s against 1.09: 163f866-h100/) and
#: by the copy engine's 2-D copies (2.17 s against 1.26, a decode step beside it stalled
#: 160-242 ms against 69-92: 161dfd3-h100/): removed.
SAVE_PAYLOADS = choice_from_env("KVSTORE_CUDA_SAVE_PAYLOADS", ("auto", "record", "stacked"), "auto")

#: Under ``auto``, the largest save (its payloads' bytes) stacked. A 16384-token (2 GiB)
#: save under ``auto`` saved as fast as record by record but one decode step beside it
#: took 176-251 ms where record by record the longest took 44-64, with all of it, its
#: first 512 MiB or none of it stacked (runs of one record; 4ac01ae-h100/); stacking
#: none of it, and the cut map cleared early, it still took 159-253 ms against 68
#: (6f53194-h100/, 163f866-h100/: not traced). 512 MiB saves gained at every measure.
AUTO_STACKED_BYTES = 1 << 30

#: Snapshots taken during prefill: ``(layer, block start) -> Snapshot`` of a whole block;
#: for a recurrent layer ``(layer, position) -> `` its checkpoint there (``start == stop``).
Captured = Mapping[tuple[int, int], Snapshot]


def save_caches(
    store: PrefixStore,
    namespace: str,
    tokens: Any,
    caches: Sequence[Any],
    *,
    captured: Captured | None = None,
) -> SaveResult:
    """Store the KV of ``tokens`` that ``caches`` hold, block by block.

    Args:
        store: any prefix store.
        namespace: from :func:`kvstore.store.namespace_for_model`.
        tokens: the token ids whose KV the caches hold, from position 0 (the
            caches may hold more: only ``len(tokens)`` positions are saved).
        caches: the model's live caches, one per layer (ours or mlx-lm's).
        captured: snapshots of whole blocks taken while a sliding window held
            them (:class:`kvstore.bridge.capture.BlockCapture`); they replace what the caches lost.
            For recurrent layers, checkpoints at positions the state has left.

    Returns:
        What :meth:`~kvstore.abc.store.PrefixStore.put_blocks` did.

    Raises:
        ValueError: no caches, or a cache holding fewer tokens than ``tokens``.
        CapabilityError: a cache no codec serves.
        StoreFullError, StoreUnavailableError, ReadOnlyStoreError: from the store.
    """
    toks = K.as_tokens(tokens, "save")
    check_caches(toks, caches)
    captured = captured or {}
    encoder = BlockEncoder(caches, store.settings.storage_policy, captured, len(toks))
    positions = checkpoint_positions(caches, captured, len(toks), encoder.recurrent)
    # Only a hybrid model's save names checkpoints (a wrapped put_blocks may predate them).
    options = {"checkpoints": positions} if positions else {}
    return store.put_blocks(namespace, toks, encoder, family=encoder.family, **options)


def check_caches(tokens: Any, caches: Sequence[Any]) -> None:
    """Raise ValueError unless every one of ``caches`` holds KV for all of ``tokens``."""
    if not caches:
        raise ValueError("[save] No caches: pass the model's caches, one per layer.")
    # The offset first, the predicate only for a short cache (a state has no rows; mlx-lm's
    # ArraysCache keeps no offset): a save handed off pays this on the generating thread.
    short = sorted(
        {
            int(offset)
            for c in caches
            if (offset := getattr(c, "offset", None)) is not None
            and int(offset) < len(tokens)
            and not is_recurrent_cache(c)
        }
    )
    if short:
        raise ValueError(
            f"[save] {len(tokens)} tokens were given but a cache holds only {short[0]}; pass "
            f"the tokens whose KV the caches hold (prompt plus generated tokens fed back)."
        )


class BlockEncoder:
    """``encode(spans)`` for :meth:`~kvstore.abc.store.PrefixStore.put_blocks`:
    the record of each span, built from live caches (and captured snapshots)."""

    def __init__(
        self, caches: Sequence[Any], policy: str, captured: Captured, tokens: int | None = None
    ) -> None:
        self._caches = list(caches)
        # Each cache's signature once per save: a re-save of a stored prefix (dedup) is
        # mostly this bookkeeping, so the layers' facts are read from one pass.
        signatures = tuple(_signature(c) for c in self._caches)
        #: The layers holding recurrent state (their families declare it), in order.
        self.recurrent = recurrent_signatures(signatures)
        self._recurrent = set(self.recurrent)
        self._tokens = tokens
        self._codecs: list[KVCodec] | None = None  # looked up when a block is encoded
        self._policy = policy
        self._captured = captured
        #: The stored families, joined: the label ``stats(by_family=True)`` counts bytes by.
        self.family = _stored_families(signatures, policy)
        self._signatures = signatures
        #: Each lossless layer's snapshot of every token saved (None: not cut from one;
        #: see :meth:`_whole`).
        self._wholes: dict[int, Snapshot | None] = {}
        #: Snapshots on the host, made once each: ``id(snapshot) -> (it, its host form)``.
        self._on_host: dict[int, tuple[Snapshot, Snapshot]] = {}
        #: On a CUDA GPU, the MLX tensors :meth:`cut` made, by id: ``(it, the whole
        #: tensor, first row, end row)`` -- for the payloads to be built a run at a time.
        self._cuts: dict[int, tuple[Any, Any, int, int]] = {}

    def __call__(self, spans: Sequence[BlockSpan]) -> list[Any]:
        # Each plan lends its layout to the next (blocks cut alike differ in their
        # ranges only). Into this thread's arena: reused pages, several threads
        # (pinned memory on a GPU); pending, so the commit puts each record once it
        # is written, while the pool writes the next.
        plans: list[RecordPlan] = []
        for s in spans:
            layers = self.layers(s.start, s.stop, checkpoint=s.checkpoint)
            plans.append(plan_record(layers, like=plans[-1] if plans else None))
        # On a GPU, the payloads of blocks cut alike in a few kernels, not a few per piece.
        payloads = (
            stacked_payloads(plans, self._cut_of, one_copy_only=SAVE_PAYLOADS != "stacked")
            if self._cuts and _stacks(plans)
            else None
        )
        # The map has done its work: the pieces live on in the plans alone. (Clearing it
        # here rather than at the save's end did not remove the long decode step beside
        # a 2 GiB save under ``auto``: results/gpu/6f53194-h100/.)
        self._cuts.clear()
        return write_records(plans, pending=True, payloads=payloads)

    def _cut_of(self, tensor: Any) -> Cut | None:
        found = self._cuts.get(id(tensor))
        return None if found is None or found[0] is not tensor else found[1:]

    def layers(self, start: int, stop: int, *, checkpoint: bool = False) -> list[Snapshot | None]:
        """Every layer's snapshot of the tokens ``[start, stop)``, as stored (or ``None``);
        with ``checkpoint``, the recurrent layers' checkpoints at ``stop`` (all or none)."""
        if self._codecs is None:
            self._codecs = [codec_for(cache) for cache in self._caches]
        states: dict[int, Snapshot] | None = None
        if checkpoint and self._recurrent:
            live = live_positions(self._caches, stop if self._tokens is None else self._tokens)
            states = checkpoint_layers(self._caches, self._codecs, self._captured, stop, live)
        if not self._wholes:  # once: each layer's snapshot to cut, all to the host at once
            wholes = [
                self._whole(i, cache, codec)
                for i, (cache, codec) in enumerate(zip(self._caches, self._codecs, strict=True))
                if i not in self._recurrent
            ]
            self.to_host([w for w in wholes if w is not None])
        out: list[Snapshot | None] = []
        for i, (cache, codec) in enumerate(zip(self._caches, self._codecs, strict=True)):
            if i in self._recurrent:
                out.append(None if states is None else states[i])
                continue
            snap = self._captured.get((i, start))
            if snap is not None and snap.stop == stop:
                out.append(self._apply(snap, i))
                continue
            whole = self._whole(i, cache, codec)
            if whole is not None and whole.start <= start and stop <= whole.stop:
                out.append(self.cut(whole, start, stop))
                continue
            try:
                snap = codec.snapshot(cache, start, stop)
            except CapabilityError:  # a window that moved on: the layer sits this block out
                snap = None
            out.append(None if snap is None else self._apply(snap, i))
        return out

    def _whole(self, i: int, cache: Any, codec: KVCodec) -> Snapshot | None:
        """Layer ``i``'s snapshot of every token saved, for blocks to be cut from, where
        the layer is stored as it is (a policy's encoding of every token would encode
        blocks the store holds) and its family cuts ranges; else ``None``."""
        if i not in self._wholes:
            whole = None
            signature = self._signatures[i]
            if self._tokens and stored_signature(signature, self._policy, i) == signature:
                try:
                    whole = codec.snapshot(cache, 0, self._tokens)
                    codec.slice(whole, 0, 0)  # raises if the family cannot cut ranges
                except CapabilityError:  # a window: a snapshot per block
                    whole = None
            self._wholes[i] = whole
        return self._wholes[i]

    def cut(self, whole: Snapshot, start: int, stop: int) -> Snapshot:
        """Tokens ``[start, stop)`` of ``whole`` (a snapshot of a range, as stored), by
        its codec's ``slice``: from its host views where :meth:`to_host` made them."""
        held = self._on_host.get(id(whole))
        source = held[1] if held is not None and held[0] is whole else whole
        codec = get_codec(whole.signature)
        out = codec.slice(source, start, stop)
        if source is whole and isinstance(codec, GrowingKVCodec) and _cuts_rows(codec):
            a, b = start - whole.start, stop - whole.start
            for name in codec.tensor_names():
                piece = out.tensors.get(name)
                if isinstance(piece, mx.array):
                    self._cuts[id(piece)] = (piece, whole.tensors[name], a, b)
        return out

    def to_host(self, wholes: Sequence[Snapshot]) -> None:
        """Host views of ``wholes``' tensors, for :meth:`cut` to cut blocks from: each
        block's tensors are then numpy views, where MLX slices cost a view, an
        evaluation and a host view each (~6.7 us a tensor; a qwen-0.5B save of 8192
        tokens cuts 1536). All in one evaluation (one per layer cost a small save more
        than it saved). Not on a CUDA GPU, where the records' payloads are built on the
        device from the MLX arrays."""
        if not wholes or cuda.available():
            return
        tensors = [array for whole in wholes for array in whole.tensors.values()]
        views = iter(as_numpy_all(tensors))
        for whole in wholes:
            host = {name: next(views) for name in whole.tensors}
            self._on_host[id(whole)] = (
                whole,
                Snapshot(whole.signature, whole.start, whole.stop, host, whole.meta),
            )

    def _apply(self, snap: Snapshot, layer: int) -> Snapshot:
        """``snap`` in the encoding the storage policy stores layer ``layer``'s family as."""
        # On the CPU ``mx.quantize`` runs on one core (~0.5 GB/s here): each layer's is
        # built on a stream in turn, and write_records' one evaluation runs them on
        # every core.
        with spread_packed(stored_signature(snap.signature, self._policy, layer), layer):
            return apply_policy(snap, self._policy, layer)


def _stacks(plans: Sequence[RecordPlan]) -> bool:
    """Whether a save of ``plans`` has its payloads stacked (given its cuts are noted)."""
    return SAVE_PAYLOADS == "stacked" or (
        sum(plan.payload_nbytes for plan in plans) <= AUTO_STACKED_BYTES
    )


def _cuts_rows(codec: GrowingKVCodec) -> bool:
    """Unless ``KVSTORE_CUDA_SAVE_PAYLOADS=record``, on a CUDA GPU, whether ``codec.slice``
    returns each of its tensors as the snapshot's tensor cut on axis 2 and nothing else
    (a growing family that changes neither step): what :func:`stacked_payloads` relies on."""
    kind = type(codec)
    return (
        SAVE_PAYLOADS != "record"
        and kind.slice is GrowingKVCodec.slice
        and kind.sliced is GrowingKVCodec.sliced
        and cuda.available()
    )


@functools.lru_cache(maxsize=64)
def _stored_families(signatures: tuple[str, ...], policy: str) -> str:
    """The label of the families ``signatures`` are stored as under ``policy``: a model's
    saves ask it of the same layers again and again."""
    return "+".join(sorted({stored_signature(s, policy, i) for i, s in enumerate(signatures)}))


def _signature(cache: Any) -> str:
    """``cache``'s signature; a cache kvstore does not know raises codec_for's CapabilityError."""
    signature = signature_string(cache)
    if signature == UNKNOWN:
        codec_for(cache)
    return signature
