"""The reference decoder: :class:`Model` and :func:`build_model`.

One transformer for Llama/Mistral, Qwen2, Qwen3, Gemma 3 text and Qwen3.5
(Gated-DeltaNet layers between attention layers), switched by
:class:`~kvstore.model.args.ModelArgs`. It is mlx-lm compatible
(``model(inputs, cache=...)``, ``model.layers``, ``model.make_cache()``, same
parameter names), and it touches caches only through the capability
predicates: :func:`~kvstore.model.attention.attention_for` picks each layer's
kernel from the cache's signature, before any cache is updated.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from kvstore.caches.mask import create_attention_mask
from kvstore.model.args import ModelArgs, named_config
from kvstore.model.attention import Attend, attention_for, recurrent_for
from kvstore.model.decode_step import DecodeStep, DecodeSteps, GenericStep
from kvstore.model.layers import TransformerBlock, make_norm
from kvstore.model.policy import CachePolicy, LayerGeometry, make_caches

__all__ = ["Model", "build_model", "init_weights"]


class DecoderModel(nn.Module):
    """Embeddings, blocks and the final norm (mlx-lm's inner ``model.model``)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [
            TransformerBlock(args, window, kind)
            for window, kind in zip(args.layer_windows, args.layer_kinds)
        ]
        self.norm = make_norm(args, args.hidden_size)

    def __call__(
        self,
        inputs: mx.array,
        cache: Sequence[Any] | None = None,
        input_embeddings: mx.array | None = None,
    ) -> mx.array:
        caches = [None] * len(self.layers) if cache is None else list(cache)
        if len(caches) != len(self.layers):
            raise ValueError(
                f"[model] Expected one cache per layer ({len(self.layers)}); received "
                f"{len(caches)}. Use model.make_cache()."
            )
        return self.norm(self.run_layers(self.embed(inputs, input_embeddings), caches))

    def run_layers(
        self,
        h: mx.array,
        caches: Sequence[Any],
        *,
        start: int = 0,
        stop: int | None = None,
        masks: Sequence[Any] | None = None,
    ) -> mx.array:
        """Blocks ``start`` to ``stop - 1`` over hidden states ``h``, block ``i`` over
        ``caches[i]`` (one entry per layer; the others are not touched).

        ``masks``: per layer, as :meth:`masks` gives them before any cache is
        updated (computed now from ``caches`` by default). A caller running the
        layers in pieces computes them once, first.
        """
        stop = len(self.layers) if stop is None else stop
        # Every cache is checked before any is updated: an unknown family fails closed.
        attends: list[Attend | None] = []
        for i in range(start, stop):
            if self.args.layer_kinds[i] == "attention":
                attends.append(attention_for(caches[i], i))
            else:
                recurrent_for(caches[i], i)
                attends.append(None)
        if masks is None:
            masks = self.masks(h.shape[1], list(caches))
        for i, attend in zip(range(start, stop), attends):
            h = self.layers[i](h, masks[i], caches[i], attend)
        return h

    def embed(self, inputs: mx.array, input_embeddings: mx.array | None = None) -> mx.array:
        """The first block's input: ``inputs`` embedded (or ``input_embeddings``), scaled
        as the architecture asks."""
        h = self.embed_tokens(inputs) if input_embeddings is None else input_embeddings
        if self.args.scale_embeddings:
            # Rounded through bfloat16 as Gemma (and mlx-lm) do.
            h = h * mx.array(self.args.hidden_size**0.5, mx.bfloat16).astype(h.dtype)
        return h

    def masks(self, n: int, caches: list[Any]) -> list[Any]:
        """Per layer, the attention mask for ``n`` new tokens over ``caches``: one per
        distinct window, from the first cache of an attention layer with it;
        recurrent layers share the padding mask of the first one's cache."""
        by_window: dict[int | None, Any] = {}
        recurrent: list[Any] = []
        kinds = self.args.layer_kinds
        for kind, window, c in zip(kinds, self.args.layer_windows, caches):
            if kind != "attention":
                if not recurrent:
                    recurrent.append(None if c is None else c.make_mask(n))
            elif window not in by_window:
                by_window[window] = (
                    create_attention_mask(n, offset=0, window_size=window)
                    if c is None
                    else c.make_mask(n, return_array=False, window_size=window)
                )
        return [
            by_window[w] if kind == "attention" else recurrent[0]
            for kind, w in zip(kinds, self.args.layer_windows)
        ]


