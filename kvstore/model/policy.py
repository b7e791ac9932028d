"""Which cache family each layer gets: :class:`CachePolicy` and :func:`make_caches`.

The policy names one growing family (plain by default; ``kv_bits``,
``turboquant`` or any registered family by its signature, ``family=``).
Full-attention layers get it; sliding-window layers get the windowed family
that keeps a window of it, found in the registry (:mod:`kvstore.family`).
Caches are built by the family's own factory (``Family.make``), so a plug-in
family is built like a built-in one. :meth:`CachePolicy.layer_signature` is
the one per-layer decision (issue 17 adds per-layer families there).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.caches.packed import fitting_groups
from kvstore.caches.plain import PLAIN_FAMILY
from kvstore.caches.quantized import QUANT_FAMILY
from kvstore.caches.turboquant import TURBOQUANT_FAMILY
from kvstore.errors import CapabilityError
from kvstore.family import windowed_family
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

    ``kv_bits``, ``turboquant`` and ``family`` exclude one another.

    Raises:
        ValueError: more than one family asked for, a signature that does not
            parse (``UnknownSignatureError`` for an unregistered kind), a
            windowed or non-KV family, or a negative ``keep``.
    """

    kv_bits: int | None = None
    kv_group_size: int = 64
    turboquant: tuple[int, int] | None = None
    family: str | None = None
    keep: int = 0

    def __post_init__(self) -> None:
        chosen = {
            name: value
            for name, value in (
                ("kv_bits", self.kv_bits),
                ("turboquant", self.turboquant),
                ("family", self.family),
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
        sig = self.signature()  # names the allowed values
        family = sig.family
        if family.windowed or not family.holds_kv:
            raise ValueError(
                f"[CachePolicy] family must be a growing family of keys and values; "
                f"'{sig}' is {family.description}. Name the growing family"
                + (
                    f" ({family.window_of}); sliding layers get its windowed family."
                    if family.windowed
                    else "."
                )
            )
        if self.keep < 0:
            raise ValueError(f"[CachePolicy] keep must be >= 0; received {self.keep}.")

    def signature(self) -> Signature:
        """The growing family's signature: what every full-attention layer gets."""
        if self.family is not None:
            return parse_signature(self.family)
        if self.kv_bits is not None:
            return parse_signature(QUANT_FAMILY.signature(self.kv_bits, self.kv_group_size))
        if self.turboquant is not None:
            return parse_signature(TURBOQUANT_FAMILY.signature(*self.turboquant))
        return parse_signature(PLAIN_FAMILY.signature())

    def layer_signature(self, index: int, layer: LayerGeometry) -> Signature:
        """The signature of layer ``index``'s cache: the policy's family, or on a
        sliding-window layer the windowed family keeping a window of it.

        Raises:
            CapabilityError: a sliding layer, and no windowed family is registered
                for the policy's.
        """
        if "recurrent" in layer:
            # A recurrent layer keeps its own state (issue 16); the policy is about KV rows.
            return parse_signature(layer["recurrent"])
        sig = self.signature()
        if layer["sliding_window"] is None:
            return sig
        windowed = windowed_family(sig.kind)
        if windowed is None:
            raise CapabilityError(
                f"[make_cache] Layer {index} has a sliding window, and no registered family "
                f"keeps a window of {sig.kind} ({sig.family.description}); use a family with "
                f"a windowed counterpart for this model.",
                family=sig.kind,
                layer=index,
            )
        return parse_signature(windowed.signature(*sig.params))


def _check_groups(policy: CachePolicy, sig: Signature, layout: Sequence[LayerGeometry]) -> None:
    """A quantized family's group must divide every layer's head dim: say so before
    any cache exists (the caches would raise on their first update)."""
    family = sig.family
    q = family.quantization(sig)
    if q is None:
        return
    for i, layer in enumerate(layout):
        if "recurrent" in layer:
            continue
        head_dim = layer["head_dim"]
        if head_dim % q.group_size == 0:
            continue
        fits = fitting_groups(family, head_dim)
        if policy.kv_bits is not None:
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
    _check_groups(policy, policy.signature(), layout)
    caches = []
    for i, layer in enumerate(layout):
        sig = policy.layer_signature(i, layer)
        window = layer.get("sliding_window")
        caches.append(sig.family.make(sig, window=window, keep=policy.keep))
    return caches
