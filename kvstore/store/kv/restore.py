"""Stored blocks -> live caches, in the families the model asks for.

A restore gets a :class:`~kvstore.abc.store.Match` (from ``lookup``) and one
fresh cache per layer (``model.make_cache(policy)``) that says what each
layer needs:

* a layer that keeps every token is rebuilt from every block of the match;
* a sliding-window layer only from the blocks covering its ``keep`` sink
  tokens and its window at the match's end (``Match.for_window``), so a
  windowed model reuses any stored prefix, not only one saved at that length;
* a match ending inside a block uses that block's first rows only;
* a layer stored in another encoding (a lossy storage policy) is transcoded
  into the family of its cache;
* a recurrent layer (a hybrid model, issue 16) from the checkpoint the match's
  last block carries at its end (:mod:`.checkpoints`), so the match is cut back
  to the last block that has one.

When a block a layer needs cannot serve it -- unreadable (corrupt, vanished),
or the layer is ``None`` in it (a window had moved on when it was saved) --
the match is cut back to the longest prefix every layer can be restored to.
A restore never returns a cache that differs from what the model's own
prefill of those tokens would hold; at worst it returns the templates
untouched (nothing reused).

Each layer's rows go from the store's pages into one MLX buffer per tensor,
in one copy (:func:`kvstore.codecs.rows.join_rows`; on a CUDA GPU, the GPU
reads them out of the pages: :mod:`kvstore.codecs.cuda_pages`; on the host, for
a model without windows stored as its caches hold it, planned from the headers
alone: :mod:`kvstore.codecs.host_alike`); the records were verified by the
store's ``verify`` while the restore parsed, planned and filled
(``PrefixStore.read_checking``), and before anything is returned. On the host
the copies hash the records they copy for those checks
(:mod:`kvstore.codecs.copied_sums`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx

from kvstore.abc.cache import is_recurrent_cache, is_sliding_window_cache, signature_of
from kvstore.abc.codec import RestorePlan, Snapshot
from kvstore.abc.store import BlockRef, Match, PrefixStore
from kvstore.codecs import (
    cuda,
    cuda_pages,
    decode_record,
    get_codec,
    read_header,
    transcode,
    transcode_stacked,
)
from kvstore.codecs.alike_joins import joined_alike, joined_records
from kvstore.codecs.copied_sums import Claims
from kvstore.codecs.growing import GrowingKVCodec, room_for
from kvstore.codecs.host_alike import restored_alike
from kvstore.codecs.host_stacks import converted_by_block
from kvstore.codecs.payload_tensors import stored
from kvstore.codecs.plans import Stack, join_runs, members_of, run_plans
from kvstore.codecs.record import (
    Record,
    RecordHeader,
    decode_records_on_device,
    reader_parses,
    record_payload,
)
from kvstore.codecs.record_copies import worth_claiming
from kvstore.collector import collection_paused
from kvstore.errors import (
    CapabilityError,
    CorruptEntryError,
    FormatVersionError,
    UnknownSignatureError,
)
from kvstore.knobs import switch_from_env
from kvstore.signature import parse_signature
from kvstore.store.kv.checkpoints import checkpoint_block, usable_checkpoint

__all__ = ["LayerNeed", "layer_needs", "restore_caches", "blocks_needed"]


@dataclass(frozen=True)
class LayerNeed:
    """What one layer's live cache needs from the stored blocks.

    Attributes:
        signature: the family of the layer's cache (what to restore into).
        window: ``(max_size, keep)`` of a sliding-window cache, else ``None``.
        checkpoint: a recurrent layer: rebuilt from the checkpoint at the match's end.
    """

    signature: str
    window: tuple[int, int] | None = None
    checkpoint: bool = False


def layer_needs(caches: Sequence[Any]) -> list[LayerNeed]:
    """What each of ``caches`` (fresh templates) needs.

    Raises:
        CapabilityError: a cache with no signature kvstore knows.
    """
    needs = []
    for i, cache in enumerate(caches):
        sig = signature_of(cache)
        if sig is None:
            raise CapabilityError(
                f"[restore] Layer {i}'s cache ({type(cache).__name__}) has no signature "
                f"kvstore knows; pass model.make_cache(policy) caches.",
                layer=i,
            )
        window = (int(cache.max_size), int(cache.keep)) if is_sliding_window_cache(cache) else None
        needs.append(LayerNeed(str(sig), window, is_recurrent_cache(cache)))
    return needs


def blocks_needed(match: Match, need: LayerNeed) -> tuple[BlockRef, ...]:
    """The blocks of ``match`` that ``need``'s layer is rebuilt from."""
    if need.checkpoint:
        return checkpoint_block(match)
    return match.blocks if need.window is None else match.for_window(*need.window)


