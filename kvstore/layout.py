"""Per-layer layouts: a value for each layer, by index, by kind of layer, or by default.

A :class:`LayerLayout` says which family each layer of a model gets. The model's
cache policy reads one to make each layer's cache
(:class:`kvstore.model.CachePolicy`, values: growing families, ``kv:plain`` for
raw rows); a store's storage policy reads one to pick each layer's stored
encoding (:mod:`kvstore.store.kv.policy`, values: ``lossless`` or a
storage-policy family). Selectors, most specific first:

* a layer index (``3``) or a range of them (``0-3``);
* a kind of layer: ``global`` (full attention), ``sliding`` (a sliding window),
  ``recurrent`` (a recurrent state, issue 16);
* ``default``.

A layer no selector matches gets the consumer's own default. Text form, the
canonical one a store's settings keep (entries in the order above, equal
consecutive indices merged into ranges)::

    default=kv:quant:4:64;sliding=kv:quant:8:64;0=kv:plain;30-31=kv:quant:8:64

Dict form, the one a layout file holds (``kvstore tune`` writes them; see
:func:`read_layout_file`)::

    {"default": "kv:quant:4:64", "sliding": "kv:quant:8:64",
     "layers": {"0": "kv:plain", "30-31": "kv:quant:8:64"}}

The kind of a layer comes from the model's geometry (:func:`kind_of_layer`) or,
for a stored layer, from its family (:func:`kind_of_signature`): one answer for
one layer either way.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.signature import parse_signature

__all__ = [
    "LAYER_KINDS",
    "LAYOUT_FILE_FORMAT",
    "LayerLayout",
    "kind_of_layer",
    "kind_of_signature",
    "is_layout_text",
    "parse_layout",
    "read_layout_file",
    "write_layout_file",
]

#: The kinds of layer a layout may select by.
LAYER_KINDS = ("global", "sliding", "recurrent")
#: The ``format`` of a layout file.
LAYOUT_FILE_FORMAT = "kvstore-layout/1"

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def kind_of_layer(layer: Mapping[str, Any]) -> str:
    """The kind of a layer from its geometry (``model.layer_layout()``'s entries)."""
    if layer.get("recurrent"):
        return "recurrent"
    return "global" if layer.get("sliding_window") is None else "sliding"


def kind_of_signature(signature: str) -> str:
    """The kind of layer a cache of ``signature`` serves: its family says (a
    recurrent state, a sliding window, or full attention).

    Raises:
        UnknownSignatureError, ValueError: ``signature`` does not parse.
    """
    family = parse_signature(signature).family
    if not family.holds_kv:
        return "recurrent"
    return "sliding" if family.windowed else "global"


def is_layout_text(text: object) -> bool:
    """Whether ``text`` is a layout's text form (a signature never holds ``=``)."""
    return isinstance(text, str) and "=" in text


@dataclass(frozen=True)
class LayerLayout:
    """Values by layer index, by kind of layer, and a default; see the module docstring.

    Build one with :func:`parse_layout` (text, dict, or another layout), or
    directly: ``LayerLayout(default="kv:quant:4:64", layers=((0, "kv:plain"),))``.

    Attributes:
        default: the value of a layer no other selector matches, or ``None``.
        kinds: ``(kind, value)`` pairs, kinds from :data:`LAYER_KINDS`.
        layers: ``(index, value)`` pairs.
    """

    default: str | None = None
    kinds: tuple[tuple[str, str], ...] = ()
    layers: tuple[tuple[int, str], ...] = ()

    def __post_init__(self) -> None:
        kinds = dict(self.kinds)
        unknown = sorted(set(kinds) - set(LAYER_KINDS))
        if unknown or len(kinds) != len(self.kinds):
            raise ValueError(
                f"[layout] kinds of layer are {', '.join(LAYER_KINDS)}, each once; received "
                f"{[k for k, _ in self.kinds]}."
            )
        layers = dict(self.layers)
        if len(layers) != len(self.layers) or any(
            isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers
        ):
            raise ValueError(
                f"[layout] layer indices are distinct integers >= 0; received "
                f"{[i for i, _ in self.layers]}."
            )
        # Canonical order, so equal layouts compare (and hash, and print) equal.
        object.__setattr__(self, "kinds", tuple((k, kinds[k]) for k in LAYER_KINDS if k in kinds))
        object.__setattr__(self, "layers", tuple(sorted(layers.items())))

    def value_for(self, index: int, kind: str) -> str | None:
        """The value of layer ``index`` of kind ``kind``, or ``None`` when nothing matches.

        ``default`` does not reach ``recurrent`` layers: a family of keys and values
        is no recurrent state's (name them by index or by ``recurrent``).
        """
        for i, value in self.layers:
            if i == index:
                return value
        for k, value in self.kinds:
            if k == kind:
                return value
        return None if kind == "recurrent" else self.default

    def values(self) -> list[str]:
        """Every value the layout names, once each, in the order of the text form."""
        seen: dict[str, None] = {}
        for value in [
            *([self.default] if self.default else []),
            *(v for _, v in self.kinds),
            *(v for _, v in self.layers),
        ]:
            seen.setdefault(value)
        return list(seen)

    def max_index(self) -> int | None:
        """The largest layer index named, or ``None``."""
        return self.layers[-1][0] if self.layers else None

    def uniform(self) -> str | None:
        """The one value of a layout with only a default (``None`` otherwise)."""
        return self.default if not self.kinds and not self.layers else None

    def map_values(self, fn: Callable[[str], str]) -> LayerLayout:
        """The same selectors, each value passed through ``fn``."""
        return LayerLayout(
            None if self.default is None else fn(self.default),
            tuple((k, fn(v)) for k, v in self.kinds),
            tuple((i, fn(v)) for i, v in self.layers),
        )

    def text(self) -> str:
        """The canonical text form."""
        parts = [] if self.default is None else [f"default={self.default}"]
        parts += [f"{k}={v}" for k, v in self.kinds]
        parts += [f"{sel}={v}" for sel, v in _runs(self.layers)]
        return ";".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """The dict form (JSON-ready)."""
        out: dict[str, Any] = {} if self.default is None else {"default": self.default}
        out.update(self.kinds)
        if self.layers:
            out["layers"] = dict(_runs(self.layers))
        return out

    def __str__(self) -> str:
        return self.text()


def _runs(layers: Iterable[tuple[int, str]]) -> list[tuple[str, str]]:
    """``[(0, a), (1, a), (3, b)]`` -> ``[("0-1", a), ("3", b)]``."""
    runs: list[list[Any]] = []
    for i, value in layers:
        if runs and runs[-1][1] == i - 1 and runs[-1][2] == value:
            runs[-1][1] = i
        else:
            runs.append([i, i, value])
    return [(f"{a}" if a == b else f"{a}-{b}", v) for a, b, v in runs]


def _error(operation: str, rule: str, found: object) -> ValueError:
    return ValueError(f"[{operation}] {rule}; received {found!r}.")


def _indices(selector: str, operation: str) -> range:
    m = _RANGE.fullmatch(selector.strip())
    if m is None or int(m[2] or m[1]) < int(m[1]):
        raise _error(
            operation,
            f"a layout selects layers by index or range (0-3), by kind "
            f"({', '.join(LAYER_KINDS)}) or as default",
            selector,
        )
    return range(int(m[1]), int(m[2] or m[1]) + 1)


def parse_layout(
    value: LayerLayout | Mapping[str, Any] | str,
    parse_value: Callable[[str], str] | None = None,
    operation: str = "layout",
) -> LayerLayout:
    """A layout from its text form, its dict form, or a layout (values re-parsed).

    Args:
        value: the layout.
        parse_value: checks and canonicalises each value (a consumer's rule:
            a family signature, ``lossless``...); values are kept as given when
            ``None``.
        operation: the ``[operation]`` of error messages.

    Raises:
        ValueError: a malformed layout, a selector given twice, or a value
            ``parse_value`` refuses (its own error, ``UnknownSignatureError``
            for an unregistered family).
    """
    check = parse_value or (lambda v: v)
    if isinstance(value, LayerLayout):
        return value.map_values(check)
    if isinstance(value, str):
        entries: list[tuple[str, Any]] = []
        for part in value.split(";"):
            if not part.strip():
                continue
            selector, sep, text = part.partition("=")
            if not sep:
                raise _error(
                    operation, "a layout's entries are SELECTOR=VALUE, ';'-separated", part
                )
            entries.append((selector.strip().lower(), text.strip()))
    elif isinstance(value, Mapping):
        entries = [(str(k).strip().lower(), v) for k, v in value.items() if k != "layers"]
        layers = value.get("layers", {})
        if not isinstance(layers, Mapping):
            raise _error(operation, "a layout's 'layers' maps indices or ranges to values", layers)
        entries += [(str(k).strip(), v) for k, v in layers.items()]
    else:
        raise TypeError(
            f"[{operation}] A layout is text, a dict or a LayerLayout; received "
            f"{type(value).__name__}."
        )
    default: str | None = None
    kinds: dict[str, str] = {}
    layers_by_index: dict[int, str] = {}
    for selector, raw in entries:
        if not isinstance(raw, str) or not raw:
            raise _error(operation, f"the value of {selector!r} must be a non-empty string", raw)
        text = check(raw)
        if selector == "default":
            if default is not None:
                raise _error(operation, "a layout has one default", value)
            default = text
        elif selector in LAYER_KINDS:
            if selector in kinds:
                raise _error(operation, f"a layout names {selector!r} once", value)
            kinds[selector] = text
        else:
            for i in _indices(selector, operation):
                if i in layers_by_index:
                    raise _error(operation, f"a layout names layer {i} once", value)
                layers_by_index[i] = text
    return LayerLayout(default, tuple(kinds.items()), tuple(layers_by_index.items()))


def read_layout_file(
    path: str | Path, operation: str = "layout"
) -> tuple[LayerLayout, dict[str, Any]]:
    """``(layout, the whole file)`` of a layout file: JSON holding
    ``{"format": "kvstore-layout/1", "layout": {dict form}, ...}`` (what ``kvstore
    tune`` writes, with its measurements), or the dict form alone.

    Raises:
        ValueError: not a layout file (the message names the path).
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"[{operation}] {path} is not a readable JSON layout file: {exc}") from exc
    if not isinstance(data, dict):
        raise _error(operation, f"{path} must hold a JSON object", type(data).__name__)
    fmt = data.get("format")
    if fmt is not None and fmt != LAYOUT_FILE_FORMAT:
        raise _error(operation, f"{path} is a layout file of format {LAYOUT_FILE_FORMAT}", fmt)
    return parse_layout(data.get("layout", data) if fmt else data, operation=operation), data


def write_layout_file(path: str | Path, layout: LayerLayout, **extra: Any) -> Path:
    """Write ``layout`` (and ``extra`` JSON-ready fields) as a layout file; returns the path."""
    path = Path(path)
    body = {"format": LAYOUT_FILE_FORMAT, "layout": layout.to_dict(), **extra}
    path.write_text(json.dumps(body, indent=1) + "\n")
    return path
