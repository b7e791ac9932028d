"""``kvstore serve``: mlx-lm's OpenAI-compatible server with a persistent, shared prompt cache.

:mod:`.server` runs ``mlx_lm.server`` with a :class:`~kvstore.mlx_lm.StorePromptCache`
at its prompt-cache seam; :mod:`.writer` writes saves behind the generating
thread; :mod:`.metrics` is ``GET /metrics``. Needs ``mlx-kvstore[serve]``.
"""