def restore_caches(store: PrefixStore, match: Match, caches: Sequence[Any]) -> list[Any]:
    """Live caches holding the longest prefix of ``match`` every layer can be restored to.

    Args:
        store: the store ``match`` came from.
        match: from ``store.lookup``.
        caches: one fresh cache per layer, of the families wanted
            (``model.make_cache(policy)``); returned as they are when nothing
            can be restored.

    Returns:
        One cache per layer, all at the same ``offset`` (the tokens restored,
        at most ``match.tokens``), with owned MLX arrays.

    Raises:
        CapabilityError: a template cache kvstore does not know.
        StoreUnavailableError: the store could not be reached (a miss it counted).
    """
    needs = layer_needs(caches)
    with collection_paused(), room_for(match.prompt_tokens):
        return _restored(store, match, caches, needs)


def _restored(
    store: PrefixStore, match: Match, caches: Sequence[Any], needs: Sequence[LayerNeed]
) -> list[Any]:
    tokens = match.tokens
    on_gpu = cuda.available()
    while tokens > 0:
        cut = match.truncated(tokens)
        wanted = _union(cut, needs)
        # The records are checksummed on other threads while this one parses, plans
        # and fills (on a CUDA GPU their pages are page-locked meanwhile too, and
        # the GPU reads the rows from them). H200, 4096 tokens of llama-8B: the
        # checks were 29 ms of a 76 ms restore, run before anything else; on the
        # 2-core CPU, 8192 tokens 385 -> 339 ms. Nothing is returned before they pass.
        # On the CPU the records' rows are copied record by record, each hashed as it
        # is copied, for the checks (record_copies); on a GPU the GPU reads them.
        claims = Claims(lambda views: not on_gpu and worth_claiming(views))
        with store.read_checking(wanted, claim=claims.taken) as views:
            pages = cuda_pages.pin(views) if on_gpu else None
            try:
                headers = _headers(wanted, views)
                if len(headers) < len(wanted):  # the rest of the prefix is unreadable
                    tokens = wanted[len(headers)].start
                    continue
                if any(_recoded(header, needs) for header in headers):
                    claims.drop()  # decoded rows, not copies: the checks hash beside
                best = _restorable(cut, needs, headers)
                if best == tokens:
                    restored = None if on_gpu else _host_alike(cut, needs, headers, views, claims)
                    if restored is None:
                        restored = _planned(cut, needs, headers, views, pages, claims)
                    intact = views.intact()
                    if intact == len(wanted):
                        return restored
                    del restored  # made from a record that failed its checksum: not served
                    tokens = wanted[intact].start
                    continue
            finally:
                if pages is not None:
                    pages.release()
        tokens = best
    return list(caches)


def _planned(
    match: Match,
    needs: Sequence[LayerNeed],
    headers: Sequence[RecordHeader],
    views: Sequence[memoryview],
    pages: cuda_pages.PinnedPages | None,
    claims: Claims,
) -> list[Any]:
    """The caches of ``match``, every layer planned first from its snapshots, then all
    arrays allocated and written in one go (:func:`~kvstore.codecs.plans.run_plans`)."""
    decoded: list[Stack] = []
    plans = _alike_plans(match, needs, headers, views, pages, decoded)
    if plans is None:
        # Each header's own checksum was checked by its parse, which is remembered.
        records = {
            ref.key: record.layers
            for ref, record in zip(
                _union(match, needs), _decoded(views, headers, needs, pages), strict=True
            )
        }
        plans = _plans(match, needs, records, pages, decoded)
    return run_plans(plans, pages, decoded, claims)


