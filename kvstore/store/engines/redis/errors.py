"""Every redis-py exception class and what it becomes (a test fails when one is missing).

Unreachable, timed-out, loading or failing-over servers are
:class:`~kvstore.errors.StoreUnavailableError` (a caller may treat it as a
miss and retry later: the client reconnects by itself); a server out of
memory under ``noeviction`` is :class:`~kvstore.errors.StoreFullError`;
credentials and permissions are :class:`~kvstore.errors.StoreConfigError`.
"""

from __future__ import annotations

from redis import exceptions as rx

from kvstore.errors import (
    ReadOnlyStoreError,
    StoreConfigError,
    StoreError,
    StoreFullError,
    StoreUnavailableError,
)
from kvstore.store.engines.boundary import Translation

__all__ = ["REDIS_ERRORS"]

_BUG = "This is a kvstore bug; please report it with the traceback."
_RETRY = (
    "The server or cluster is unreachable or busy; the store reconnects by itself, retry later."
)
_CLUSTER = "The cluster is failing over or resharding; retry when it is stable."
_AUTH = "Check the user and password in the URL (redis://user:password@host:port/db)."

#: Every redis-py exception class and ours (looked up along the MRO).
REDIS_ERRORS: dict[type[BaseException], Translation] = {
    # Reaching the server.
    rx.ConnectionError: Translation(StoreUnavailableError, _RETRY),
    rx.TimeoutError: Translation(
        StoreUnavailableError,
        "The server did not answer within the call's deadline, (retries + 1) x "
        "max(connect_timeout, socket_timeout); it may be down or overloaded.",
    ),
    rx.BusyLoadingError: Translation(
        StoreUnavailableError, "The server is loading its dataset; retry in a moment."
    ),
    rx.MaxConnectionsError: Translation(
        StoreUnavailableError, "Every pooled connection is in use; raise max_connections."
    ),
    rx.AuthenticationError: Translation(StoreConfigError, _AUTH),
    rx.AuthorizationError: Translation(StoreConfigError, _AUTH),
    rx.AuthenticationWrongNumberOfArgsError: Translation(StoreConfigError, _AUTH),
    rx.ExternalAuthProviderError: Translation(
        StoreConfigError, "The credential provider failed; check its configuration."
    ),
    rx.NoPermissionError: Translation(
        StoreConfigError,
        "The Redis user lacks a permission kvstore needs (GET/SET/MULTI/WATCH/Z* on its keys).",
    ),
    # The server refused a write.
    rx.OutOfMemoryError: Translation(
        StoreFullError,
        "The server reached maxmemory under noeviction; raise maxmemory, set a byte budget "
        "(max_bytes) or use server_eviction=true with a volatile-* policy.",
    ),
    rx.ReadOnlyError: Translation(
        ReadOnlyStoreError,
        "The server is a read-only replica; point the URL at the primary.",
    ),
    # Clusters.
    rx.ClusterDownError: Translation(StoreUnavailableError, _CLUSTER),
    rx.MasterDownError: Translation(StoreUnavailableError, _CLUSTER),
    rx.TryAgainError: Translation(StoreUnavailableError, _CLUSTER),
    rx.SlotNotCoveredError: Translation(StoreUnavailableError, _CLUSTER),
    rx.AskError: Translation(StoreUnavailableError, _CLUSTER),
    rx.MovedError: Translation(StoreUnavailableError, _CLUSTER),
    rx.ClusterError: Translation(StoreUnavailableError, _CLUSTER),
    rx.ClusterCrossSlotError: Translation(StoreError, "A command spanned cluster slots. " + _BUG),
    rx.CrossSlotTransactionError: Translation(
        StoreError, "A transaction spanned cluster slots. " + _BUG
    ),
    rx.RedisClusterException: Translation(
        StoreUnavailableError, "The cluster client failed; check the startup nodes in the URL."
    ),
    rx.InvalidPipelineStack: Translation(StoreError, _BUG),
    # Protocol and programming errors.
    rx.ExecAbortError: Translation(StoreError, "The server aborted a transaction. " + _BUG),
    rx.WatchError: Translation(StoreError, "A watched key changed. " + _BUG),
    rx.DataError: Translation(StoreError, "A value redis-py cannot send. " + _BUG),
    rx.InvalidResponse: Translation(
        StoreUnavailableError, "The server sent a malformed reply; is the URL a Redis server?"
    ),
    rx.ModuleError: Translation(StoreError, "A Redis module failed. " + _BUG),
    rx.NoScriptError: Translation(StoreError, _BUG),
    rx.NoSuchFieldsetError: Translation(StoreError, _BUG),
    rx.PubSubError: Translation(StoreError, _BUG),
    rx.LockError: Translation(StoreError, _BUG),
    rx.LockNotOwnedError: Translation(StoreError, _BUG),
    rx.ChildDeadlockedError: Translation(
        StoreUnavailableError, "The store was used in a forked child; open it in the child."
    ),
    rx.IncorrectPolicyType: Translation(StoreError, _BUG),
    rx.ResponseError: Translation(StoreError, "The server rejected a command. " + _BUG),
    rx.RedisError: Translation(StoreError, "Unexpected redis-py error."),
}

#: Classes later redis-py releases added (8.2: a server at ``maxclients``, a cluster none
#: of whose nodes answers), mapped where the installed one has them.
_ADDED_LATER = {
    "MaxClientsReachedError": Translation(
        StoreUnavailableError,
        "The server has as many clients as its maxclients allows; raise maxclients or "
        "close idle clients, then retry.",
    ),
    "RedisClusterUnreachableError": Translation(
        StoreUnavailableError,
        "No node of the cluster answered; check the startup nodes in the URL, or retry "
        "when the cluster is back.",
    ),
}
REDIS_ERRORS.update(
    {getattr(rx, name): found for name, found in _ADDED_LATER.items() if hasattr(rx, name)}
)
