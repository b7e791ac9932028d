"""Which cache family each layer gets: :class:`CachePolicy` and :func:`make_caches`.

The policy names one growing family (plain by default; ``kv_bits``,
``turboquant`` or any registered family by its signature, ``family=``), and
optionally a per-layer :class:`~kvstore.layout.LayerLayout` (``layout=``:
families by layer index, by kind of layer -- ``global``, ``sliding``,
``recurrent`` -- and as a default; issue 17). A layer the layout does not name
gets the policy's family. Full-attention layers get the family named;
sliding-window layers the windowed family that keeps a window of it, found in
the registry (:mod:`kvstore.family`); recurrent layers keep their own state's
family unless the layout names one of that kind. Caches are built by the
family's own factory (``Family.make``), so a plug-in family is built like a
built-in one. :meth:`CachePolicy.layer_signature` is the one per-layer decision.

A policy round-trips through a layout file (:meth:`CachePolicy.from_file`,
:meth:`CachePolicy.to_file`; ``kvstore tune`` writes them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from kvstore.caches.packed import fitting_groups
from kvstore.caches.plain import PLAIN_FAMILY
from kvstore.caches.quantized import QUANT_FAMILY
from kvstore.caches.turboquant import TURBOQUANT_FAMILY
from kvstore.errors import CapabilityError
from kvstore.family import windowed_family
from kvstore.layout import (
    LayerLayout,
    kind_of_layer,
    parse_layout,
    read_layout_file,
    write_layout_file,
)
from kvstore.signature import Signature, parse_signature

__all__ = ["CachePolicy", "LayerGeometry", "make_caches"]

#: One layer's attention geometry, as ``model.layer_layout()`` reports it:
#: ``{"n_kv_heads": int, "head_dim": int, "sliding_window": int | None}``.
LayerGeometry = dict[str, Any]


@dataclass(frozen=True)
class CachePolicy:
    """How to encode each layer's keys and values.

    Attributes:
        kv_bits: affine-quantize rows with this many bits (``kv:quant`` and, on
            sliding layers, ``kv:rotating-quant``); ``None`` keeps them raw.
        kv_group_size: affine group size (must divide the head dim).
        turboquant: ``(kbits, vbits)`` for TurboQuant rows.
        family: the signature of any registered growing KV family
            (``"kv:mxfp4"``, ``"kv:quant:4:64"``, a plug-in's); sliding layers
            get its windowed family.
        keep: sink tokens a sliding-window layer keeps besides its window
            (0, as mlx-lm's windowed models make their caches).
        layout: families per layer (a :class:`~kvstore.layout.LayerLayout`, or its
            text or dict form): by index, by kind of layer, and a default; growing
            families for attention layers, a recurrent state's family for
            ``recurrent``. Layers it does not name get the policy's family.

    ``kv_bits``, ``turboquant``, ``family`` and a layout's ``default`` exclude one
    another.

    Raises:
        ValueError: more than one family asked for, a signature that does not
            parse (``UnknownSignatureError`` for an unregistered kind), a
            windowed or non-KV family, a ``sliding`` family with no windowed
            counterpart, a KV family named for ``recurrent`` layers, or a
            negative ``keep``.
    """

    kv_bits: int | None = None
    kv_group_size: int = 64
    turboquant: tuple[int, int] | None = None
    family: str | None = None
    keep: int = 0
    layout: LayerLayout | Mapping[str, Any] | str | None = None

    def __post_init__(self) -> None:
        if self.layout is not None:
            layout = parse_layout(self.layout, _canonical, "CachePolicy")
            object.__setattr__(self, "layout", layout)
        chosen = {
            name: value
            for name, value in (
                ("kv_bits", self.kv_bits),
                ("turboquant", self.turboquant),
                ("family", self.family),
                ("layout default", self.layout_spec().default),
            )
            if value is not None
        }
        if len(chosen) > 1:
            given = " and ".join(f"{k}={v!r}" for k, v in chosen.items())
            raise ValueError(
                f"[CachePolicy] {', '.join(chosen)} are exclusive; received {given}. Pick one."
            )
        if self.turboquant is not None and len(self.turboquant) != 2:
            raise ValueError(
                f"[CachePolicy] turboquant must be (kbits, vbits); received {self.turboquant!r}."
            )
        _check_growing(self.signature(), "family")  # names the allowed values
        layout = self.layout_spec()
        for kind, text in layout.kinds:
            sig = parse_signature(text)
            if kind == "recurrent":
                if sig.family.holds_kv:
                    raise ValueError(
                        f"[CachePolicy] layout recurrent={sig} names a family of keys and "
                        f"values ({sig.family.description}); recurrent layers keep a "
                        f"recurrent state. Name a recurrent family, or leave them out."
                    )
                continue
            _check_growing(sig, f"layout {kind}")
            if kind == "sliding":
                _windowed(sig, "sliding layers")
        for i, text in layout.layers:  # kinds of indexed layers are checked per model
            sig = parse_signature(text)
            if sig.family.holds_kv:
                _check_growing(sig, f"layout layer {i}")
        if self.keep < 0:
            raise ValueError(f"[CachePolicy] keep must be >= 0; received {self.keep}.")

    def layout_spec(self) -> LayerLayout:
        """The per-layer layout (empty when the policy gives every layer one family)."""
        # __post_init__ made any layout given a LayerLayout.
        return LayerLayout() if self.layout is None else cast(LayerLayout, self.layout)

    def signature(self) -> Signature:
        """The growing family's signature: what a full-attention layer the layout does
        not name gets (the layout's default when it has one)."""
        default = self.layout_spec().default
        if default is not None:
            return parse_signature(default)
        if self.family is not None:
            return parse_signature(self.family)
        if self.kv_bits is not None:
            return parse_signature(QUANT_FAMILY.signature(self.kv_bits, self.kv_group_size))
        if self.turboquant is not None:
            return parse_signature(TURBOQUANT_FAMILY.signature(*self.turboquant))
        return parse_signature(PLAIN_FAMILY.signature())

    def layer_signature(self, index: int, layer: LayerGeometry) -> Signature:
        """The signature of layer ``index``'s cache: the family the layout names for
        it (by index, then by kind) or the policy's, and on a sliding-window layer
        the windowed family keeping a window of it.

        Raises:
            CapabilityError: a sliding layer, and no windowed family is registered
                for its family; a recurrent layer given a family of keys and values,
                or an attention layer given a recurrent one.
        """
        kind = kind_of_layer(layer)
        named = self.layout_spec().value_for(index, kind)
        if kind == "recurrent":
            own = parse_signature(layer["recurrent"])
            if named is None:
                return own  # a recurrent layer keeps its own state (issue 16)
            sig = parse_signature(named)
            if sig.kind != own.kind:
                raise CapabilityError(
                    f"[make_cache] Layer {index} is a recurrent layer keeping {own.kind} "
                    f"state; the layout names {sig} ({sig.family.description}) for it.",
                    family=sig.kind,
                    layer=index,
                )
            return sig
        sig = self.signature() if named is None else parse_signature(named)
        if not sig.family.holds_kv:
            raise CapabilityError(
                f"[make_cache] Layer {index} is an attention layer; the layout names {sig} "
                f"({sig.family.description}) for it. Name a family of keys and values.",
                family=sig.kind,
                layer=index,
            )
        if kind == "global":
            return sig
        return _windowed(sig, f"layer {index} (sliding window)", index)

    @classmethod
    def from_file(cls, path: str | Path, *, keep: int | None = None) -> CachePolicy:
        """The policy a layout file holds (``kvstore tune`` writes them).

        Raises:
            ValueError: not a layout file, or a family it names is unknown or unfit.
        """
        layout, data = read_layout_file(path, "CachePolicy")
        return cls(layout=layout, keep=int(data.get("keep", 0)) if keep is None else keep)

    def to_layout(self) -> LayerLayout:
        """The policy as one layout: its layout, with the policy's family as default."""
        spec = self.layout_spec()
        return LayerLayout(str(self.signature()), spec.kinds, spec.layers)

    def to_file(self, path: str | Path, **extra: Any) -> Path:
        """Write the policy as a layout file (``extra``: JSON-ready fields kept beside it)."""
        return write_layout_file(path, self.to_layout(), keep=self.keep, **extra)


def _canonical(text: str) -> str:
    return str(parse_signature(text))


def _check_growing(sig: Signature, what: str) -> None:
    family = sig.family
    if family.windowed or not family.holds_kv:
        raise ValueError(
            f"[CachePolicy] {what} must be a growing family of keys and values; "
            f"'{sig}' is {family.description}. Name the growing family"
            + (
                f" ({family.window_of}); sliding layers get its windowed family."
                if family.windowed
                else "."
            )
        )


def _windowed(sig: Signature, what: str, index: int | None = None) -> Signature:
    """The windowed family keeping a window of ``sig``'s (same parameters)."""
    windowed = windowed_family(sig.kind)
    if windowed is None:
        message = (
            f"{what}: no registered family keeps a window of {sig.kind} "
            f"({sig.family.description}); use a family with a windowed counterpart."
        )
        if index is None:
            raise ValueError(f"[CachePolicy] {message}")
        raise CapabilityError(f"[make_cache] {message}", family=sig.kind, layer=index)
    return parse_signature(windowed.signature(*sig.params))


def _check_groups(
    policy: CachePolicy, signatures: Sequence[Signature], layout: Sequence[LayerGeometry]
) -> None:
    """A quantized family's group must divide its layer's head dim: say so before
    any cache exists (the caches would raise on their first update)."""
    for i, (sig, layer) in enumerate(zip(signatures, layout)):
        family = sig.family
        q = family.quantization(sig)
        if q is None:
            continue
        head_dim = layer["head_dim"]
        if head_dim % q.group_size == 0:
            continue
        fits = fitting_groups(family, head_dim)
        if policy.kv_bits is not None and sig == policy.signature():
            what = f"kv_group_size {q.group_size}"
            fix = "use kv_group_size " + (
                " or ".join(map(str, fits)) or "(none fits: use turboquant or no kv_bits)"
            )
        else:
            what = f"{sig}'s group size {q.group_size}"
            fix = (
                f"use group size {' or '.join(map(str, fits))}"
                if fits
                else "use a family whose group fits, or one without groups"
            )
        raise CapabilityError(
            f"[make_cache] {what} does not divide head_dim {head_dim} of layer {i}; {fix}.",
            head_dim=head_dim,
            group_size=q.group_size,
            fitting_groups=fits,
        )


def make_caches(layout: Sequence[LayerGeometry], policy: CachePolicy | None = None) -> list[Any]:
    """One fresh cache per layer of ``layout``, of the family ``policy`` asks for.

    Sliding layers get the windowed variant of the family, sized to the window;
    a recurrent layer (``{"recurrent": kind}``) its own family's state.

    Raises:
        CapabilityError: a quantized family's group does not divide a layer's
            head dim, a sliding layer whose family has no windowed counterpart,
            or a family that declares no cache factory.
    """
    policy = policy or CachePolicy()
    top = policy.layout_spec().max_index()
    if top is not None and top >= len(layout):
        raise CapabilityError(
            f"[make_cache] The policy's layout names layer {top}; the model has "
            f"{len(layout)} layers (0-{len(layout) - 1}).",
            layer=top,
            layers=len(layout),
        )
    signatures = [policy.layer_signature(i, layer) for i, layer in enumerate(layout)]
    _check_groups(policy, signatures, layout)
    return [
        sig.family.make(
            sig,
            window=layer["sliding_window"] if sig.family.windowed else None,
            keep=policy.keep,
        )
        for sig, layer in zip(signatures, layout)
    ]