class Model(nn.Module):
    """A causal language model over token ids.

    Attributes:
        args: the normalised :class:`ModelArgs`.
        config: the mlx-lm-style config dict the model was built from (a copy).
        source_path: the directory the model was loaded from, or ``None``.
        decode_steps: the one-token steps built for this model, by cache layout
            (:class:`~kvstore.model.decode_step.DecodeSteps`; ``.enabled = False``
            runs the generic path only).
    """

    def __init__(
        self,
        args: ModelArgs,
        config: dict[str, Any] | None = None,
        source_path: Path | None = None,
    ) -> None:
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.model = DecoderModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        # Underscore: a dict attribute would otherwise join the parameter tree.
        self._config = dict(config) if config is not None else args.to_dict()
        self.source_path = source_path
        self.decode_steps = DecodeSteps()

    @property
    def config(self) -> dict[str, Any]:
        return self._config

    @property
    def layers(self) -> list[TransformerBlock]:
        return self.model.layers

    def __call__(
        self,
        inputs: mx.array,
        cache: Sequence[Any] | None = None,
        input_embeddings: mx.array | None = None,
    ) -> mx.array:
        """Logits ``[B, L, vocab]`` for ``inputs`` ``[B, L]``, updating ``cache`` in place."""
        return self.logits(self.model(inputs, cache, input_embeddings))

    def decode_step(self, caches: list[Any]) -> DecodeStep | GenericStep:
        """The step for one token over ``caches``: specialised to their exact per-layer
        signatures (built once, compiled), or the generic ``self(tokens, cache=caches)``.
        Call it as ``model.decode_step(caches)(tokens, caches)``; it is picked per step."""
        return self.decode_steps.step_for(self, caches)

    def logits(self, hidden: mx.array) -> mx.array:
        """The output head over final hidden states."""
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(hidden)
        return self.lm_head(hidden)

    def layer_layout(self) -> list[LayerGeometry]:
        """Per layer: ``{"n_kv_heads", "head_dim", "sliding_window"}`` (window ``None``
        for full attention). What a store needs to know about the cache geometry."""
        return self.args.layer_layout()

    def make_cache(self, policy: CachePolicy | None = None) -> list[Any]:
        """Fresh per-layer caches of the family ``policy`` asks for (plain by default)."""
        return make_caches(self.layer_layout(), policy)


def init_weights(model: nn.Module, seed: int) -> nn.Module:
    """Seeded, order-independent initial weights (MLX's default distributions).

    Linear weights and biases are uniform in ``±1/sqrt(fan_in)``, embeddings
    normal with std ``1/sqrt(dims)``; norms keep their constructed values.
    Each parameter draws from its own key, so the result depends only on
    ``seed`` and the architecture, not on the global random state.
    """
    flat = cast(list[tuple[str, Any]], tree_flatten(model.parameters()))
    keys = mx.random.split(mx.random.key(seed), len(flat))
    params = []
    for key, (name, value) in zip(keys, flat):
        if "norm" in name:
            params.append((name, value))
        elif "embed_tokens" in name:
            scale = value.shape[-1] ** -0.5
            params.append((name, scale * mx.random.normal(value.shape, key=key)))
        else:
            if name.endswith("conv1d.weight"):  # [channels, kernel, 1]: a depthwise conv
                fan_in = value.shape[1]
            else:
                fan_in = value.shape[-1] if name.endswith("weight") else value.shape[0]
            bound = fan_in**-0.5
            params.append((name, mx.random.uniform(-bound, bound, value.shape, key=key)))
    model.update(tree_unflatten(params))
    return model


def build_model(
    config: str | ModelArgs | dict[str, Any] = "tiny",
    seed: int = 0,
    *,
    dtype: mx.Dtype = mx.float32,
) -> Model:
    """A model with seeded random weights.

    Args:
        config: a named config (``"tiny"``, ``"tiny-qwen3"``, ``"tiny-gemma3"``,
            ``"small"``, ``"small-gemma3"``; see
            :data:`~kvstore.model.args.NAMED_CONFIGS`), a :class:`ModelArgs`, or an
            mlx-lm ``config.json`` dict.
        seed: weight seed; the same seed gives the same weights.
        dtype: parameter dtype.

    Raises:
        ValueError: unknown named config.
        CapabilityError: unsupported ``model_type``.
    """
    if type(config) is str:
        cfg: dict[str, Any] = named_config(config)
        args = ModelArgs.from_config(cfg)
    elif type(config) is ModelArgs:
        args, cfg = config, config.to_dict()
    else:
        cfg = dict(config)  # type: ignore[arg-type]
        args = ModelArgs.from_config(cfg)
    model = Model(args, config=cfg)
    init_weights(model, seed)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model
