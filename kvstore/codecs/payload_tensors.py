"""A stored layer's tensors as views into its record's payload, each made when asked.

A restore on a CUDA GPU reads a lossy layer's rows straight out of the store's
pinned pages (:func:`kvstore.codecs.plans.join_runs`): what it needs of each
tensor is where it lies and its shape, which the header says, not a numpy view
of it. A 4096-token ``kv:quant:8:64`` restore of llama-8B has 3,072 such
tensors; making a view of each and reading its address back cost about 3 us a
tensor here, the longest per-piece step left before the gather's one kernel.
Anything else that asks for a tensor gets the same view a decode makes
(:class:`PayloadTensors` is a read-only mapping of name -> view).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from kvstore.codecs.arrays import numpy_dtype
from kvstore.codecs.header import TensorEntry

__all__ = [
    "Payload",
    "PayloadTensors",
    "entries_by_name",
    "numpy_view",
    "same_entries",
    "stored",
]


def numpy_view(payload: memoryview, entry: TensorEntry) -> np.ndarray:
    """Tensor ``entry`` of ``payload``, a numpy view (no copy)."""
    # The array made on the buffer directly, not frombuffer and a reshape: a 4096-token
    # kv:quant:8:64 restore's 16 records (3,072 views) decode in 4.2 ms, not 11.4. It
    # refuses a buffer too small as frombuffer does; the header's extents were checked.
    return np.ndarray(entry.shape, numpy_dtype(entry.dtype), payload, entry.offset)


class Payload:
    """A record's payload (a view into the store's pages) and its address, found once."""

    __slots__ = ("view", "_address")

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self._address: int | None = None

    @property
    def address(self) -> int:
        """The host address of the payload's first byte."""
        if self._address is None:
            self._address = int(np.frombuffer(self.view, np.uint8).ctypes.data)
        return self._address


#: Each header's layer entries by name, one mapping per tuple of entries, kept with it
#: (so its ``id`` stays its own): the records of one header template share their
#: layers' tuples, and so their :class:`PayloadTensors` share one mapping, which a
#: restore's joins compare by identity (:func:`same_entries`).
_BY_NAME: dict[int, tuple[Sequence[TensorEntry], dict[str, TensorEntry]]] = {}
_BY_NAME_LIMIT = 4096


def entries_by_name(entries: Sequence[TensorEntry]) -> dict[str, TensorEntry]:
    """A layer's header ``entries`` by name: the one mapping of that tuple of entries."""
    found = _BY_NAME.get(id(entries))
    if found is not None and found[0] is entries:
        return found[1]
    mapping = {entry.name: entry for entry in entries}
    if len(_BY_NAME) >= _BY_NAME_LIMIT:
        _BY_NAME.clear()  # crude, but bounded
    _BY_NAME[id(entries)] = (entries, mapping)
    return mapping


class PayloadTensors(Mapping[str, np.ndarray]):
    """One layer's tensors in ``payload``, described by its header ``entries``
    (their extents checked by the header's parse); each view made on first access.
    With ``rows``, each tensor is its first ``rows`` rows (``[:, :, :rows]``: a match
    ending inside the block), as :meth:`cut` makes it."""

    __slots__ = ("payload", "entries", "rows", "_described", "_views")

    def __init__(
        self, payload: Payload, entries: Sequence[TensorEntry], rows: int | None = None
    ) -> None:
        self.payload = payload
        #: Name -> entry; the same mapping for every layer of one header template.
        self.entries = entries_by_name(entries)
        self.rows = rows
        self._described = entries
        self._views: dict[str, np.ndarray] = {}

    def cut(self, rows: int) -> PayloadTensors:
        """These tensors' first ``rows`` rows."""
        return PayloadTensors(self.payload, self._described, rows)

    def __getitem__(self, name: str) -> np.ndarray:
        view = self._views.get(name)
        if view is None:
            view = numpy_view(self.payload.view, self.entries[name])
            if self.rows is not None:
                view = view[:, :, : self.rows]
            self._views[name] = view
        return view

    def __contains__(self, name: object) -> bool:  # Mapping's would make the view
        return name in self.entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        """Tensor ``name``'s shape (no view made)."""
        shape = self.entries[name].shape
        if self.rows is None:
            return shape
        return (*shape[:2], min(self.rows, shape[2]), *shape[3:])

    def address(self, name: str) -> int:
        """The host address of tensor ``name``'s first byte (no view made)."""
        return self.payload.address + self.entries[name].offset


def same_entries(tensors: Sequence[PayloadTensors]) -> bool:
    """Whether ``tensors`` are laid out alike (one header template's layer: the same
    names, dtypes, shapes and offsets in each payload), asked by identity."""
    entries = tensors[0].entries
    for t in tensors:
        if t.entries is not entries:
            return False
    return True


def stored(tensors: Mapping[str, object]) -> PayloadTensors | None:
    """``tensors`` as a :class:`PayloadTensors`, or ``None`` when they are not one."""
    return tensors if isinstance(tensors, PayloadTensors) else None