def _one_whole_need(
    match: Match, needs: Sequence[LayerNeed], headers: Sequence[RecordHeader]
) -> LayerNeed | None:
    """The one need of every layer when each layer reads every block of ``match`` (a
    model without windows or recurrent layers, every record's header parsed); else
    ``None``."""
    if not needs or len(set(needs)) != 1:
        return None
    need = needs[0]
    if need.checkpoint or need.window is not None or len(headers) != len(match.blocks):
        return None
    return need


def _host_alike(
    match: Match,
    needs: Sequence[LayerNeed],
    headers: Sequence[RecordHeader],
    views: Sequence[memoryview],
    claims: Claims,
) -> list[Any] | None:
    """The caches of a lossless restore on the host of a model without windows, every
    layer stored as its cache holds it: planned from the headers, no snapshot per
    (record, layer) (:func:`~kvstore.codecs.host_alike.restored_alike`). ``None``
    where the restore is not so."""
    need = _one_whole_need(match, needs, headers)
    if need is None:
        return None
    codec = get_codec(need.signature)
    if not isinstance(codec, GrowingKVCodec) or any(
        layer is None or layer.signature != need.signature
        for header in headers
        for layer in header.layers
    ):
        return None
    payloads = [record_payload(view, header) for view, header in zip(views, headers)]
    rows = [ref.rows for ref in match.blocks]
    return restored_alike(codec, [h.layers for h in headers], payloads, rows, claims)


def _decoded(
    views: Sequence[memoryview],
    headers: Sequence[RecordHeader],
    needs: Sequence[LayerNeed],
    pages: cuda_pages.PinnedPages | None,
) -> list[Record]:
    """The verified records of ``views``, as numpy views into the store's pages -- or,
    when some layer is stored in another encoding (a lossy storage policy) on a CUDA
    GPU whose pages are not pinned (``pages`` is ``None``: a small restore), with every
    tensor on the device: each record crosses the bus whole, and its rows are joined
    and decoded there (H200, 4096 tokens of llama-8B: a ``kv:quant:8:64`` restore
    176 -> 138 ms; ``tools/bench/gpu/restore_profile.py``). With ``pages`` (pinned:
    :mod:`kvstore.codecs.cuda_pages`) the GPU gathers every array, lossless rows and
    each lossy tensor's joined rows alike, from the views (:func:`_plans`): slicing
    each record's payload into its 3072 tensors on the device cost 33 ms of a
    162 ms ``kv:quant:8:64`` restore there, and joining them 26 more.
    Recurrent checkpoints stay on the host (their plans fill host buffers)."""
    if pages is None:
        # Asked in this order so that a restore off CUDA pays nothing more.
        if (
            cuda.available()
            and not any(need.checkpoint for need in needs)
            and any(_recoded(header, needs) for header in headers)
        ):
            return decode_records_on_device(views)
        return [
            decode_record(view, verify=False, header=header)
            for view, header in zip(views, headers, strict=False)
        ]
    # The lossy layers' tensors as where they lie, no views: the join reads them there.
    # Each header as parsed already (a second parse of 16 cost ~0.4 ms of this thread).
    return [
        decode_record(view, verify=False, lazy_layers=_recoded(header, needs), header=header)
        for view, header in zip(views, headers, strict=False)
    ]


def _recoded(header: RecordHeader, needs: Sequence[LayerNeed]) -> set[int]:
    """The layers of ``header`` stored in another encoding than their cache's."""
    return {
        i
        for i, (layer, need) in enumerate(zip(header.layers, needs, strict=False))
        if layer is not None and layer.signature != need.signature and not need.checkpoint
    }


def _union(match: Match, needs: Sequence[LayerNeed]) -> list[BlockRef]:
    """Every block some layer needs, in chain order."""
    keys = {ref.key for need in set(needs) for ref in blocks_needed(match, need)}
    return [ref for ref in match.blocks if ref.key in keys]


