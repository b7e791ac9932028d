"""Cache families: what a signature kind *is*, declared once, and the registry of them.

A :class:`Family` describes one kind (``kv:quant``): its positional
parameters and their allowed values, the growing family a windowed one keeps
a window of, how attention reads its rows (dense, or packed rows through
``mx.quantized_matmul`` with a mode and where its bits and group come from),
whether its encoding loses information, whether a store may name it as its
``storage_policy``, what kind of state it holds, a human description, and a
factory for an empty cache of it.

The code that implements a family declares it (``QUANT_FAMILY`` in
:mod:`kvstore.caches.quantized`); its codec names it
(``QuantizedKVCodec.family``) and ``register_codec`` registers both. Everything
else reads this registry: the signature grammar (:mod:`kvstore.signature`),
the predicates the model routes on (:mod:`kvstore.abc.cache`), storage
policies, ``migrate --to``, the model's cache policy, and every message that
lists kinds. A kind declares only what windows it (``window_of`` on the
windowed family); the other direction is derived (:func:`windowed_family`).

Lookups bootstrap lazily. The first miss imports :mod:`kvstore.codecs` *by
name* -- ``importlib.import_module("kvstore.codecs")``, the one string import
in kvstore, sanctioned so that this bottom layer reaches the registration
lines above it without importing them (``tests/test_layout/test_layers.py``
reads only import statements). Those lines register the built-in families. A
kind still missing is then looked up in the entry-point group
``kvstore.codecs`` (a plug-in's codec, whose family registers with it). A kind
found nowhere fails closed: :func:`get_family` raises
``UnknownSignatureError`` listing the registered kinds.

Compatibility rule: a kind's description is fixed once registered; a second
registration must be equal (a codec subclass serving the same family). A
changed meaning takes a new kind.
"""

from __future__ import annotations

import importlib
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Literal, Protocol

from kvstore.errors import CapabilityError, UnknownSignatureError

__all__ = [
    "KV_STATE",
    "BATCH_STATE",
    "RECURRENT_STATE",
    "STATES",
    "ParamSpec",
    "QuantizedAttention",
    "Quantization",
    "Parameters",
    "CacheFactory",
    "Family",
    "register_family",
    "find_family",
    "get_family",
    "families",
    "kinds",
    "windowed_family",
    "growing_family",
]

#: The state of attention layers: keys and values, one row per token. Predicates
#: about KV caches fail closed on any other state (recurrent state: issue 16).
KV_STATE = "kv"
#: The state of recurrent layers (Gated-DeltaNet, Mamba): a fixed-size state at one
#: token position -- a *checkpoint* -- and no row per token, so nothing to cut to
#: an earlier position; every KV predicate fails closed on it (issue 16).
RECURRENT_STATE = "recurrent"
#: The state of a wrapper over several sequences' rows (issue 15's batches): no
#: single sequence's keys and values, so every predicate fails closed on it.
BATCH_STATE = "batch"
#: Every state a family may declare.
STATES = (KV_STATE, RECURRENT_STATE, BATCH_STATE)

#: The modes of ``mx.quantize`` a family's packed rows may be in.
QuantMode = Literal["affine", "mxfp8", "mxfp4", "nvfp4"]
_QUANT_MODES = ("affine", "mxfp8", "mxfp4", "nvfp4")

# A family kind is "prefix:name"; a wrapper's (issue 15) is one word before its inner signature.
_KIND = re.compile(r"[a-z][a-z0-9]*:[a-z0-9][a-z0-9._-]*")
_WRAPPER_KIND = re.compile(r"[a-z][a-z0-9-]*")


@dataclass(frozen=True)
class ParamSpec:
    """One positional parameter of a family and its allowed values."""

    name: str
    allowed: tuple[int, ...]


@dataclass(frozen=True)
class Quantization:
    """How one signature's packed rows are quantized: ``mx.quantize(x, group_size,
    bits, mode)`` made them, ``mx.quantized_matmul`` with the same reads them."""

    mode: str
    bits: int
    group_size: int


