"""The prefix store: open one by URL, name models by namespace, save and look up prompts.

>>> store = open_store("memory://")
>>> ns = namespace_for(model_fingerprint("/models/llama"), model.layer_layout())  # doctest: +SKIP

URL schemes (the table :data:`SCHEMES` maps each to the module that opens it,
imported only when used):

=================================  ================================================
URL                                what it opens
=================================  ================================================
``lmdb:///var/cache/kvstore``      LMDB store in that directory (the default engine;
                                   created when missing). Many processes, one machine.
``lmdb:relative/dir``              the same, relative to the working directory
``lmdb:~/kvstore``                 the same, under the home directory
``/var/cache/kvstore``             a bare path is an LMDB store
``memory://``                      a private in-process store (tests, L1 tier)
``memory://shared``                the in-process store called ``shared``
=================================  ================================================

Options go as keyword arguments or URL query parameters
(``lmdb:///var/kv?map_size=1GiB&block_size=128``):

* settings, persisted at creation (``block_size``, ``storage_policy``) or
  replaceable later (``max_bytes``, ``namespace_max_bytes``); see
  :mod:`kvstore.store.settings`;
* store options: ``verify``, ``touch_interval``, ``clock``, ``low_water``;
* backend options (LMDB: ``map_size``, ``max_map_size``, ``readonly``,
  ``create``, ``max_readers``, ``sync``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from kvstore.abc.store import Backend, PrefixStore
from kvstore.errors import StoreConfigError
from kvstore.store.fingerprint import model_fingerprint, namespace_for
from kvstore.store.prefix import STORE_OPTIONS, BlockPrefixStore
from kvstore.store.redis import REDIS_OPTIONS, REDIS_SCHEMES
from kvstore.store.settings import (
    SETTING_PARSERS,
    StoreSettings,
    parse_bool,
    parse_byte_size,
    parse_int,
    parse_optional_byte_size,
)

__all__ = [
    "SCHEMES",
    "BACKEND_OPTIONS",
    "open_store",
    "open_backend",
    "model_fingerprint",
    "namespace_for",
    "BlockPrefixStore",
    "StoreSettings",
]

#: URL scheme -> ``"module:factory"``; ``factory(location, url, options) -> Backend``.
SCHEMES: dict[str, str] = {
    "lmdb": "kvstore.store.lmdb:open_lmdb_backend",
    "memory": "kvstore.store.memory:open_memory_backend",
    **{scheme: "kvstore.store.redis:open_redis_backend" for scheme in REDIS_SCHEMES},
}

#: Options each scheme's backend accepts, with their parsers (URL values are strings).
BACKEND_OPTIONS: dict[str, dict[str, Callable[[Any], Any]]] = {
    "lmdb": {
        "map_size": lambda v: parse_byte_size(v, "map_size"),
        "max_map_size": parse_optional_byte_size("max_map_size"),
        "readonly": lambda v: parse_bool(v, "readonly"),
        "create": lambda v: parse_bool(v, "create"),
        "max_readers": lambda v: parse_int(v, "max_readers", 1),
        "sync": lambda v: parse_bool(v, "sync"),
    },
    "memory": {},
    **{scheme: REDIS_OPTIONS for scheme in REDIS_SCHEMES},
}


def _split_url(url: str) -> tuple[str, str, dict[str, str]]:
    """``(scheme, location, query options)`` of a store URL."""
    if not isinstance(url, str) or not url.strip():
        raise StoreConfigError(
            f"[open_store] A store URL is a non-empty string such as 'lmdb:///var/kv' or "
            f"'memory://'; received {url!r}.",
            url=url,
        )
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if not scheme or (len(scheme) == 1 and url[1:3] in (":\\", ":/")):  # a bare path
        return "lmdb", url, {}
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    if scheme == "lmdb":
        if parts.netloc not in ("", "localhost"):
            raise StoreConfigError(
                f"[open_store] {url!r} has host {parts.netloc!r}; an LMDB store is local. "
                f"Write lmdb:///absolute/path (three slashes) or lmdb:relative/path.",
                url=url,
            )
        return scheme, unquote(parts.path), query
    return scheme, unquote(parts.netloc + parts.path), query


def _scheme_factory(scheme: str, url: str) -> Callable[[str, str, dict[str, Any]], Backend]:
    target = SCHEMES.get(scheme)
    if target is None:
        raise StoreConfigError(
            f"[open_store] Unknown store URL scheme {scheme!r} in {url!r}. Known schemes: "
            f"{', '.join(sorted(SCHEMES))} (e.g. lmdb:///var/kv, memory://).",
            found=scheme,
            supported=sorted(SCHEMES),
        )
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _split_options(
    scheme: str, url: str, options: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(settings, store options, backend options), each value parsed."""
    backend_parsers = BACKEND_OPTIONS.get(scheme, {})
    settings, store, backend = {}, {}, {}
    for name, value in options.items():
        if name in SETTING_PARSERS:
            settings[name] = SETTING_PARSERS[name](value)
        elif name in STORE_OPTIONS:
            store[name] = STORE_OPTIONS[name](value)
        elif name in backend_parsers or scheme not in BACKEND_OPTIONS:
            parse = backend_parsers.get(name)
            backend[name] = parse(value) if parse else value
        else:
            known = sorted({*SETTING_PARSERS, *STORE_OPTIONS, *backend_parsers})
            raise StoreConfigError(
                f"[open_store] Unknown option {name!r} for {url!r}. Options: {', '.join(known)}.",
                found=name,
                supported=known,
            )
    return settings, store, backend


