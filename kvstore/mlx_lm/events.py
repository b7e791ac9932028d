"""What a :class:`~kvstore.mlx_lm.StorePromptCache` reports, and where its saves go.

Each fetch and each save is an event (:class:`FetchEvent`, :class:`SaveEvent`)
handed to the prompt cache's listeners (``kvstore serve``'s metrics); a miss
has a reason, the store's :class:`~kvstore.abc.store.MissReason` or one of ours.
Saves go to a :class:`Writer`: inline by default, a background thread in
``kvstore serve`` (:class:`kvstore.serve.writer.SaveQueue`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "Writer",
    "InlineWriter",
    "FetchEvent",
    "SaveEvent",
    "NOT_PERSISTED",
    "IMAGE_PROMPT",
    "STORE_ERROR",
]

#: Miss reasons of our own, beside the store's :class:`~kvstore.abc.store.MissReason`.
NOT_PERSISTED = "not_persisted"  # the model's cache families stay in memory
IMAGE_PROMPT = "image_prompt"  # a prompt with images: its key holds image ids, not tokens
STORE_ERROR = "store_error"  # any other store fault (a full store, a codec missing...)


class Writer(Protocol):
    """Where saves go: ``submit(job)`` runs ``job()`` now or later; ``flush()`` waits.

    A writer that runs jobs later (on another thread) needs the caches handed to
    ``insert`` left as they are until the save ran: mlx-lm's server and
    :func:`kvstore.mlx_lm.stream_generate` never touch them again.
    """

    def submit(self, job: Callable[[], None]) -> None: ...

    def flush(self, timeout: float | None = None) -> bool: ...


class InlineWriter:
    """Runs each save on the calling thread, at once."""

    def submit(self, job: Callable[[], None]) -> None:
        job()

    def flush(self, timeout: float | None = None) -> bool:
        return True


@dataclass(frozen=True)
class FetchEvent:
    """What one fetch did.

    Attributes:
        source: ``"memory"``, ``"store"`` or ``"none"`` (nothing reused).
        reused: prompt tokens whose KV came from ``source``.
        miss_reason: why the store served nothing (a ``MissReason`` value,
            :data:`NOT_PERSISTED`, :data:`IMAGE_PROMPT`, :data:`STORE_ERROR`), or
            ``None`` when it was not asked or had nothing better than memory.
        exact_hit: the memory LRU held the whole prompt (trimmed by one token).
    """

    model_key: Hashable
    prompt_tokens: int
    reused: int
    source: str
    miss_reason: str | None = None
    lookup_s: float = 0.0
    restore_s: float = 0.0
    exact_hit: bool = False


@dataclass(frozen=True)
class SaveEvent:
    """What one save did (``error`` set when it failed; nothing is raised).

    Attributes:
        seconds: the save itself (on the writer's thread).
        waited_s: from the hand-off to the save's start (the writer's queue).
        handoff_s: what the inserting (generating) thread spent on the save: settling
            the arrays' graph and copying captured blocks, then enqueueing.
    """

    namespace: str
    tokens: int
    written_blocks: int = 0
    written_bytes: int = 0
    deduplicated: int = 0
    seconds: float = 0.0
    waited_s: float = 0.0
    handoff_s: float = 0.0
    error: str | None = None
    reason: str | None = None