@dataclass(frozen=True)
class QuantizedAttention:
    """Attention over packed rows with ``mx.quantized_matmul(..., mode=mode)``.

    ``bits`` and ``group_size`` are each a fixed value (microscaling formats fix
    them) or the name of the signature parameter that holds it (affine).
    """

    mode: QuantMode
    bits: int | str
    group_size: int | str

    def resolve(self, signature: Parameters) -> Quantization:
        """The quantization of ``signature``'s rows."""

        def value(v: int | str) -> int:
            return v if isinstance(v, int) else signature.param(v)

        return Quantization(self.mode, value(self.bits), value(self.group_size))


class Parameters(Protocol):
    """A parsed signature, as a family's factory gets it (:class:`kvstore.signature.Signature`)."""

    @property
    def kind(self) -> str: ...

    @property
    def params(self) -> tuple[int, ...]: ...

    def param(self, name: str) -> int: ...


#: ``factory(signature, window, keep) -> cache``: an empty cache of the signature;
#: ``window`` is the sliding window of a windowed family (0 for a growing one).
CacheFactory = Callable[[Parameters, int, int], Any]


@dataclass(frozen=True)
class Family:
    """What one signature kind is. Declared once, by the code implementing it.

    Attributes:
        kind: ``prefix:name`` (``kv:quant``); what signatures, registries and keys name.
        description: one line for people (``kvstore families``, error messages).
        params: the positional parameters, in signature order, and their allowed values.
        attention: ``"dense"`` (``update_and_fetch`` returns float rows for
            ``scaled_dot_product_attention``) or a :class:`QuantizedAttention`.
        window_of: for a sliding-window family, the kind of the growing family
            whose rows it keeps a window of (same parameters); ``None`` when growing.
        lossy: encoding dense rows into this family loses information.
        storage_policy: a store may name a signature of this family as its
            ``storage_policy`` (lossy, growing; sliding-window layers are stored
            in its windowed family).
        state: what the cache holds: :data:`KV_STATE` (keys and values) or
            :data:`RECURRENT_STATE` (a checkpoint of a recurrent layer's state) or
            :data:`BATCH_STATE` (a wrapper over several sequences' rows).
        wraps: a wrapper family (issue 15): its signature is its one-word kind
            followed by an inner signature (``kind:inner``); no parameters.
        factory: builds an empty cache of a signature (see :meth:`make`);
            ``None`` for a family the model's cache policy cannot build.
    """

    kind: str
    description: str
    params: tuple[ParamSpec, ...] = ()
    attention: Literal["dense"] | QuantizedAttention = "dense"
    window_of: str | None = None
    lossy: bool = False
    storage_policy: bool = False
    state: str = KV_STATE
    wraps: bool = False
    factory: CacheFactory | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        pattern = _WRAPPER_KIND if self.wraps else _KIND
        problems = []
        if not (isinstance(self.kind, str) and pattern.fullmatch(self.kind)):
            problems.append(
                f"kind {self.kind!r} is not "
                + ("one lower-case word" if self.wraps else "'prefix:name' in lower case")
            )
        names = [p.name for p in self.params]
        if len(set(names)) != len(names) or not all(p.allowed for p in self.params):
            problems.append(f"parameters {names} must be distinct, each with allowed values")
        if self.wraps and self.params:
            problems.append("a wrapper takes no parameters (its inner signature has them)")
        if self.window_of == self.kind:
            problems.append("a family cannot window itself")
        if self.state not in STATES:
            problems.append(f"state {self.state!r} is not one of {STATES}")
        elif self.state != KV_STATE and (
            self.window_of is not None or self.storage_policy or self.attention != "dense"
        ):
            problems.append(f"a {self.state} family has no window, storage policy or attention")
        if self.storage_policy and (not self.lossy or self.window_of is not None):
            problems.append("a storage policy is a lossy growing family")
        if isinstance(self.attention, QuantizedAttention):
            att = self.attention
            if att.mode not in _QUANT_MODES:
                problems.append(
                    f"quantized attention mode {att.mode!r} is not one of {_QUANT_MODES}"
                )
            for ref in (att.bits, att.group_size):
                if isinstance(ref, str) and ref not in names:
                    problems.append(
                        f"quantized attention reads parameter {ref!r}, not one of {names}"
                    )
        elif self.attention != "dense":
            problems.append(
                f"attention {self.attention!r} is neither 'dense' nor QuantizedAttention"
            )
        if problems:
            raise ValueError(f"[family] {self.kind!r}: {'; '.join(problems)}.")

    # -- what it is --------------------------------------------------------------------
    @property
    def windowed(self) -> bool:
        """A sliding-window family (it keeps a window of ``window_of``'s rows)."""
        return self.window_of is not None

    @property
    def holds_kv(self) -> bool:
        """The cache holds attention keys and values (the predicates' domain)."""
        return self.state == KV_STATE

    @property
    def holds_recurrent_state(self) -> bool:
        """The cache holds a recurrent layer's state: checkpoints, not rows (issue 16)."""
        return self.state == RECURRENT_STATE

    @property
    def growing_kind(self) -> str:
        """The kind of the growing family this one is (itself) or keeps a window of."""
        return self.window_of or self.kind

    @property
    def form(self) -> str:
        """The signature's shape for people: ``kv:quant:{bits}:{group_size}``."""
        return ":".join([self.kind, *(f"{{{p.name}}}" for p in self.params)])

    def quantization(self, signature: Parameters) -> Quantization | None:
        """How ``signature``'s rows are quantized for attention; ``None`` for dense attention."""
        if isinstance(self.attention, QuantizedAttention):
            return self.attention.resolve(signature)
        return None

    # -- signatures ------------------------------------------------------------------------
    def signature(self, *values: int) -> str:
        """The canonical signature of this family with parameter ``values``.

        Raises:
            ValueError: the wrong number of values, or one outside its allowed values.
        """
        self.check(values)
        return ":".join([self.kind, *(str(v) for v in values)])

    def check(self, values: Sequence[int], text: str | None = None) -> tuple[int, ...]:
        """``values`` as this family's parameters, checked (``text``: the signature, for messages).

        Raises:
            ValueError: the wrong number of values, or one outside its allowed values.
        """
        self.check_count(len(values), text)
        where = f" in '{text}'" if text is not None else ""
        for spec, value in zip(self.params, values):
            if value not in spec.allowed or isinstance(value, bool):
                raise ValueError(
                    f"[signature] {self.kind} {spec.name} must be one of "
                    f"{', '.join(map(str, spec.allowed))}; received {value!r}{where}."
                )
        return tuple(values)

    def check_count(self, count: int, text: str | None = None) -> None:
        """Raise ``ValueError`` unless ``count`` values are this family's parameter count."""
        if count != len(self.params):
            where = f" in '{text}'" if text is not None else ""
            raise ValueError(
                f"[signature] '{self.kind}' takes {len(self.params)} parameter(s), as "
                f"'{self.form}'; received {count}{where}."
            )

    # -- caches --------------------------------------------------------------------------
    def make(self, signature: Parameters, *, window: int | None = None, keep: int = 0) -> Any:
        """An empty cache of ``signature`` (a parsed signature of this family).

        Args:
            signature: e.g. ``parse_signature("kv:quant:4:64")``.
            window: the window of a windowed family (required there, refused elsewhere).
            keep: sink tokens a windowed cache keeps besides its window.

        Raises:
            CapabilityError: the family declares no factory.
            ValueError: ``signature`` is of another kind, or ``window`` does not
                fit the family's windowing.
        """
        if signature.kind != self.kind:
            raise ValueError(
                f"[{self.kind}] builds caches of its own kind; received a '{signature.kind}' "
                f"signature."
            )
        if self.factory is None:
            raise CapabilityError(
                f"[make_cache] The family {self.kind} ({self.description}) declares no cache "
                f"factory; build its caches directly.",
                family=self.kind,
            )
        if self.windowed != (window is not None):
            need = "a window (the layer's sliding window)" if self.windowed else "no window"
            raise ValueError(f"[{self.kind}] takes {need}; received window={window!r}.")
        return self.factory(signature, window or 0, keep)