def open_backend(url: str, **options: Any) -> Backend:
    """Only the backend of ``url``: raw key/value access, for tools and tests.

    Takes the backend options of ``url``'s scheme (``map_size``... for LMDB).
    """
    scheme, location, query = _split_url(url)
    factory = _scheme_factory(scheme, url)
    settings, store_options, backend_options = _split_options(scheme, url, {**query, **options})
    if settings or store_options:
        raise StoreConfigError(
            f"[open_backend] {', '.join(sorted({*settings, *store_options}))} are store "
            f"options; a bare backend takes only backend options. Use open_store().",
            found=sorted({*settings, *store_options}),
        )
    return factory(location, url, backend_options)


def open_store(url: str, **options: Any) -> PrefixStore:
    """Open (creating when missing) the prefix store at ``url``.

    Args:
        url: where the store lives; every form is in the module docstring:
            ``lmdb:///var/cache/kvstore``, ``lmdb:relative/dir``, ``lmdb:~/kv``,
            a bare path, ``memory://``, ``memory://name``.
        **options: settings (``block_size=256``, ``storage_policy="lossless"``,
            ``max_bytes``, ``namespace_max_bytes``), store options (``verify``,
            ``touch_interval``, ``clock``, ``low_water``) and backend options
            (``map_size``, ``max_map_size``, ``readonly``, ``create``,
            ``max_readers``, ``sync`` for LMDB). URL query parameters count as
            explicit options too.

    Returns:
        A :class:`~kvstore.abc.store.PrefixStore`; use it as a context manager.

    Raises:
        StoreConfigError: a malformed URL, an unknown scheme or option, a location
            that is not a store, or an explicit setting that conflicts with the
            one the store was created with (the message names the setting and
            both values).
        FormatVersionError: the store was written by a newer kvstore.
    """
    scheme, location, query = _split_url(url)
    twice = sorted(set(query) & set(options))
    if twice:
        raise StoreConfigError(
            f"[open_store] {', '.join(twice)} given both in the URL and as an argument; "
            f"give each option once.",
            found=twice,
        )
    factory = _scheme_factory(scheme, url)
    settings, store_options, backend_options = _split_options(scheme, url, {**query, **options})
    backend = factory(location, url, backend_options)
    return BlockPrefixStore(backend, **store_options, **settings)
