"""Planning a migration: check everything, decide what DST will be, write nothing.

:func:`plan_migration` parses the target and layer spec, refuses what cannot
work (SRC = DST, in place where no atomic swap exists, a non-empty DST, a
journal of another migration), converts SRC's first record in memory (so a
target the stored layers cannot take fails before DST exists), and names the
conversions, lossy ones included, before anything is written.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, replace

from kvstore.abc.store import Backend, PrefixStore
from kvstore.codecs.record import read_header
from kvstore.errors import (
    CapabilityError,
    CorruptEntryError,
    FormatVersionError,
    StoreConfigError,
)
from kvstore.family import growing_family
from kvstore.signature import parse_signature
from kvstore.store import BACKEND_OPTIONS, open_backend
from kvstore.store import keys as K
from kvstore.store.blocks.stats import all_totals
from kvstore.store.maintenance.inventory import lmdb_path, open_existing, store_scheme
from kvstore.store.maintenance.migrate.journal import JOURNAL_KEY, Journal, decode_journal
from kvstore.store.maintenance.migrate.recode import plan_layers, recode_record
from kvstore.store.maintenance.migrate.targets import (
    LayerSelection,
    check_format_version,
    is_lossy,
    parse_layer_spec,
    parse_targets,
    target_layout,
)
from kvstore.store.maintenance.transfer import ChainWalk, StoredBlock, namespaces_of
from kvstore.store.settings import StoreSettings, parse_storage_policy

__all__ = ["IN_PLACE_SUFFIX", "Direction", "MigrationPlan", "plan_migration"]

#: ``--in-place`` migrates into this sibling of the store directory, then swaps.
IN_PLACE_SUFFIX = ".migrate-tmp"


@dataclass(frozen=True)
class Direction:
    """One conversion a migration makes: ``source`` rows of ``layers`` become ``target``."""

    source: str
    target: str
    layers: tuple[int, ...]
    lossy: bool

    def describe(self) -> str:
        return f"{self.source} -> {self.target} (layers {_ranges(self.layers)})"


def _ranges(indices: tuple[int, ...]) -> str:
    return parse_layer_spec(",".join(map(str, indices))).spec if indices else "none"


@dataclass(frozen=True)
class MigrationPlan:
    """What :func:`migrate` will do, decided before anything is written.

    Attributes:
        destination_state: ``"absent"``, ``"empty"``, ``"resumable"`` (holds a
            journal of this migration), or ``"overwrite"`` (holds data that
            ``overwrite=True`` replaces).
        directions: the conversions the first stored record needs (others are
            announced when met).
        settings: the settings DST is created with (SRC's; the storage policy
            follows ``to`` when every layer is converted).
    """

    source: str
    destination: str
    to: str | None
    layers: LayerSelection
    format_version: int | None
    in_place: bool
    blocks: int
    bytes: int
    namespaces: dict[str, tuple[int, int]]
    directions: tuple[Direction, ...]
    destination_state: str
    resume: Journal | None
    settings: StoreSettings

    @property
    def lossy(self) -> tuple[Direction, ...]:
        return tuple(d for d in self.directions if d.lossy)

    def lossy_line(self) -> str | None:
        """One line naming the lossy conversions, or ``None`` when there are none."""
        if not self.lossy:
            return None
        return (
            "lossy: "
            + "; ".join(d.describe() for d in self.lossy)
            + " re-quantises the stored rows; the error (relative MSE of K and V) is "
            "measured and reported per layer."
        )


@dataclass(frozen=True)
class Inputs:
    """A migration's parsed parameters (what its journal is checked against)."""

    to: str | None
    layers: LayerSelection
    format_version: int | None


def _parse_inputs(to: str | None, layers: str | None, format_version: int | None) -> Inputs:
    # Neither ``to`` nor ``format_version``: every record is copied as it is (checked),
    # into a store of today's layout (an LMDB store written before the value file moves
    # to it so).
    if layers is not None and to is None:
        raise StoreConfigError(
            f"[migrate] --layers {layers} selects layers to convert with --to; give --to too.",
            found=layers,
        )
    return Inputs(
        None if to is None else parse_targets(to),
        parse_layer_spec(layers),
        check_format_version(format_version),
    )


