"""What a :class:`~kvstore.mlx_lm.StorePromptCache` reports.

Each fetch and each save is an event (:class:`FetchEvent`, :class:`SaveEvent`)
handed to the prompt cache's listeners (``kvstore serve``'s metrics); a miss
has a reason, the store's :class:`~kvstore.abc.store.MissReason` or one of ours.
Saves go to the store's own writer thread (``store.save_behind``); a save's
event is emitted there, once it is committed or failed.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

__all__ = [
    "FetchEvent",
    "SaveEvent",
    "NOT_PERSISTED",
    "IMAGE_PROMPT",
    "STORE_ERROR",
    "QUEUE_FULL",
]

#: Miss reasons of our own, beside the store's :class:`~kvstore.abc.store.MissReason`.
NOT_PERSISTED = "not_persisted"  # the model's cache families stay in memory
IMAGE_PROMPT = "image_prompt"  # a prompt with images: its key holds image ids, not tokens
STORE_ERROR = "store_error"  # any other store fault (a full store, a codec missing...)
QUEUE_FULL = "queue_full"  # a save dropped: max_pending saves wait for the store's writer


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
        seconds: the commit the save was part of (on the store's writer thread; a
            group commit's, under ``durability="group"``).
        waited_s: from the hand-off to that commit's start (the writer's queue).
        handoff_s: what the inserting (generating) thread spent on the save: asking
            the store what it holds, scheduling the copies of the new rows, enqueueing.
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
