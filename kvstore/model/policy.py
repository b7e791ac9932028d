"""Which cache family each layer gets: :class:`CachePolicy` and :func:`make_caches`."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from kvstore.caches import KVCache, QuantizedKVCache, RotatingKVCache, RotatingQuantizedKVCache
from kvstore.caches.quantized import fitting_groups
from kvstore.caches.recurrent import GatedDeltaCache
from kvstore.errors import CapabilityError
from kvstore.signature import make_signature

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
        turboquant: ``(kbits, vbits)`` for TurboQuant rows; excludes ``kv_bits``.
        keep: sink tokens a sliding-window layer keeps besides its window
            (0, as mlx-lm's windowed models make their caches).
    """

    kv_bits: int | None = None
    kv_group_size: int = 64
    turboquant: tuple[int, int] | None = None
    keep: int = 0

    def __post_init__(self) -> None:
        if self.kv_bits is not None and self.turboquant is not None:
            raise ValueError(
                "[CachePolicy] kv_bits and turboquant are exclusive; received "
                f"kv_bits={self.kv_bits} and turboquant={self.turboquant}. Pick one."
            )
        if self.kv_bits is not None:
            make_signature("kv:quant", self.kv_bits, self.kv_group_size)  # names allowed values
        if self.turboquant is not None:
            if len(self.turboquant) != 2:
                raise ValueError(
                    f"[CachePolicy] turboquant must be (kbits, vbits); received "
                    f"{self.turboquant!r}."
                )
            make_signature("kv:turboquant", *self.turboquant)
        if self.keep < 0:
            raise ValueError(f"[CachePolicy] keep must be >= 0; received {self.keep}.")


def _turboquant_module() -> Any:
    try:
        return importlib.import_module("kvstore.caches.turboquant")
    except ImportError as exc:
        raise CapabilityError(
            "[make_cache] The TurboQuant cache family (kvstore.caches.turboquant) is not "
            "available in this installation; use kv_bits for affine quantization or a "
            "kvstore release that ships TurboQuant.",
            family="kv:turboquant",
        ) from exc


def _check_group(policy: CachePolicy, layout: Sequence[LayerGeometry]) -> None:
    for i, layer in enumerate(layout):
        if "recurrent" in layer:
            continue
        head_dim = layer["head_dim"]
        if head_dim % policy.kv_group_size:
            fits = fitting_groups(head_dim)
            raise CapabilityError(
                f"[make_cache] kv_group_size {policy.kv_group_size} does not divide head_dim "
                f"{head_dim} of layer {i}; use kv_group_size "
                f"{' or '.join(map(str, fits)) or '(none fits: use turboquant or no kv_bits)'}.",
                head_dim=head_dim,
                group_size=policy.kv_group_size,
                fitting_groups=fits,
            )


def make_caches(layout: Sequence[LayerGeometry], policy: CachePolicy | None = None) -> list[Any]:
    """One fresh cache per layer of ``layout``, of the family ``policy`` asks for.

    Sliding layers get the windowed variant of the family, sized to the window;
    Gated-DeltaNet layers a ``rec:gated-delta`` state (the policy is about KV rows).

    Raises:
        CapabilityError: the affine group does not divide a layer's head dim,
            or TurboQuant is asked for and not installed.
    """
    policy = policy or CachePolicy()
    keep = policy.keep
    grow: Callable[[], Any]
    ring: Callable[[int], Any]
    if policy.kv_bits is not None:
        _check_group(policy, layout)
        bits, group = policy.kv_bits, policy.kv_group_size
        grow = partial(QuantizedKVCache, group_size=group, bits=bits)
        ring = partial(RotatingQuantizedKVCache, keep=keep, group_size=group, bits=bits)
    elif policy.turboquant is not None:
        tq = _turboquant_module()
        kbits, vbits = policy.turboquant
        grow = partial(tq.TurboQuantKVCache, kbits, vbits)
        ring = partial(tq.RotatingTurboQuantKVCache, keep=keep, kbits=kbits, vbits=vbits)
    else:
        grow, ring = KVCache, partial(RotatingKVCache, keep=keep)
    return [
        GatedDeltaCache()
        if "recurrent" in layer
        else grow()
        if layer["sliding_window"] is None
        else ring(layer["sliding_window"])
        for layer in layout
    ]
