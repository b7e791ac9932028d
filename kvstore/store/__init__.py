"""The prefix store: open one by URL, name models by namespace, save and look up prompts.

>>> store = open_store("memory://")
>>> ns = namespace_for_model(model)  # doctest: +SKIP
>>> store.save(ns, tokens, caches)  # doctest: +SKIP
>>> caches = store.restore(store.lookup(ns, tokens), model.make_cache())  # doctest: +SKIP

(``kvstore.bridge.generate(model, prompt, store=store)`` does all of this itself.)

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
``redis://[user:pw@]host:6379/0``  a Redis or Valkey server (``pip install
                                   'mlx-kvstore[redis]'``); many hosts share it
``rediss://host:6380/0``           the same over TLS
``valkey://host:6379/0``           the same as ``redis://`` (``valkeys://``: TLS)
``redis+cluster://h1:7000,h2:7000``  a Redis Cluster, any reachable nodes
                                   (``rediss+cluster://``, ``valkey+cluster://``)
``tiered://?tiers=URL,URL[,URL]``  stores stacked fastest first, e.g.
                                   ``tiered://?tiers=memory://,lmdb:///var/kv,``
                                   ``redis://cache:6379/0`` (see below)
=================================  ================================================

A tiered store (:mod:`kvstore.store.blocks.tiered`) is also opened with
``open_store("tiered", tiers=[...])``, the tiers being URLs or open stores,
fastest first. Tier URLs in the query are separated by commas; one with its
own options (``?`` and ``&``) is percent-encoded
(``lmdb:///var/kv%3Fmap_size%3D4GiB``). Tiered options: ``write``
(``"through"``, the default, or ``"back"``) and ``promote`` (default true);
settings and store options given to the tiered store go to every tier
opened from a URL.

Options go as keyword arguments or URL query parameters
(``lmdb:///var/kv?map_size=1GiB&block_size=128``):

* settings, persisted at creation (``block_size``, ``storage_policy``) or
  replaceable later (``max_bytes``, ``namespace_max_bytes``); see
  :mod:`kvstore.store.settings`;
* store options: ``verify``, ``touch_interval``, ``clock``, ``low_water``,
  ``durability`` (``"group"``, the default, ``"sync"`` or ``"os"``; see
  :mod:`kvstore.store.kv.writer`) and ``group_window`` (seconds);
* backend options (LMDB: ``map_size``, ``max_map_size``, ``readonly``,
  ``create``, ``max_readers``, ``sync``; Redis: ``socket_timeout``,
  ``connect_timeout``, ``retries``, ``chunk_size``, ``ttl``,
  ``server_eviction``, ``readonly``, ``key_prefix``, ``max_connections``,
  ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``, ``ssl_cert_reqs``;
  see :class:`kvstore.store.engines.redis.backend.RedisBackend`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from kvstore.abc.store import Backend, PrefixStore
from kvstore.codecs.host_memory import keep_freed_memory
from kvstore.errors import StoreConfigError
from kvstore.store.blocks.prefix import STORE_OPTIONS, BlockPrefixStore
from kvstore.store.engines.redis import REDIS_OPTIONS, REDIS_SCHEMES
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
    "namespace_for_model",
    "BlockPrefixStore",
    "StoreSettings",
]

#: Names this package offered before the bridge had a package of its own; they
#: live in :mod:`kvstore.bridge` (above the store) and resolve on first use.
_BRIDGE_NAMES = ("model_fingerprint", "namespace_for", "namespace_for_model")


def __getattr__(name: str) -> Any:
    if name in _BRIDGE_NAMES:
        import kvstore.bridge  # compat re-export: a call-time import, not a layer edge

        return getattr(kvstore.bridge, name)
    raise AttributeError(f"module 'kvstore.store' has no attribute {name!r}")


#: URL scheme -> ``"module:factory"``; ``factory(location, url, options) -> Backend``.
SCHEMES: dict[str, str] = {
    "lmdb": "kvstore.store.engines.lmdb:open_lmdb_backend",
    "memory": "kvstore.store.engines.memory:open_memory_backend",
    **{scheme: "kvstore.store.engines.redis:open_redis_backend" for scheme in REDIS_SCHEMES},
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
    return _opened(factory(location, url, backend_options))


def _opened(backend: Backend) -> Backend:
    """``backend``, once this process keeps freed heap (:mod:`kvstore.codecs.host_memory`).

    Every large value a store moves is a fresh block: a record encoded for a put,
    LMDB's dirty pages of a write (allocated per transaction, freed at its commit), a
    Redis reply. Given back on free, each was faulted in afresh by the next, which cost
    more than the copies: on the CI VM 8 records of 32 MiB put through ``put_blocks``
    took 1.3 s against 0.73 kept, and P9's Redis read of 256 MiB 368 ms against 213.
    A process that opens a store therefore keeps them, whatever it does with it.
    """
    keep_freed_memory()
    return backend


def _refuse_twice(query: dict[str, str], options: dict[str, Any]) -> None:
    twice = sorted(set(query) & set(options))
    if twice:
        raise StoreConfigError(
            f"[open_store] {', '.join(twice)} given both in the URL and as an argument; "
            f"give each option once.",
            found=twice,
        )


def open_store(url: str, **options: Any) -> PrefixStore:
    """Open (creating when missing) the prefix store at ``url``.

    Args:
        url: where the store lives; every form is in the module docstring:
            ``lmdb:///var/cache/kvstore``, ``lmdb:relative/dir``, ``lmdb:~/kv``,
            a bare path, ``memory://``, ``memory://name``,
            ``redis://[user:password@]host:6379/0``, ``rediss://...`` (TLS),
            ``valkey://...``, ``redis+cluster://host:7000,host:7001``,
            ``tiered://?tiers=memory://,lmdb:///var/kv,redis://cache:6379/0``
            or ``"tiered"`` with ``tiers=[...]``.
        **options: settings (``block_size=256``, ``storage_policy="lossless"``,
            ``max_bytes``, ``namespace_max_bytes``), store options (``verify``,
            ``touch_interval``, ``clock``, ``low_water``, ``durability``,
            ``group_window``) and backend options
            (``map_size``, ``max_map_size``, ``readonly``, ``create``,
            ``max_readers``, ``sync`` for LMDB; ``socket_timeout``, ``ttl``,
            ``chunk_size``, ``server_eviction``, ``key_prefix``... for Redis).
            URL query parameters count as explicit options too. A tiered
            store takes ``tiers``, ``write`` and ``promote``.

    Returns:
        A :class:`~kvstore.abc.store.PrefixStore`; use it as a context manager.

    Raises:
        StoreConfigError: a malformed URL, an unknown scheme or option, a location
            that is not a store, or an explicit setting that conflicts with the
            one the store was created with (the message names the setting and
            both values).
        FormatVersionError: the store was written by a newer kvstore.
    """
    if isinstance(url, str) and (url == "tiered" or url.lower().startswith("tiered:")):
        return _open_tiered(url, options)
    scheme, location, query = _split_url(url)
    _refuse_twice(query, options)
    factory = _scheme_factory(scheme, url)
    settings, store_options, backend_options = _split_options(scheme, url, {**query, **options})
    _durability(scheme, url, store_options, backend_options)
    backend = _opened(factory(location, url, backend_options))
    return BlockPrefixStore(backend, **store_options, **settings)


def _durability(
    scheme: str, url: str, store_options: dict[str, Any], backend_options: dict[str, Any]
) -> None:
    """Reconcile the ``durability`` store option with LMDB's ``sync``: ``"os"`` opens the
    environment without syncing; ``sync=False`` alone means ``"os"``."""
    if scheme != "lmdb":
        return
    durability = store_options.get("durability")
    sync = backend_options.get("sync")
    if durability is None:
        if sync is False:
            store_options["durability"] = "os"
        return
    if sync is not None and sync != (durability != "os"):
        raise StoreConfigError(
            f"[open_store] durability={durability!r} and sync={sync!r} disagree for {url!r}; "
            f"give durability only ('os' does not sync, 'sync' and 'group' do).",
            found={"durability": durability, "sync": sync},
        )
    backend_options["sync"] = durability != "os"


_TIERED_OPTIONS = ("tiers", "write", "promote")


def _open_tiered(url: str, options: dict[str, Any]) -> PrefixStore:
    """``open_store("tiered", tiers=[...])`` and ``tiered://?tiers=a,b,c&write=back``."""
    from kvstore.store.blocks.tiered import TieredPrefixStore

    query = dict(parse_qsl(urlsplit(url).query, keep_blank_values=True)) if "?" in url else {}
    _refuse_twice(query, options)
    merged = {**query, **options}
    tiers = merged.pop("tiers", None)
    if isinstance(tiers, str):
        tiers = [t for t in tiers.split(",") if t]
    if not tiers or isinstance(tiers, (str, bytes)) or not isinstance(tiers, (list, tuple)):
        raise StoreConfigError(
            "[open_store] A tiered store needs tiers, fastest first: "
            "open_store('tiered', tiers=['memory://', 'lmdb:///var/kv', 'redis://h:6379/0']) "
            f"or tiered://?tiers=memory://,lmdb:///var/kv; received {tiers!r}.",
            found=tiers,
        )
    write = merged.pop("write", "through")
    promote = parse_bool(merged.pop("promote", True), "promote")
    backend_options = sorted(set(merged) - set(SETTING_PARSERS) - set(STORE_OPTIONS))
    if backend_options:
        raise StoreConfigError(
            f"[open_store] {', '.join(backend_options)} are not options of a tiered store "
            f"(tiers, write, promote, settings and store options are); put a tier's own "
            f"options in its URL.",
            found=backend_options,
        )
    opened: list[PrefixStore] = []
    try:
        for tier in tiers:
            opened.append(tier if isinstance(tier, PrefixStore) else open_store(tier, **merged))
        return TieredPrefixStore(
            opened, write=write, promote=promote, url=url if url != "tiered" else None
        )
    except BaseException:
        for store in opened:
            store.close()
        raise
