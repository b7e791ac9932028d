"""Cache signatures: the one grammar, parsed in exactly one place.

A signature names a cache family and its parameters, ``kind[:param]*``::

    kv:plain                          raw float16/bfloat16/float32 rows
    kv:quant:{bits}:{group}           MLX affine rows
    kv:rotating-quant:{bits}:{group}  the same in a sliding window
    kv:mxfp4                          MLX microscaling rows (group and bits fixed)

The grammar is generic: the kind is the first two colon-separated parts, the
parameters are the rest, each a canonical decimal integer. What a kind's
parameters are and which values they take is the kind's registered
:class:`~kvstore.family.Family` (:mod:`kvstore.family`); a kind no family is
registered for fails closed with ``UnknownSignatureError`` listing the
registered kinds. Window size and ``keep`` are state, not signature. The kind
(``kv:quant``) is what registries key on, and
``format_signature(parse_signature(s)) == s`` for every valid ``s``.

A wrapper family (``Family.wraps``, issue 15) is one word followed by an inner
signature: ``batch:kv:quant:8:64`` is a row-batched cache of affine rows
(:data:`kvstore.caches.batch.BATCH_FAMILY`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from kvstore.errors import UnknownSignatureError
from kvstore.family import Family, ParamSpec, find_family, get_family, kinds

__all__ = [
    "Signature",
    "ParamSpec",
    "UNKNOWN",
    "parse_signature",
    "format_signature",
    "make_signature",
    "registered_kinds",
]

#: What a cache with no (or an unparsable) signature reports.
UNKNOWN = "unknown"


def registered_kinds() -> list[str]:
    """Every kind the grammar knows: the registered families', sorted."""
    return kinds()


@dataclass(frozen=True)
class Signature:
    """A parsed signature: ``kind``, positional ``params``, and ``inner`` for wrappers."""

    kind: str
    params: tuple[int, ...] = ()
    inner: Signature | None = None

    def __str__(self) -> str:
        return self._text

    @functools.cached_property
    def _text(self) -> str:
        # Parses are cached, so one Signature serves every cache of a kind; its string is
        # asked for per layer on every save (the stored-family label), so it is kept too.
        return format_signature(self)

    @property
    def family(self) -> Family:
        """The registered family of this signature's kind."""
        return get_family(self.kind)

    def param(self, name: str) -> int:
        """The value of the parameter called ``name`` (``bits``, ``group_size``, ...)."""
        for spec, value in zip(self.family.params, self.params):
            if spec.name == name:
                return value
        raise AttributeError(f"[signature] '{self}' has no parameter '{name}'")

    @property
    def bits(self) -> int:
        return self.param("bits")

    @property
    def group_size(self) -> int:
        return self.param("group_size")

    @property
    def kbits(self) -> int:
        return self.param("kbits")

    @property
    def vbits(self) -> int:
        return self.param("vbits")


def format_signature(sig: Signature) -> str:
    """The canonical string of ``sig``; the inverse of :func:`parse_signature`."""
    if sig.inner is not None:
        return f"{sig.kind}:{format_signature(sig.inner)}"
    return ":".join([sig.kind, *(str(p) for p in sig.params)])


def make_signature(kind: str, *params: int) -> Signature:
    """Build and validate a signature from a kind and its parameters."""
    return parse_signature(":".join([kind, *(str(p) for p in params)]))


def parse_signature(text: object) -> Signature:
    """Parse ``text`` into a :class:`Signature`.

    Raises:
        UnknownSignatureError: no family is registered for the kind; the
            message lists the registered kinds.
        ValueError: the kind is known but its parameters are missing, extra,
            not canonical integers, or outside the allowed values.
        TypeError: ``text`` is not a ``str``.
    """
    if not isinstance(text, str):
        raise TypeError(
            f"[signature] A signature must be a str; received {type(text).__name__} {text!r}."
        )
    return _parse_cached(text)


@functools.lru_cache(maxsize=256)
def _parse_cached(text: str) -> Signature:
    head, sep, rest = text.partition(":")
    wrapper = find_family(head) if sep and ":" not in head and head else None
    if wrapper is not None and wrapper.wraps:
        if not rest:
            raise ValueError(
                f"[signature] Wrapper kind '{head}' needs an inner signature "
                f"('{head}:kv:plain'); received '{text}'."
            )
        return Signature(head, (), _parse_cached(rest))
    parts = text.split(":")
    kind = ":".join(parts[:2])
    family = find_family(kind)
    if family is None or family.wraps:
        raise UnknownSignatureError(
            f"[signature] Unknown signature kind '{kind}' in '{text}'. "
            f"Registered: {', '.join(registered_kinds())}.",
            found=kind,
            supported=registered_kinds(),
        )
    raw = parts[2:]
    family.check_count(len(raw), text)
    values = tuple(
        _parse_param(family, spec, value, text) for spec, value in zip(family.params, raw)
    )
    return Signature(kind, family.check(values, text))


def _parse_param(family: Family, spec: ParamSpec, value: str, text: str) -> int:
    # Canonical decimal only ("04", "+4", " 4" would break the round trip).
    if not (value.isdecimal() and value.isascii() and str(int(value)) == value):
        raise ValueError(
            f"[signature] {family.kind} {spec.name} must be one of "
            f"{', '.join(map(str, spec.allowed))}; received '{value}' in '{text}'."
        )
    return int(value)