def _headers(wanted: Sequence[BlockRef], views: Sequence[memoryview]) -> list[RecordHeader]:
    """The headers of the leading run of records that parse (the store verified them
    with its own ``verify``, which may be weaker than the record format's)."""
    headers = []
    with reader_parses(views[: len(wanted)]):
        for view in views[: len(wanted)]:
            try:
                headers.append(read_header(view))
            except (CorruptEntryError, FormatVersionError):
                break
    return headers


def _restorable(match: Match, needs: Sequence[LayerNeed], headers: Sequence[RecordHeader]) -> int:
    """The longest prefix of ``match`` every layer can be rebuilt to from what is stored.

    Candidates: the whole match, then each block start going back. A block
    not read yet (a window at a shorter prefix reaches further back) counts as
    usable; the caller reads and checks it next.
    """
    by_key: dict[bytes, RecordHeader] = {}
    for ref, header in zip(_union(match, needs), headers):
        by_key[ref.key] = header
    candidates = [match.tokens, *(b.start for b in reversed(match.blocks) if b.start)]
    # Whether each (stored, wanted) pair of signatures converts, asked once: a lossy
    # restore of 32 layers from 16 records asks 512 times about one pair.
    convertible: dict[tuple[str, str], bool] = {}
    # The layers of each kind of need, each block asked about all of them at once.
    layers_of: dict[LayerNeed, list[int]] = {}
    for i, need in enumerate(needs):
        layers_of.setdefault(need, []).append(i)
    for tokens in dict.fromkeys(c for c in candidates if c <= match.tokens):
        cut = match.truncated(tokens)
        if all(
            _usable(by_key.get(ref.key), ref, layers, need, len(needs), convertible)
            for need, layers in layers_of.items()
            for ref in blocks_needed(cut, need)
        ) and all(blocks_needed(cut, need) for need in layers_of if need.checkpoint):
            return tokens
    return 0


def _usable(
    header: RecordHeader | None,
    ref: BlockRef,
    layers: Sequence[int],
    need: LayerNeed,
    count: int,
    convertible: dict[tuple[str, str], bool],
) -> bool:
    """Whether block ``ref`` (its record's ``header``) serves each of ``layers``, which
    share ``need``, in a model of ``count`` layers."""
    if header is None:
        return True  # not read yet
    entries = header.layers
    if len(entries) != count:  # not a record of this model's caches
        return False
    if need.checkpoint:
        return all(usable_checkpoint(entries[i], ref, need.signature) for i in layers)
    start, stop, wanted = ref.start, ref.start + ref.stored_rows, need.signature
    for i in layers:  # one loop, not a call per (record, layer): 512 in a 4096-token restore
        entry = entries[i]
        if entry is None or entry.start != start or entry.stop != stop:
            return False
        if need.window is not None:
            meta = entry.meta
            if (meta.get("max_size"), meta.get("keep")) != need.window:
                return False
        pair = (entry.signature, wanted)
        known = convertible.get(pair)
        if known is None:
            known = convertible[pair] = _convertible(*pair)
        if not known:
            return False
    return True


def _convertible(stored: str, wanted: str) -> bool:
    """Whether a layer stored as ``stored`` can be restored into a ``wanted`` cache."""
    if stored == wanted:
        return True
    try:
        families = [parse_signature(sig).family for sig in (stored, wanted)]
        get_codec(stored), get_codec(wanted)
    except (UnknownSignatureError, ValueError, TypeError):
        return False
    return families[0].windowed == families[1].windowed


