"""The codec contract: cache (or a token range of it) <-> Snapshot.

A codec serves one signature **kind** (``kv:quant``) and parses that kind's
parameters itself. It turns a live cache, or the token range
``[start, stop)`` of it, into a :class:`Snapshot` -- named tensors plus
msgpack-able metadata -- and rebuilds a live cache from one snapshot or from
snapshots of consecutive ranges.

Rules for implementers:

* Snapshots hold **logical content only**, in temporal order, shaped
  ``[B, H, T, width]``: never capacity padding, never trimmed tokens.
* Tensor names are layer-free (``keys``, ``values``, ``keys.scales``...);
  whoever stores several layers adds the layer context.
* Encoded payloads (affine words/scales/biases, TurboQuant codes/scales) are
  stored as they are: restore is bit-exact, nothing is re-quantised.
* Compatibility: two codecs may serve the same kind only if each reads the
  other's output. A changed byte layout bumps ``version``; a changed meaning
  takes a new kind.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = ["Snapshot", "KVCodec"]


@dataclass(frozen=True)
class Snapshot:
    """Named tensors and metadata for the tokens ``[start, stop)`` of one layer's cache.

    Attributes:
        signature: canonical signature of the family that produced it.
        start, stop: absolute token positions covered (``stop - start`` rows).
        tensors: layer-free name -> array ``[B, H, stop - start, width]``
            (``mx.array``, or a numpy view into a store page before restore).
        meta: msgpack-able family state (dtype, ``max_size``, ``keep``, ``offset``...).
    """

    signature: str
    start: int
    stop: int
    tensors: Mapping[str, Any]
    meta: Mapping[str, Any] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return self.stop - self.start


class KVCodec(ABC):
    """Snapshots and restores one cache family; one instance per signature."""

    #: The signature kind this codec serves (``"kv:quant"``).
    kind: ClassVar[str]
    #: Byte-layout version of this codec's snapshots.
    version: ClassVar[int] = 1

    def __init__(self, signature: str) -> None:
        self.signature = signature

    @abstractmethod
    def snapshot(self, cache: Any, start: int = 0, stop: int | None = None) -> Snapshot:
        """The logical content of ``cache`` for tokens ``[start, stop)``."""

    @abstractmethod
    def restore(self, snapshots: Snapshot | Sequence[Snapshot]) -> Any:
        """A live cache rebuilt from one snapshot or consecutive ranges."""

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.signature == other.signature  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self), self.signature))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.signature!r}, version={self.version})"