def _same_store(a: str, b: str) -> bool:
    pa, pb = lmdb_path(a), lmdb_path(b)
    if pa is not None and pb is not None:
        return os.path.realpath(pa) == os.path.realpath(pb)
    return a == b


def _destination(src: str, dst: str | None, in_place: bool) -> str:
    if in_place:
        path = lmdb_path(src)
        if path is None:
            raise CapabilityError(
                f"[migrate] --in-place swaps an LMDB store directory for its migrated copy in "
                f"one atomic rename; {store_scheme(src)} stores ({src}) cannot be swapped "
                f"atomically. Migrate into a new DST and point clients at it.",
                scheme=store_scheme(src),
            )
        if dst is not None and not _same_store(src, dst):
            raise StoreConfigError(
                f"[migrate] --in-place migrates SRC into itself; DST {dst!r} differs. Drop "
                f"DST, or drop --in-place.",
                found=dst,
            )
        real = os.path.realpath(path)
        return f"lmdb://{real}{IN_PLACE_SUFFIX}"
    if dst is None:
        raise StoreConfigError(
            "[migrate] Give DST (where the migrated store goes), or --in-place to replace SRC.",
        )
    if _same_store(src, dst):
        raise StoreConfigError(
            f"[migrate] SRC and DST are the same store ({src}); migrate into a new DST, or "
            f"use --in-place to replace SRC atomically.",
            found=dst,
        )
    for url in (src, dst):
        if store_scheme(url) == "tiered":
            raise CapabilityError(
                f"[migrate] {url} is a tiered store; migrate each tier's URL on its own.",
                scheme="tiered",
            )
    return dst


def _read_settings(store: PrefixStore, inputs: Inputs) -> StoreSettings:
    """SRC's settings for DST; the storage policy follows ``to`` when every layer
    converts: its growing family when that is a storage policy, ``lossless`` when
    that is a lossless KV family, else SRC's. A per-layer ``to`` that names every
    attention layer (a default, or both kinds) gives a per-layer policy of the same."""
    settings = store.settings
    if inputs.to is None or not inputs.layers.everything:
        return settings
    layout = target_layout(inputs.to)
    if layout is None:
        policy = _policy_of(inputs.to)
        return replace(settings, storage_policy=policy or settings.storage_policy)
    covers = layout.default is not None or {"global", "sliding"} <= dict(layout.kinds).keys()
    policies = {value: _policy_of(value) for value in layout.values()}
    if not covers or None in policies.values():  # some layers keep SRC's policy
        return settings
    per_layer = layout.map_values(lambda v: policies[v] or "")
    return replace(settings, storage_policy=parse_storage_policy(per_layer))


def _policy_of(target: str) -> str | None:
    """The storage policy storing layers as ``target`` does, if one does."""
    sig = parse_signature(target)
    family = growing_family(sig.kind)
    if family.storage_policy:
        return family.signature(*sig.params)
    if not family.lossy and family.holds_kv:
        return "lossless"
    return None


def walks(backend: Backend) -> Iterator[ChainWalk]:
    """A parents-first walk of each namespace, in namespace order."""
    for ns in sorted(namespaces_of(backend)):
        yield ChainWalk(backend, ns)


def all_blocks(backend: Backend) -> Iterator[StoredBlock]:
    for walk in walks(backend):
        yield from walk


def record_directions(signatures: list[str | None], inputs: Inputs) -> list[Direction]:
    targets = plan_layers(signatures, inputs.to, inputs.layers)
    found: dict[tuple[str, str], list[int]] = {}
    for i, (s, t) in enumerate(zip(signatures, targets)):
        if s is not None and t is not None and s != t:
            found.setdefault((s, t), []).append(i)
    return [Direction(s, t, tuple(ix), is_lossy(s, t)) for (s, t), ix in found.items()]


def merged_directions(found: dict[tuple[str, str], set[int]]) -> tuple[Direction, ...]:
    """Directions from ``{(source, target): layers}``."""
    return tuple(Direction(s, t, tuple(sorted(ix)), is_lossy(s, t)) for (s, t), ix in found.items())


