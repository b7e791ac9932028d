"""The prefix store for mlx-lm users, in mlx-lm's own terms (any model ``mlx_lm.load`` loads).

:class:`StorePromptCache` is mlx-lm's ``LRUPromptCache`` with a store behind it:
``fetch(tokens) -> (caches, rest)`` and ``insert(tokens, caches)`` for
``stream_generate`` users, ``fetch_nearest_cache``/``insert_cache`` for
``mlx_lm.server`` (``kvstore serve``). :func:`stream_generate` does the fetch,
the generation and the insert in one call; :func:`unfused_for_model` spares a model's
suffixes the fused attention's per-shape build on a CUDA GPU. Needs mlx-lm in
:data:`~kvstore.mlx_lm.version.TESTED_MLX_LM`.
"""

from kvstore.mlx_lm.attention import unfused_for_model
from kvstore.mlx_lm.binding import Binding
from kvstore.mlx_lm.events import (
    IMAGE_PROMPT,
    NOT_PERSISTED,
    QUEUE_FULL,
    STORE_ERROR,
    FetchEvent,
    SaveEvent,
)
from kvstore.mlx_lm.families import as_mlx_lm_caches, not_persisted
from kvstore.mlx_lm.generate import stream_generate
from kvstore.mlx_lm.prompt_cache import StorePromptCache
from kvstore.mlx_lm.version import TESTED_MLX_LM, check_mlx_lm_version, mlx_lm_version

__all__ = [
    "StorePromptCache",
    "stream_generate",
    "Binding",
    "FetchEvent",
    "SaveEvent",
    "NOT_PERSISTED",
    "IMAGE_PROMPT",
    "STORE_ERROR",
    "QUEUE_FULL",
    "not_persisted",
    "as_mlx_lm_caches",
    "TESTED_MLX_LM",
    "check_mlx_lm_version",
    "mlx_lm_version",
    "unfused_for_model",
]
