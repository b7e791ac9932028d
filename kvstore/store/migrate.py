"""``kvstore.store.migrate``, as the README has named it since 0.1: the migration
library lives in :mod:`kvstore.store.maintenance.migrate` (above the bridge)."""

from kvstore.store.maintenance.migrate import *  # noqa: F403
from kvstore.store.maintenance.migrate import __all__  # noqa: F401