def _preflight(src: PrefixStore, inputs: Inputs) -> tuple[Direction, ...]:
    """Convert the first stored record in memory: a target that cannot take the
    store's layers fails here, before DST exists. Returns its conversions."""
    for block in all_blocks(src.backend):
        record = src.backend.get_many([block.record_key])[0]
        if record is None:
            continue
        try:
            header = read_header(record)
        except (CorruptEntryError, FormatVersionError):
            continue  # the walk reports it
        inputs.layers.check(len(header.layers))
        _check_layout(inputs.to, len(header.layers))
        recode_record(
            record, to=inputs.to, layers=inputs.layers, reencode=inputs.format_version is not None
        )
        signatures = [None if layer is None else layer.signature for layer in header.layers]
        return tuple(record_directions(signatures, inputs))
    return ()


def _check_layout(to: str | None, layers: int) -> None:
    layout = None if to is None else target_layout(to)
    top = None if layout is None else layout.max_index()
    if top is not None and top >= layers:
        raise StoreConfigError(
            f"[migrate] --to names layer {top}, but the store's records hold {layers} layers "
            f"(0-{layers - 1}).",
            found=to,
            layers=layers,
        )


def _destination_state(dst: str, inputs: Inputs, overwrite: bool) -> tuple[str, Journal | None]:
    """Look at DST without creating it: ``(state, journal to resume)``."""
    path = lmdb_path(dst)
    if path is not None and (
        not os.path.exists(path) or (os.path.isdir(path) and not os.listdir(path))
    ):
        return "absent", None
    readonly = "readonly" in BACKEND_OPTIONS.get(store_scheme(dst), {})
    options = {"readonly": True} if readonly else {}
    backend = open_backend(dst, **options)
    try:
        with backend.reader() as view:
            raw = view.get(JOURNAL_KEY)
            journal_raw = None if raw is None else bytes(raw)
            meta = view.contains(K.META_KEY)
            totals = all_totals(view)
        entries = int(backend.stats().get("entries", 0))
    finally:
        backend.close()
    if journal_raw is not None:
        journal = decode_journal(journal_raw) if not overwrite else None
        if journal is not None and journal.identity != _identity(inputs):
            raise StoreConfigError(
                f"[migrate] {dst} holds an interrupted migration with --to {journal.to} "
                f"--layers {journal.layers} --format-version {journal.format_version}. Rerun "
                f"with those to resume it, or pass --overwrite to start over.",
                found=journal.identity,
                requested=_identity(inputs),
            )
        return ("overwrite", None) if overwrite else ("resumable", journal)
    if totals or entries > int(meta):
        if not overwrite:
            blocks = sum(b for b, _ in totals.values())
            raise StoreConfigError(
                f"[migrate] {dst} is not empty ({blocks} blocks, {entries} keys); refusing to "
                f"write into it. Pass --overwrite to replace its contents, or give a new DST.",
                found=dst,
            )
        return "overwrite", None
    return "empty", None


def _identity(inputs: Inputs) -> tuple[str | None, str, int | None]:
    return (inputs.to, inputs.layers.spec, inputs.format_version)


def plan_migration(
    src: str,
    dst: str | None = None,
    *,
    to: str | None = None,
    layers: str | None = None,
    format_version: int | None = None,
    overwrite: bool = False,
    in_place: bool = False,
) -> MigrationPlan:
    """Check a migration and say what it would do; writes nothing.

    Raises:
        UnknownSignatureError: ``to`` does not parse, or no codec serves it.
        FormatVersionError: a ``format_version`` this kvstore does not write.
        StoreConfigError: a bad ``layers`` spec, a missing SRC, SRC = DST, a
            non-empty DST without ``overwrite``, a journal of another migration.
        CapabilityError: ``in_place`` where no atomic swap exists; a target
            family the stored layers cannot be converted to.
    """
    inputs = _parse_inputs(to, layers, format_version)
    destination = _destination(src, dst, in_place)
    with open_existing(src, operation="migrate") as store:
        directions = _preflight(store, inputs)
        totals = namespaces_of(store.backend)
        settings = _read_settings(store, inputs)
    state, journal = _destination_state(destination, inputs, overwrite)
    return MigrationPlan(
        source=src,
        destination=destination,
        to=inputs.to,
        layers=inputs.layers,
        format_version=inputs.format_version,
        in_place=in_place,
        blocks=sum(b for b, _ in totals.values()),
        bytes=sum(n for _, n in totals.values()),
        namespaces={ns.decode(): t for ns, t in sorted(totals.items())},
        directions=directions,
        destination_state=state,
        resume=journal,
        settings=settings,
    )
