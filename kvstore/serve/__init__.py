"""``kvstore serve``: mlx-lm's OpenAI-compatible server with a persistent, shared prompt cache.

:mod:`.server` runs ``mlx_lm.server`` with a :class:`~kvstore.mlx_lm.StorePromptCache`
at its prompt-cache seam (saves go behind the generating thread, through the store's
``save_behind``); :mod:`.warmup` builds a model's kernels as it loads; :mod:`.metrics`
is ``GET /metrics``. Needs ``mlx-kvstore[serve]``.
"""