_FAMILIES: dict[str, Family] = {}
_LOCK = threading.RLock()


def register_family(family: Family) -> Family:
    """Register ``family`` under its kind; returns it.

    Raises:
        TypeError: ``family`` is not a :class:`Family`.
        ValueError: its kind is registered with a different description
            (a changed meaning takes a new kind).
    """
    if not isinstance(family, Family):
        raise TypeError(f"[family.register] A family is a Family; received {family!r}.")
    with _LOCK:
        current = _FAMILIES.get(family.kind)
        if current is not None and current != family:
            raise ValueError(
                f"[family.register] Kind '{family.kind}' is registered as {current!r}; "
                f"{family!r} differs. A changed meaning takes a new kind."
            )
        _FAMILIES[family.kind] = family
    return family


def _builtins() -> ModuleType:
    """:mod:`kvstore.codecs`, whose import registers the built-in families (a no-op
    once imported; while it is being imported, the partly run module)."""
    # The one import by name that goes up a layer (the module docstring says why).
    return importlib.import_module("kvstore.codecs")


def find_family(kind: str) -> Family | None:
    """The family of ``kind``, bootstrapping the built-ins and loading a plug-in's
    entry point if need be; ``None`` when none is registered or declared."""
    found = _FAMILIES.get(kind)
    if found is not None:
        return found
    codecs = _builtins()
    found = _FAMILIES.get(kind)
    if found is None and isinstance(kind, str) and _KIND.fullmatch(kind):
        load = getattr(codecs, "load_plugin", None)  # absent while kvstore.codecs is mid-import
        if load is not None:
            load(kind)
            found = _FAMILIES.get(kind)
    return found