def _plans(
    match: Match,
    needs: Sequence[LayerNeed],
    records: Mapping[bytes, list[Snapshot | None]],
    pages: cuda_pages.PinnedPages | None = None,
    decoded: list[Stack] | None = None,
) -> list[RestorePlan]:
    """Every layer's restore plan. Layers stored in another encoding (a lossy storage
    policy) are decoded into the cache's family: on a CUDA GPU their rows are joined
    first, all layers at once (gathered from ``pages``, the records' pinned pages,
    when they are), and decoded there once per run of blocks (a decode per block is
    a host round trip each); on the CPU block by block, as read. The stacks decoded so
    are appended to ``decoded`` (:func:`~kvstore.codecs.plans.run_plans` joins each
    layer's rows from there)."""
    layers: list[list[Snapshot]] = []
    refs_of: dict[LayerNeed, tuple[tuple[BlockRef, ...], list[int]]] = {}
    for layer, need in enumerate(needs):
        found = refs_of.get(need)
        if found is None:  # each kind of need's blocks, and those the match cuts, once
            refs = blocks_needed(match, need)
            cut = [] if need.checkpoint else [k for k, ref in enumerate(refs) if ref.trimmed]
            found = refs_of[need] = (refs, cut)
        refs, cut = found
        # Every one there (_usable checked it), holding its block's stored rows.
        snaps = cast(list[Snapshot], [records[ref.key][layer] for ref in refs])
        for k in cut:
            snaps[k] = _first_rows(snaps[k], refs[k].rows)
        layers.append(snaps)
    recoded = [i for i, need in enumerate(needs) if layers[i][0].signature != need.signature]
    stacks: list[Stack] | None = None
    if recoded and cuda.available():
        stacks = []
        lossy = [layers[i] for i in recoded]
        joins = joined_alike(lossy, pages, stacks) or join_runs(lossy, pages, stacks)
        for i, joined in zip(recoded, joins, strict=True):
            layers[i] = joined
    return _converted_plans(layers, needs, recoded, stacks, decoded)


def _alike_plans(
    match: Match,
    needs: Sequence[LayerNeed],
    headers: Sequence[RecordHeader],
    views: Sequence[memoryview],
    pages: cuda_pages.PinnedPages | None,
    decoded: list[Stack],
) -> list[RestorePlan] | None:
    """:func:`_plans` of a lossy restore on a CUDA GPU whose every layer is stored in
    another encoding in every block, laid out alike (a model without windows restored
    under a storage policy), made from the headers: each layer's rows of every record
    joined at once (:func:`~kvstore.codecs.alike_joins.joined_records`), no snapshot
    per (record, layer) decoded first. ``None`` where the restore is not so."""
    need = _one_whole_need(match, needs, headers)
    if pages is None or need is None:
        return None
    entries = [header.layers for header in headers]
    if any(entry is None or entry.signature == need.signature for entry in entries[0]):
        return None  # a layer stored as its cache is (joined_records: each record alike)
    payloads = [record_payload(view, header) for view, header in zip(views, headers)]
    cuts = [ref.rows if ref.trimmed else None for ref in match.blocks]
    stacks: list[Stack] = []
    layers = joined_records(entries, payloads, cuts, pages, stacks)
    if layers is None:
        return None
    return _converted_plans(layers, needs, list(range(len(needs))), stacks, decoded)


def _converted_plans(
    layers: list[list[Snapshot]],
    needs: Sequence[LayerNeed],
    recoded: list[int],
    stacks: list[Stack] | None,
    decoded: list[Stack] | None,
) -> list[RestorePlan]:
    """Every layer's plan from its snapshots, those of ``recoded`` (stored in another
    encoding) converted to their cache's first: where they were joined on a CUDA GPU
    (``stacks``: their joins' stacks), decoded in one go per stack
    (:func:`_stacked`); elsewhere a block's layers of one kind in one go
    (:func:`~kvstore.codecs.host_stacks.converted_by_block`)."""
    if stacks is not None:
        recoded = _stacked(layers, needs, recoded, stacks, decoded)
        if decoded and EARLY_DECODE:
            # Queued now, the decode runs on the device while this thread plans the
            # caches and their joins, rather than inside run_plans' evaluation.
            mx.async_eval([stack.whole for stack in decoded])
    elif recoded and switch_from_env("KVSTORE_STACKED_DECODE"):
        recoded = converted_by_block(layers, lambda i: needs[i].signature, recoded)
    for i in recoded:
        layers[i] = [transcode(s, needs[i].signature) for s in layers[i]]
    return [get_codec(need.signature).plan_restore(layers[i]) for i, need in enumerate(needs)]


