"""The codec registry: signature kind -> codec class (and, with it, the kind's family).

Built-ins are registered explicitly in :mod:`kvstore.codecs`, one
``register_codec`` line per family. Registering a codec registers the
:class:`~kvstore.family.Family` it names (``cls.family``), so the signature
grammar, the predicates and everything else that reads :mod:`kvstore.family`
know the kind from then on. Third-party codecs are declared as entry points of
the group ``kvstore.codecs``, named after the kind they serve::

    [project.entry-points."kvstore.codecs"]
    "kv:mykind" = "my_package.codec:MyKindCodec"

and loaded lazily, the first time a signature of that kind is asked for
(:func:`load_plugin`, called by :func:`kvstore.family.find_family` on a miss;
never by scanning packages, which hides import errors).
"""

from __future__ import annotations

import importlib.metadata
import inspect
import threading
from typing import Any

from kvstore.abc.cache import signature_of
from kvstore.abc.codec import KVCodec
from kvstore.errors import CapabilityError, UnknownSignatureError
from kvstore.family import Family, register_family
from kvstore.signature import parse_signature

__all__ = [
    "ENTRY_POINT_GROUP",
    "register_codec",
    "get_codec",
    "find_codec_class",
    "load_plugin",
    "load_plugins",
    "registered_kinds",
    "codec_for",
    "kind_of",
    "reported_signature",
]

#: The entry-point group third-party codecs are declared in.
ENTRY_POINT_GROUP = "kvstore.codecs"

_CODECS: dict[str, type[KVCodec]] = {}
_INSTANCES: dict[str, KVCodec] = {}
_LOCK = threading.Lock()


def register_codec(cls: type[KVCodec]) -> type[KVCodec]:
    """Register ``cls`` and its family for its ``kind``; returns ``cls`` (usable as a decorator).

    A kind already served by another class may be taken over only by a class
    that reads the other's output and whose output the other reads, and that
    serves the same family.

    Raises:
        TypeError: ``cls`` is not a concrete ``KVCodec`` subclass naming its ``family``.
        ValueError: the kind is served by an incompatible codec, or registered
            with a different family.
    """
    if (
        not (isinstance(cls, type) and issubclass(cls, KVCodec))
        or inspect.isabstract(cls)
        or not isinstance(getattr(cls, "family", None), Family)
        or getattr(cls, "kind", None) != cls.family.kind
    ):
        raise TypeError(
            f"[codecs.register] A codec is a concrete KVCodec subclass naming the Family it "
            f"serves (`family = MY_FAMILY`, a kvstore.family.Family); received {cls!r}."
        )
    with _LOCK:
        current = _CODECS.get(cls.kind)
        if current is not None and current is not cls:
            if not (cls.version in current.reads and current.version in cls.reads):
                raise ValueError(
                    f"[codecs.register] Kind '{cls.kind}' is served by {current.__name__} "
                    f"(version {current.version}, reads {sorted(current.reads)}); "
                    f"{cls.__name__} (version {cls.version}, reads {sorted(cls.reads)}) "
                    f"cannot also serve it: two codecs share a kind only if each reads the "
                    f"other's output. Give the new layout a new kind."
                )
        register_family(cls.family)
        _CODECS[cls.kind] = cls
        _INSTANCES.clear()
    return cls


def registered_kinds() -> list[str]:
    """The kinds with a registered codec, sorted."""
    return sorted(_CODECS)


def kind_of(signature: str) -> str:
    """The kind of ``signature`` (``kv:quant`` of ``kv:quant:4:64``).

    Raises:
        UnknownSignatureError: no family is registered for the kind.
        ValueError: a known kind with bad parameters.
        TypeError: ``signature`` is not a ``str``.
    """
    return parse_signature(signature).kind


def find_codec_class(kind: str) -> type[KVCodec] | None:
    """The codec class serving ``kind``, loading its entry point if need be; else None."""
    cls = _CODECS.get(kind)
    if cls is None:
        cls = load_plugin(kind)
    return cls


def get_codec(signature: str) -> KVCodec:
    """The codec for ``signature``, bound to its parameters.

    Raises:
        UnknownSignatureError: no codec serves the kind; the message lists the
            registered kinds.
        ValueError: the signature's parameters are not valid for its kind.
    """
    codec = _INSTANCES.get(signature)
    if codec is not None:
        return codec
    try:
        kind = kind_of(signature)  # a miss has tried the kind's entry point already
        cls = find_codec_class(kind)
    except UnknownSignatureError as exc:
        kind, cls = str(getattr(exc, "found", signature)), None
    if cls is None:
        raise UnknownSignatureError(
            f"[codecs.get] Unknown signature kind '{kind}' (in '{signature}'). "
            f"Registered: {', '.join(registered_kinds())}. Install the package that "
            f"provides it (entry-point group '{ENTRY_POINT_GROUP}').",
            found=kind,
            supported=registered_kinds(),
        )
    codec = cls(signature)
    _INSTANCES[signature] = codec
    return codec


def reported_signature(cache: Any) -> str | None:
    """The signature ``cache`` reports: canonical when a family is registered for
    its kind, as written otherwise (for messages); None when it reports none."""
    sig = signature_of(cache)
    if sig is not None:
        return str(sig)
    try:
        text = cache.signature()
    except Exception:  # a cache whose signature() fails has no signature
        return None
    return text if isinstance(text, str) else None


def codec_for(cache: Any) -> KVCodec:
    """The codec for a live cache, chosen by its signature.

    Raises:
        CapabilityError: the cache reports no signature, or one no codec
            serves; the message names what it reported.
    """
    text = reported_signature(cache)
    try:
        if text is None:
            raise UnknownSignatureError("no signature", found=None)
        return get_codec(text)
    except (UnknownSignatureError, ValueError) as exc:
        raise CapabilityError(
            f"[codecs.codec_for] No codec serves {type(cache).__name__} caches "
            f"(signature {text or 'unknown'!r}); it cannot be snapshotted. Registered: "
            f"{', '.join(registered_kinds())}.",
            signature=text or "unknown",
        ) from exc


def load_plugin(kind: str) -> type[KVCodec] | None:
    """Load and register the codec the entry point named ``kind`` declares (and so
    its family); ``None`` when no installed package declares one.

    Raises:
        TypeError: the entry point loads something that is not a codec of ``kind``.
    """
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == kind:
            return _register_entry_point(ep)
    return None


def load_plugins() -> list[type[KVCodec]]:
    """Load and register every codec the entry-point group declares (a lookup that
    asks about every family, such as "which family windows this one", needs them)."""
    loaded = []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        cls = _CODECS.get(ep.name)
        loaded.append(cls if cls is not None else _register_entry_point(ep))
    return loaded


def _register_entry_point(ep: importlib.metadata.EntryPoint) -> type[KVCodec]:
    cls = ep.load()
    if getattr(cls, "kind", None) != ep.name:
        raise TypeError(
            f"[codecs.get] Entry point '{ep.name} = {ep.value}' in group "
            f"'{ENTRY_POINT_GROUP}' loads {cls!r}, whose kind is "
            f"{getattr(cls, 'kind', None)!r}, not '{ep.name}'. Fix the plugin's entry point."
        )
    return register_codec(cls)