def get_family(kind: str) -> Family:
    """The family of ``kind``.

    Raises:
        UnknownSignatureError: no family is registered or declared for it; the
            message lists the registered kinds.
    """
    found = find_family(kind)
    if found is None:
        raise UnknownSignatureError(
            f"[family] Unknown signature kind '{kind}'. Registered: {', '.join(kinds())}.",
            found=kind,
            supported=kinds(),
        )
    return found


def families() -> list[Family]:
    """Every registered family (built-ins and plug-ins loaded so far), by kind."""
    _builtins()
    with _LOCK:
        return [_FAMILIES[k] for k in sorted(_FAMILIES)]


def kinds() -> list[str]:
    """The registered kinds, sorted (what messages listing kinds print)."""
    return [f.kind for f in families()]


def windowed_family(kind: str) -> Family | None:
    """The sliding-window family keeping a window of ``kind``'s rows (``kv:rotating-quant``
    for ``kv:quant``); ``kind`` itself when it is windowed; ``None`` when none is declared.

    Plug-ins not loaded yet are loaded (every entry point of the group) before
    answering ``None``: a plug-in's windowed family has an entry point of its own.
    """
    family = get_family(kind)
    if family.windowed:
        return family

    def search() -> Family | None:
        return next((f for f in families() if f.window_of == kind), None)

    found = search()
    if found is None:
        load_all = getattr(_builtins(), "load_plugins", None)
        if load_all is not None:
            load_all()
            found = search()
    return found


def growing_family(kind: str) -> Family:
    """The growing family ``kind`` is, or keeps a window of (``kv:quant`` for
    ``kv:rotating-quant``).

    Raises:
        UnknownSignatureError: ``kind`` (or what it windows) is not registered.
    """
    family = get_family(kind)
    return family if family.window_of is None else get_family(family.window_of)
