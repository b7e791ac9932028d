"""The codec contract: cache (or a token range of it) <-> Snapshot.

A codec serves one cache family: it names the :class:`~kvstore.family.Family`
it implements (``family = QUANT_FAMILY``, declared by the cache module), and its
``kind`` and ``lossy`` are the family's; ``register_codec`` registers the codec
and its family together. It turns a live cache, or the token range
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
* ``meta`` always carries ``dtype`` (the float dtype of the rows or scales)
  and ``offset`` (the cache's offset when the snapshot was taken); windowed
  families add ``max_size`` and ``keep``.
* ``restore`` returns a cache whose arrays are owned MLX arrays (never views
  into the snapshot's buffers), with capacity rounded up past the restored
  tokens to the family's growth step, so the next decode step does not
  reallocate.
* Compatibility: two codecs may serve the same kind only if each reads the
  other's output (each one's ``version`` is in the other's ``reads``). A
  changed byte layout bumps ``version``; a changed meaning takes a new kind.
* Transcoding between families goes through dense rows: a codec that can
  offers :meth:`KVCodec.to_dense` and :meth:`KVCodec.from_dense`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from kvstore.errors import CapabilityError
from kvstore.family import Family
from kvstore.signature import parse_signature

__all__ = ["Snapshot", "KVCodec", "RestorePlan"]


# Snapshot sets its fields with one dict update, as the header entries do
# (kvstore.codecs.header): the generated frozen __init__ calls object.__setattr__ per
# field, and a 4096-token restore of a 32-layer model makes ~600 of them on its critical
# path. Nothing else differs: fields, eq, hash, repr, replace() and immutability are
# the dataclass's.
@dataclass(frozen=True, init=False)
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

    def __init__(
        self,
        signature: str,
        start: int,
        stop: int,
        tensors: Mapping[str, Any],
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        self.__dict__.update(
            signature=signature,
            start=start,
            stop=stop,
            tensors=tensors,
            meta={} if meta is None else meta,
        )

    @property
    def tokens(self) -> int:
        return self.stop - self.start


class RestorePlan(Protocol):
    """A restore checked and laid out, its arrays not allocated yet
    (:func:`kvstore.codecs.plans.run_plans` allocates every plan's at once).

    ``leaves`` lists the arrays to allocate as ``(shape, dtype name)``;
    ``finish(buffers)`` gets one ``(mx.array, writable numpy view)`` per leaf,
    zero-filled, and returns the live cache.
    """

    @property
    def leaves(self) -> Sequence[tuple[tuple[int, ...], str]]: ...

    def finish(self, buffers: Sequence[Any]) -> Any: ...


@dataclass(frozen=True)
class _RestoreLater:
    """The plan of a codec that does not plan: its ``restore`` runs at ``finish``."""

    codec: KVCodec
    snapshots: Snapshot | Sequence[Snapshot]
    leaves: tuple[tuple[tuple[int, ...], str], ...] = ()

    def finish(self, buffers: Sequence[Any]) -> Any:
        return self.codec.restore(self.snapshots)


class KVCodec(ABC):
    """Snapshots and restores one cache family; one instance per signature.

    Instances are immutable and compare equal when class and signature match.
    """

    #: The family this codec serves (declared by the cache module that implements it).
    family: ClassVar[Family]
    #: The signature kind this codec serves: ``family.kind`` (``"kv:quant"``).
    kind: ClassVar[str]
    #: True when :meth:`from_dense` loses information: ``family.lossy``.
    lossy: ClassVar[bool] = False
    #: Byte-layout version of this codec's snapshots.
    version: ClassVar[int] = 1
    #: Layout versions this codec reads (its own included).
    reads: ClassVar[frozenset[int]] = frozenset({1})
    #: Meta keys only this family's snapshots carry (how its rows were encoded);
    #: a transcode to another family leaves them behind.
    own_meta: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        family = cls.__dict__.get("family")
        if isinstance(family, Family):  # the family's facts, not restated on the codec
            cls.kind = family.kind
            cls.lossy = family.lossy

    def __init__(self, signature: str) -> None:
        self.signature = self.parse_signature(signature)

    @classmethod
    def parse_signature(cls, signature: str) -> str:
        """The canonical form of ``signature``; raises if it is not of this codec's kind."""
        sig = parse_signature(signature)
        if sig.kind != cls.kind:
            raise ValueError(
                f"[{cls.__name__}] serves kind '{cls.kind}'; received signature '{signature}'."
            )
        return str(sig)

    @abstractmethod
    def snapshot(self, cache: Any, start: int = 0, stop: int | None = None) -> Snapshot:
        """The logical content of ``cache`` for tokens ``[start, stop)``.

        Raises:
            CapabilityError: the cache is not of this codec's signature, or no
                longer holds (or never held) some of the positions asked for.
        """

    @abstractmethod
    def restore(self, snapshots: Snapshot | Sequence[Snapshot]) -> Any:
        """A live cache rebuilt from one snapshot or from ranges sorted by start."""

    def plan_restore(self, snapshots: Snapshot | Sequence[Snapshot]) -> RestorePlan:
        """:meth:`restore` split in two: check and lay out now, allocate and fill
        later with other layers' plans (one MLX evaluation for a whole model).
        A codec that does not override it restores when the plan finishes."""
        return _RestoreLater(self, snapshots)

    def description_problem(self, snapshot: Snapshot) -> str | None:
        """What is wrong with ``snapshot`` as a record header describes it -- its meta,
        and tensors that have shapes and dtypes but no data -- or ``None``.

        Decoding a record calls it for the layers of its header (``CorruptEntryError``
        naming the field), so a snapshot that restore would refuse never gets that far.
        A codec checks here what its restore relies on; the default checks nothing. The
        answer must depend on ``snapshot`` alone (its signature, range, tensor names,
        dtypes and shapes, and meta): a header's layers that describe the same snapshot
        are checked once.
        """
        return None

    def snapshot_held(self, cache: Any) -> list[Snapshot]:
        """Snapshots of every position ``cache`` will still attend to;
        ``restore`` of them rebuilds it. One snapshot for a growing cache; a
        windowed one past its window gives its sink range and its window."""
        return [self.snapshot(cache)]

    def slice(self, snapshot: Snapshot, start: int, stop: int) -> Snapshot:
        """The snapshot of the tokens ``[start, stop)`` of ``snapshot`` (a range of
        it): what :meth:`snapshot` of those tokens would have given. A save takes
        one snapshot of every new token and cuts it into blocks with this.

        Raises:
            CapabilityError: this family cannot cut its snapshots (the default);
                take a snapshot per block instead.
        """
        raise CapabilityError(
            f"[{type(self).__name__}.slice] {self.signature} snapshots cannot be cut into "
            f"ranges; snapshot each range from the cache.",
            signature=self.signature,
        )

    def to_dense(self, snapshot: Snapshot) -> tuple[Any, Any]:
        """``(keys, values)`` of ``snapshot`` as float rows ``[B, H, T, head_dim]``."""
        raise CapabilityError(
            f"[{type(self).__name__}.to_dense] {self.signature} has no dense form; "
            f"it cannot be transcoded.",
            signature=self.signature,
        )

    def from_dense(
        self, keys: Any, values: Any, *, start: int, stop: int, meta: Mapping[str, Any]
    ) -> Snapshot:
        """A snapshot of this codec's signature holding the float rows ``keys``/``values``.

        ``meta`` is the source snapshot's; the codec keeps what applies to it.
        """
        raise CapabilityError(
            f"[{type(self).__name__}.from_dense] {self.signature} cannot be built "
            f"from dense rows; it cannot be a transcode target.",
            signature=self.signature,
        )

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.signature == other.signature  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self), self.signature))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.signature!r}, version={self.version})"
