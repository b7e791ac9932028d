"""Storage engines: ordered byte stores behind the :class:`~kvstore.abc.store.Backend` contract.

LMDB (:mod:`.lmdb`, the embedded default), memory (:mod:`.memory`) and Redis /
Valkey / Redis Cluster (:mod:`.redis`); :mod:`.boundary` translates each engine's
exceptions into kvstore's error tree. Nothing here knows what a block or a cache is.
"""