def _stacked(
    layers: list[list[Snapshot]],
    needs: Sequence[LayerNeed],
    recoded: list[int],
    stacks: Sequence[Stack] = (),
    decoded: list[Stack] | None = None,
) -> list[int]:
    """Layers of ``recoded`` joined into one snapshot each, converted in one go per kind
    of stored and wanted signature where they stack (:func:`transcode_stacked`), in
    place; the layers left to convert one by one. ``KVSTORE_STACKED_DECODE=0``: none.

    A stack holds at most :data:`STACKED_DECODE_VECTORS` vectors of a kind (batch x
    heads x rows of a row tensor), so that a decode's float32 intermediates stay
    bounded (~512 MiB each at head_dim 128): a 4096-token llama-8B restore's 32 layers
    are one stack, a 16384-token one's four. Where the joins of a stack lie one after
    another in a gather's output (``stacks``, from :func:`join_runs`), the decode reads
    them there as they are, not concatenated."""
    if not switch_from_env("KVSTORE_STACKED_DECODE"):
        return recoded
    kinds: dict[tuple[str, str], list[list[int]]] = {}
    held: dict[tuple[str, str], int] = {}  # vectors in each kind's last stack
    for i in recoded:
        if len(layers[i]) != 1 or not layers[i][0].tensors:
            continue
        kind = (layers[i][0].signature, needs[i].signature)
        runs = kinds.setdefault(kind, [[]])
        vectors = math.prod(next(iter(layers[i][0].tensors.values())).shape[:3])
        if runs[-1] and held[kind] + vectors > STACKED_DECODE_VECTORS:
            runs.append([])
            held[kind] = 0
        held[kind] = held.get(kind, 0) + vectors
        runs[-1].append(i)
    done: set[int] = set()
    place = members_of(stacks)  # each gathered join's stack and place in it
    for (_, wanted), runs in kinds.items():
        for which in runs:
            snaps = [layers[i][0] for i in which]
            converted = transcode_stacked(snaps, wanted, _views_of(snaps, place), decoded)
            if converted is not None:
                for i, snap in zip(which, converted, strict=True):
                    layers[i] = [snap]
                done.update(which)
    return [i for i in recoded if i not in done]


def _views_of(
    snaps: Sequence[Snapshot], place: Mapping[int, tuple[Stack, int]]
) -> dict[str, mx.array]:
    """Each tensor name of ``snaps`` whose arrays are consecutive members of one
    :class:`Stack`, as the slice of its ``whole`` that stacks them (a view)."""
    out = {}
    for name in snaps[0].tensors:
        found = place.get(id(snaps[0].tensors[name]))
        if found is None:
            continue
        stack, at = found
        members = stack.members[at : at + len(snaps)]
        if len(members) == len(snaps) and all(
            m is s.tensors[name] for m, s in zip(members, snaps, strict=True)
        ):
            batch = int(members[0].shape[0])
            out[name] = stack.whole[at * batch : (at + len(snaps)) * batch]
    return out


#: Whether a lossy restore's stacked decode is queued on the device as soon as it is
#: made (the default), rather than evaluated with the caches' joins in
#: :func:`~kvstore.codecs.plans.run_plans` (``KVSTORE_EARLY_DECODE=0``). On the H200
#: the decode then runs while this thread plans the caches and their joins: fresh
#: processes restoring 4096 tokens of llama-8B, taken in turn (median of 4),
#: TurboQuant 4/4 25.5 -> 23.6 ms and ``kv:quant:8:64`` 27.5 -> 26.3, ``run_plans``
#: 5.1 -> 3.5 and 5.9 -> 3.3 ms (``tools/bench/results/gpu/d0ceccd/ab-early.txt``).
EARLY_DECODE = switch_from_env("KVSTORE_EARLY_DECODE")

#: The most vectors of a kind one stacked decode holds (:func:`_stacked`).
STACKED_DECODE_VECTORS = 1 << 20


def _first_rows(snap: Snapshot, rows: int) -> Snapshot:
    """``snap`` cut to its first ``rows`` tokens (a match ending inside the block)."""
    if rows == snap.tokens:
        return snap
    described = stored(snap.tensors)
    if described is not None:  # still described: a gather reads the rows where they lie
        return Snapshot(
            snap.signature, snap.start, snap.start + rows, described.cut(rows), snap.meta
        )
    tensors = {name: array[:, :, :rows] for name, array in snap.tensors.items()}
    return Snapshot(snap.signature, snap.start, snap.start + rows, tensors, snap.meta)
