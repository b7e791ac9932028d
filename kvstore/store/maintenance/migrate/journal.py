"""The migration journal: what a migration into a store is doing, kept in that store.

One msgpack value under :data:`JOURNAL_KEY`, outside the ``kvstore/v1/``
layout so that the store itself (lookups, ``verify``) never sees it. It is
written when a migration starts and rewritten in every transaction that
commits migrated blocks, so it always agrees with them: blocks done, bytes
before and after, and the running sums of the measured error per layer.
A store holding a journal is a migration in progress (resumable with the
same parameters); the journal is removed when the migration completes.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack

from kvstore.abc.store import Buffer
from kvstore.errors import CorruptEntryError
from kvstore.store.maintenance.migrate.recode import LayerChange

__all__ = ["JOURNAL_KEY", "JOURNAL_FORMAT", "LayerError", "Journal", "decode_journal"]

JOURNAL_KEY = b"kvstore/migrate/journal"
JOURNAL_FORMAT = 1


@dataclass
class LayerError:
    """Running error of one layer's conversion (``source`` -> ``target``).

    ``keys``/``values`` are token-weighted sums of relative MSE: divided by
    ``tokens`` they are the mean over every vector converted.
    """

    layer: int
    source: str
    target: str
    tokens: int = 0
    keys: float = 0.0
    values: float = 0.0
    max_keys: float = 0.0
    max_values: float = 0.0

    @property
    def mean_keys(self) -> float:
        return self.keys / self.tokens if self.tokens else 0.0

    @property
    def mean_values(self) -> float:
        return self.values / self.tokens if self.tokens else 0.0


@dataclass
class Journal:
    """A migration's parameters and progress.

    ``to``, ``layers`` and ``format_version`` identify the migration: a resume
    must ask for the same ones.
    """

    source: str
    to: str | None
    layers: str
    format_version: int | None
    started: float = field(default_factory=time.time)
    blocks: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    errors: dict[str, LayerError] = field(default_factory=dict)

    @property
    def identity(self) -> tuple[str | None, str, int | None]:
        return (self.to, self.layers, self.format_version)

    def add(self, before: int, after: int, changes: Iterable[LayerChange]) -> None:
        """Count one migrated block (``after`` bytes written for ``before`` read)."""
        self.blocks += 1
        self.bytes_before += before
        self.bytes_after += after
        for c in changes:
            key = f"{c.layer}:{c.source}:{c.target}"
            e = self.errors.setdefault(key, LayerError(c.layer, c.source, c.target))
            e.tokens += c.tokens
            e.keys += c.rel_mse[0] * c.tokens
            e.values += c.rel_mse[1] * c.tokens
            e.max_keys = max(e.max_keys, c.rel_mse[0])
            e.max_values = max(e.max_values, c.rel_mse[1])

    def layer_errors(self) -> list[LayerError]:
        return sorted(self.errors.values(), key=lambda e: (e.layer, e.source, e.target))

    def encode(self) -> bytes:
        body: dict[str, Any] = asdict(self)
        body["errors"] = [asdict(e) for e in self.layer_errors()]
        return msgpack.packb({"format": JOURNAL_FORMAT, **body})


def decode_journal(raw: Buffer) -> Journal:
    """Parse a journal value.

    Raises:
        CorruptEntryError: not a journal this kvstore wrote.
    """
    try:
        body = msgpack.unpackb(bytes(raw), max_str_len=1 << 16, max_array_len=1 << 16)
        version = body.pop("format")
        if version != JOURNAL_FORMAT:
            raise ValueError(f"journal format {version!r}, this kvstore reads {JOURNAL_FORMAT}")
        errors = [LayerError(**e) for e in body.pop("errors")]
        journal = Journal(**body)
    except Exception as exc:  # noqa: BLE001 - any failure means the journal is unusable
        raise CorruptEntryError(
            f"[migrate] The migration journal ({JOURNAL_KEY.decode()}) does not decode: {exc}. "
            f"Start over with --overwrite.",
        ) from exc
    journal.errors = {f"{e.layer}:{e.source}:{e.target}": e for e in errors}
    return journal
