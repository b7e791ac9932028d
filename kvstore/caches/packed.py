"""Rows packed by ``mx.quantize``: the encoding the affine and microscaling families share.

A packed family stores each row as what ``mx.quantize(x, group_size, bits,
mode)`` returns -- ``(q, scales, biases)`` for affine, ``(q, scales)`` for
the microscaling modes (``mxfp8``, ``mxfp4``, ``nvfp4``; uint8 scales, no
biases) -- and attention reads it with ``mx.quantized_matmul`` in the same
mode. The family's :class:`~kvstore.family.QuantizedAttention` says the mode
and where bits and group come from; :func:`quantize_rows` is the one encoder,
called by the caches on new rows and by the codecs on dense rows (transcode,
migrate), so both write the same bytes.
"""

from __future__ import annotations

from typing import ClassVar

import mlx.core as mx

from kvstore.errors import CapabilityError
from kvstore.family import Family, Quantization, QuantizedAttention, families
from kvstore.signature import Signature, parse_signature

__all__ = ["PackedRows", "quantize_rows", "fitting_groups", "packed_width"]


def packed_width(head_dim: int, bits: int) -> int:
    """uint32 words per packed row: ceil(D*bits/32) (mlx-lm's D//(32//bits) is
    wrong for 3, 5 and 6 bits)."""
    return (head_dim * bits + 31) // 32


def fitting_groups(family: Family, head_dim: int) -> list[int]:
    """The group sizes of ``family`` (a parameter's allowed values, or its fixed one)
    that divide ``head_dim``."""
    att = family.attention
    if not isinstance(att, QuantizedAttention):
        return []
    if isinstance(att.group_size, int):
        groups: tuple[int, ...] = (att.group_size,)
    else:
        groups = next(p.allowed for p in family.params if p.name == att.group_size)
    return [g for g in groups if head_dim % g == 0]


def quantize_rows(x: mx.array, signature: Signature) -> tuple[mx.array, ...]:
    """``x`` (``[B, H, T, D]`` float rows) packed as rows of ``signature``'s family.

    Raises:
        CapabilityError: the family's group does not divide ``D``; the message
            says which group sizes do (``exc.fitting_groups``).
    """
    family = signature.family
    q = family.quantization(signature)
    assert q is not None, f"{family.kind} has no quantized attention"
    head_dim = x.shape[-1]
    if head_dim % q.group_size:
        raise _no_fit(family, signature, q, head_dim)
    return tuple(mx.quantize(x, group_size=q.group_size, bits=q.bits, mode=q.mode))


def _no_fit(family: Family, signature: Signature, q: Quantization, head_dim: int) -> Exception:
    fits = fitting_groups(family, head_dim)
    if fits:
        fix = f"use group size {' or '.join(map(str, fits))}"
    else:
        dense = [f.kind for f in families() if f.attention == "dense" and not f.windowed]
        fix = f"no {q.mode} group fits; use a family without groups ({', '.join(dense)})"
    return CapabilityError(
        f"[{signature}] group_size {q.group_size} does not divide head_dim {head_dim}; {fix}.",
        head_dim=head_dim,
        group_size=q.group_size,
        fitting_groups=fits,
    )


class PackedRows:
    """Row encoding of a packed family, shared by its growing and windowed caches.

    A class sets ``family``; a family with parameters overrides :meth:`signature_params`.
    """

    family: ClassVar[Family]

    def signature_params(self) -> tuple[int, ...]:
        """This cache's signature parameters, in the family's order (none by default)."""
        return ()

    def signature(self) -> str:
        return ":".join([self.family.kind, *map(str, self.signature_params())])

    def quantization(self) -> Quantization:
        """How this cache's rows are quantized (what attention gives ``quantized_matmul``)."""
        q = self.family.quantization(parse_signature(self.signature()))
        assert q is not None
        return q

    def _encode(self, x: mx.array) -> tuple[mx.array, ...]:
        return quantize_rows(x, parse_signature(self.signature()))
