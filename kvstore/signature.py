"""Cache signatures: the one grammar, parsed in exactly one place.

A signature names a cache family and its parameters, ``kind[:param]*``::

    kv:plain                          raw float16/bfloat16/float32 rows
    kv:quant:{bits}:{group}           MLX affine, bits 2,3,4,5,6,8; group 32,64,128
    kv:rotating-plain                 sliding window, raw rows
    kv:rotating-quant:{bits}:{group}  sliding window, affine rows
    kv:turboquant:{kbits}:{vbits}     rotation + Lloyd-Max codes, bits 2,3,4
    kv:rotating-turboquant:{kbits}:{vbits}
    rec:gated-delta                   a Gated-DeltaNet layer's conv window and state
    batch:<inner signature>           a wrapper reports its kind plus the inner one

Window size and ``keep`` are state, not signature. The kind (``kv:quant``) is
what registries key on; parameters are positional, canonical decimal integers,
so ``format_signature(parse_signature(s)) == s`` for every valid ``s``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from kvstore.errors import UnknownSignatureError

__all__ = [
    "Signature",
    "ParamSpec",
    "KINDS",
    "WRAPPER_KINDS",
    "UNKNOWN",
    "parse_signature",
    "format_signature",
    "make_signature",
    "registered_kinds",
]

#: What a cache with no (or an unparsable) signature reports.
UNKNOWN = "unknown"


@dataclass(frozen=True)
class ParamSpec:
    """One positional parameter of a signature kind and its allowed values."""

    name: str
    allowed: tuple[int, ...]


_AFFINE_BITS = ParamSpec("bits", (2, 3, 4, 5, 6, 8))
_AFFINE_GROUP = ParamSpec("group_size", (32, 64, 128))
_TQ_KBITS = ParamSpec("kbits", (2, 3, 4))
_TQ_VBITS = ParamSpec("vbits", (2, 3, 4))

#: Every family kind and its positional parameters, in order.
KINDS: dict[str, tuple[ParamSpec, ...]] = {
    "kv:plain": (),
    "kv:quant": (_AFFINE_BITS, _AFFINE_GROUP),
    "kv:rotating-plain": (),
    "kv:rotating-quant": (_AFFINE_BITS, _AFFINE_GROUP),
    "kv:turboquant": (_TQ_KBITS, _TQ_VBITS),
    "kv:rotating-turboquant": (_TQ_KBITS, _TQ_VBITS),
    # Recurrent state (issue 16): a checkpoint at one position, no rows per token.
    "rec:gated-delta": (),
}

#: Kinds that wrap another signature (``batch:kv:plain``).
WRAPPER_KINDS: tuple[str, ...] = ("batch",)


def registered_kinds() -> list[str]:
    """All kinds the grammar knows, families first, then wrappers."""
    return [*KINDS, *WRAPPER_KINDS]


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

    def param(self, name: str) -> int:
        """The value of the parameter called ``name`` (``bits``, ``group_size``, ...)."""
        for spec, value in zip(KINDS.get(self.kind, ()), self.params):
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
        UnknownSignatureError: the kind is not one this grammar knows; the
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
    if head in WRAPPER_KINDS:
        if not sep or not rest:
            raise ValueError(
                f"[signature] Wrapper kind '{head}' needs an inner signature "
                f"('{head}:kv:plain'); received '{text}'."
            )
        return Signature(head, (), _parse_cached(rest))
    parts = text.split(":")
    kind = ":".join(parts[:2])
    specs = KINDS.get(kind)
    if specs is None:
        raise UnknownSignatureError(
            f"[signature] Unknown signature kind '{kind}' in '{text}'. "
            f"Registered: {', '.join(registered_kinds())}.",
            found=kind,
            supported=registered_kinds(),
        )
    raw = parts[2:]
    if len(raw) != len(specs):
        form = ":".join([kind, *(f"{{{s.name}}}" for s in specs)])
        raise ValueError(
            f"[signature] '{kind}' takes {len(specs)} parameter(s), as '{form}'; "
            f"received {len(raw)} in '{text}'."
        )
    params = tuple(_parse_param(kind, spec, value, text) for spec, value in zip(specs, raw))
    return Signature(kind, params)


def _parse_param(kind: str, spec: ParamSpec, value: str, text: str) -> int:
    allowed = ", ".join(str(a) for a in spec.allowed)
    # Canonical decimal only ("04", "+4", " 4" would break the round trip).
    if not (value.isdecimal() and value.isascii() and str(int(value)) == value):
        raise ValueError(
            f"[signature] {kind} {spec.name} must be one of {allowed}; "
            f"received '{value}' in '{text}'."
        )
    number = int(value)
    if number not in spec.allowed:
        raise ValueError(
            f"[signature] {kind} {spec.name} must be one of {allowed}; "
            f"received {number} in '{text}'."
        )
    return number
