"""``stream_generate`` with a :class:`~kvstore.mlx_lm.StorePromptCache`: fetch, generate, insert.

The three calls a ``stream_generate`` user would otherwise write, in the right
order: the longest known prefix is fetched, only the rest of the prompt is fed,
and afterwards exactly the tokens the caches hold KV for (the prompt and the
generated tokens fed back) are inserted, so the next turn reuses all of it. The
model's few-query attention is routed as ``kvstore serve`` routes it
(:func:`~kvstore.mlx_lm.attention.unfused_for_model`): on a CUDA GPU the rest of a
fetched prompt is attended without building a cuDNN graph of its shape.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from mlx_lm.generate import GenerationResponse
from mlx_lm.generate import stream_generate as mlx_lm_stream_generate

from kvstore.mlx_lm.attention import unfused_for_model
from kvstore.mlx_lm.families import held_tokens, token_ids
from kvstore.mlx_lm.prompt_cache import StorePromptCache

__all__ = ["stream_generate"]


def stream_generate(
    model: Any,
    tokenizer: Any,
    prompt: Any,
    *,
    prompt_cache: StorePromptCache,
    **kwargs: Any,
) -> Iterator[GenerationResponse]:
    """mlx-lm's ``stream_generate``, reusing and feeding ``prompt_cache``.

    Args:
        model, tokenizer: as ``mlx_lm.load`` returns them (the model bound to
            ``prompt_cache``).
        prompt: text (encoded as mlx-lm does) or token ids.
        prompt_cache: the store-backed prompt cache.
        **kwargs: the rest of mlx-lm's ``stream_generate`` arguments.

    Yields:
        mlx-lm's ``GenerationResponse``; ``prompt_tokens`` counts only the tokens fed.
    """
    if isinstance(prompt, str):
        bos = getattr(tokenizer, "bos_token", None)
        special = bos is None or not prompt.startswith(bos)  # as mlx-lm decides
        prompt = tokenizer.encode(prompt, add_special_tokens=special)
    tokens = token_ids(prompt, "stream_generate")
    unfused_for_model(model)  # idempotent; after the first call a lookup and a check
    caches, rest = prompt_cache.fetch(tokens)
    generated: list[int] = []
    try:
        for response in mlx_lm_stream_generate(
            model, tokenizer, rest, prompt_cache=caches, **kwargs
        ):
            generated.append(int(response.token))
            yield response
    finally:
        # Also when the caller stops early: what the caches hold is worth keeping, if it is
        # known exactly (mlx-lm computes one token ahead, so a stop may leave one unknown).
        fed = tokens + generated
        held = held_tokens(caches)
        if held is None or held <= len(fed):
            prompt_cache.insert(fed if held is None else fed[:held], caches)
