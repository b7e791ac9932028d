"""What a migration converts: the target family of each layer, and which layers.

``--to`` names one family; each selected layer goes to that family or, for a
layer of the other window kind, to its counterpart: ``--to kv:quant:8:64``
sends ``kv:plain`` layers to ``kv:quant:8:64`` and ``kv:rotating-plain``
(sliding-window) layers to ``kv:rotating-quant:8:64`` -- the windowed family
that declares it keeps a window of ``kv:quant`` (:mod:`kvstore.family`).
``--layers`` selects layers by index (``0-3,7``) or by kind (``global``: full
attention, ``sliding``: sliding window); ``all`` is the default.

``--to`` may also name a family per layer (issue 17): a
:class:`~kvstore.layout.LayerLayout` in its text form
(``default=kv:quant:4:64;sliding=kv:quant:8:64;0-1=kv:quant:8:64``), or a layout
file such as ``kvstore tune`` writes (the CLI reads it). Each layer goes to the
family the layout names for its index, else its kind (a stored layer's kind is
its family's), else the default, or its counterpart of the layer's window kind;
a layer the layout names nothing for stays as it is. ``--layers`` still limits
which layers convert.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from kvstore.codecs.header import FORMAT_VERSION, SUPPORTED_VERSIONS
from kvstore.codecs.registry import get_codec
from kvstore.errors import (
    CapabilityError,
    FormatVersionError,
    StoreConfigError,
    UnknownSignatureError,
)
from kvstore.family import families, growing_family, windowed_family
from kvstore.layout import LayerLayout, is_layout_text, kind_of_signature, parse_layout
from kvstore.signature import parse_signature, registered_kinds

__all__ = [
    "parse_target",
    "parse_targets",
    "target_layout",
    "layer_target",
    "is_sliding",
    "target_for",
    "is_lossy",
    "LayerSelection",
    "parse_layer_spec",
    "check_format_version",
]


def _examples() -> str:
    """Signature shapes of the registered growing families, for messages."""
    return ", ".join(f.form for f in families() if not f.windowed and f.holds_kv)


def parse_target(text: str, operation: str = "migrate") -> str:
    """The canonical signature ``text`` names, checked against the codec registry.

    Raises:
        UnknownSignatureError: ``text`` does not parse as a signature, or no codec
            is registered for its kind (the message lists the kinds known).
    """
    try:
        sig = parse_signature(text)
    except (ValueError, TypeError) as exc:  # UnknownSignatureError is a LookupError
        raise UnknownSignatureError(
            f"[{operation}] --to {text!r} is not a signature: {_rule(exc)} Write one of "
            f"{_examples()}.",
            found=text,
            supported=registered_kinds(),
        ) from exc
    except UnknownSignatureError as exc:
        raise _unknown(operation, text, exc) from exc
    if sig.inner is not None:
        raise UnknownSignatureError(
            f"[{operation}] --to {text!r} is a wrapper signature; stored layers are families. "
            f"Give the family itself ({sig.inner}).",
            found=text,
        )
    try:
        get_codec(str(sig))
    except UnknownSignatureError as exc:  # a kind the grammar knows but no codec serves
        raise _unknown(operation, text, exc) from exc
    return str(sig)


def parse_targets(text: str | LayerLayout, operation: str = "migrate") -> str:
    """``--to``: one target signature, or a per-layer layout of them, canonical.

    Raises:
        UnknownSignatureError: a signature does not parse, or no codec serves it.
        StoreConfigError: a malformed layout.
    """
    if not isinstance(text, LayerLayout) and not is_layout_text(text):
        return parse_target(text, operation)
    try:
        layout = parse_layout(text, lambda v: parse_target(v, operation), operation)
    except UnknownSignatureError:
        raise
    except (ValueError, TypeError) as exc:
        raise StoreConfigError(
            f"[{operation}] --to {text!s}: {_rule(exc)}", found=str(text)
        ) from exc
    return layout.uniform() or layout.text()


def target_layout(to: str) -> LayerLayout | None:
    """The layout of a per-layer ``--to`` (``None`` for one signature)."""
    return _layout(to) if is_layout_text(to) else None


@functools.lru_cache(maxsize=16)
def _layout(to: str) -> LayerLayout:
    return parse_layout(to)


def layer_target(source: str, to: str, index: int) -> str:
    """The family layer ``index``, stored as ``source``, becomes under ``--to to``
    (itself where a per-layer ``to`` names nothing for it)."""
    layout = target_layout(to)
    if layout is None:
        return target_for(source, to)
    named = layout.value_for(index, kind_of_signature(source))
    return source if named is None else target_for(source, named)


def _unknown(operation: str, text: str, exc: UnknownSignatureError) -> UnknownSignatureError:
    return UnknownSignatureError(
        f"[{operation}] --to {text!r}: {_rule(exc)}",
        found=text,
        supported=getattr(exc, "supported", registered_kinds()),
    )


def _rule(exc: Exception) -> str:
    """An error message without its ``[operation]`` prefix."""
    return re.sub(r"^\[[^\]]*\]\s*", "", str(exc))


def is_sliding(signature: str) -> bool:
    """A sliding-window (rotating) family."""
    return parse_signature(signature).family.windowed


def target_for(source: str, to: str) -> str:
    """The family a layer stored as ``source`` becomes when migrating ``--to to``:
    ``to`` itself, or its counterpart of the source's window kind.

    A layer of recurrent state (a hybrid model's checkpoint, issue 16) has one
    encoding: it stays as it is.

    Raises:
        CapabilityError: ``source`` is a sliding-window layer and no windowed
            family keeps a window of ``to``'s.
    """
    stored = parse_signature(source)
    if not stored.family.holds_kv:
        return str(stored)
    target = parse_signature(to)
    if is_sliding(source) == target.family.windowed:
        return str(target)
    if not is_sliding(source):
        return growing_family(target.kind).signature(*target.params)
    windowed = windowed_family(target.kind)
    if windowed is None:
        raise CapabilityError(
            f"[migrate] --to {to}: the sliding-window layers stored as {source} need a "
            f"windowed family, and none keeps a window of {target.kind}. Limit the "
            f"migration with --layers global.",
            signature=to,
        )
    return windowed.signature(*target.params)


def is_lossy(source: str, target: str) -> bool:
    """Whether re-encoding ``source`` rows as ``target`` can change them."""
    return source != target and get_codec(target).lossy


@dataclass(frozen=True)
class LayerSelection:
    """Which layers of each record to convert.

    Attributes:
        spec: the canonical text (``all``, ``global``, ``sliding`` or ``0-3,7``).
        indices: the layer indices, for an index spec.
    """

    spec: str = "all"
    indices: frozenset[int] | None = None

    def selects(self, index: int, signature: str) -> bool:
        if self.indices is not None:
            return index in self.indices
        if self.spec == "global":
            return not is_sliding(signature)
        if self.spec == "sliding":
            return is_sliding(signature)
        return True

    @property
    def everything(self) -> bool:
        return self.spec == "all"

    def check(self, layers: int, operation: str = "migrate") -> None:
        """Raise if an index is past the ``layers`` layers records hold."""
        if self.indices and max(self.indices) >= layers:
            raise StoreConfigError(
                f"[{operation}] --layers {self.spec} names layer {max(self.indices)}, but the "
                f"store's records hold {layers} layers (0-{layers - 1}).",
                found=self.spec,
                layers=layers,
            )


_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def parse_layer_spec(text: str | None, operation: str = "migrate") -> LayerSelection:
    """``None``/``all``, ``global``, ``sliding``, or indices and ranges (``0-3,7``).

    Raises:
        StoreConfigError: anything else, or a range that runs backwards.
    """
    if text is None or text.strip().lower() in ("", "all"):
        return LayerSelection()
    word = text.strip().lower()
    if word in ("global", "sliding"):
        return LayerSelection(word)
    indices: set[int] = set()
    for part in word.replace(" ", "").split(","):
        m = _RANGE.fullmatch(part)
        lo, hi = (int(m[1]), int(m[2] or m[1])) if m else (1, 0)
        if hi < lo:
            raise StoreConfigError(
                f"[{operation}] --layers takes 'all', 'global', 'sliding' or layer indices and "
                f"ranges such as 0-3,7; received {text!r}.",
                found=text,
            )
        indices.update(range(lo, hi + 1))
    return LayerSelection(_canonical(indices), frozenset(indices))


def _canonical(indices: set[int]) -> str:
    """``{0, 1, 2, 3, 7}`` -> ``"0-3,7"``."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def check_format_version(version: int | None, operation: str = "migrate") -> int | None:
    """``version`` if records can be written in it (only the current format can).

    Raises:
        FormatVersionError: a version this kvstore does not write; lists the known ones.
    """
    if version is None or version == FORMAT_VERSION:
        return version
    known = ", ".join(map(str, SUPPORTED_VERSIONS))
    raise FormatVersionError(
        f"[{operation}] --format-version {version} is not a record format this kvstore "
        f"writes; known record formats: {known} (it writes {FORMAT_VERSION}). Use "
        f"--format-version {FORMAT_VERSION}, or a newer kvstore for a newer format.",
        found=version,
        supported=SUPPORTED_VERSIONS,
    )
