"""``kvstore.store.cache_files``, as the README has named it since 0.1: prompt-cache
files in and out of a store live in :mod:`kvstore.store.maintenance.cache_files`."""

from kvstore.store.maintenance.cache_files import *  # noqa: F403
from kvstore.store.maintenance.cache_files import __all__  # noqa: F401
