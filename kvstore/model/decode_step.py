"""The one-token decode step, specialised to the cache layout in hand (issue 17).

The generic path (``model(tokens, cache=caches)``) asks every layer's cache for its
signature and its attention kernel on every step, and builds the whole graph op by
op in Python. :class:`DecodeStep` is built once for one exact tuple of per-layer
signatures: the model unrolled per layer, each layer's attention kernel resolved
up front, and what lies between two attentions -- the output projection, residuals
and MLP of one block, the norm, projections and RoPE of the next -- compiled with
``mx.compile``. The RoPE offset is an array input, so one trace serves every step;
each segment's outputs are the new rows the cache takes, its inputs what
attention returned: the caches themselves never enter a compiled function.

The cut is where MLX allows it. Attention reads ``offset + 1`` rows, a length that
changes every step, and a shapeless compile cannot slice (``Slice`` infers no
shapes); masking a fixed-capacity buffer instead would change the reduction order
and so the logits. And a cache buffer passed through a compiled function is an
input the function still holds, so MLX cannot update it in place: every step
would copy every buffer. So each layer's ``update_and_fetch`` and attention run
as the generic path runs them, and the logits are bit-identical to it (tested).

:class:`DecodeSteps` (one per model, ``model.decode_steps``) picks the step for
each call: the specialised one when every cache reports a signature, every
layer is an attention block without an output gate (a hybrid model's recurrent
layers, issue 16, and its gated attention keep the generic path), and the
caches agree on their offset; otherwise
the generic path, with the reason. A cache whose signature is unknown or
changes (a growing cache rolled into a ring, a transcode) never reaches a step
built for another tuple. Prefill keeps the generic path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import mlx.core as mx

from kvstore.abc.cache import signature_of
from kvstore.errors import CapabilityError
from kvstore.model.attention import Attend, attention_for, dense_attention
from kvstore.model.layers import TransformerBlock

#: A :class:`kvstore.model.transformer.Model` (which imports this module, so it is
#: not imported here).
Model = Any

__all__ = ["DecodeStep", "DecodeSteps", "GenericStep", "Step", "layout_of"]

#: ``step(tokens [B, 1], caches) -> logits [B, 1, vocab]``, updating ``caches``.
Step = Callable[[mx.array, list[Any]], mx.array]

#: Generic decode steps with one layout before a specialised step is built for
#: it: a short generation never pays the compile (a trace per layer).
BUILD_AFTER = 16


class GenericStep:
    """The generic path, ``model(tokens, cache=caches)``, and why it was taken."""

    path: Literal["generic"] = "generic"

    def __init__(self, model: Model, reason: str) -> None:
        self._model = model
        self.reason = reason

    def __call__(self, tokens: mx.array, caches: list[Any]) -> mx.array:
        return self._model(tokens, cache=caches)

    def __repr__(self) -> str:
        return f"GenericStep({self.reason})"


class DecodeStep:
    """The one-token step for one tuple of per-layer cache signatures.

    Built by :class:`DecodeSteps`, which calls it only for caches whose
    signatures equal :attr:`signatures` and whose offsets agree.

    Args:
        model: the model (its weights are read on every call, never captured).
        signatures: the per-layer signatures the step is for.
        attends: each layer's attention kernel for those signatures.
    """

    path: Literal["specialised"] = "specialised"

    def __init__(self, model: Model, signatures: tuple[str, ...], attends: Sequence[Attend]):
        self.signatures = signatures
        self._model = model
        # One kernel per signature. A kernel of several ops (quantized attention) is
        # compiled shapeless: the rows it reads grow by one every step. The dense one
        # is a single fused op already.
        kernels: dict[str, Attend] = {}
        for sig, attend in zip(signatures, attends):
            if sig not in kernels:
                kernels[sig] = attend if attend is dense_attention else _Shapeless(attend)
        self._attends = [kernels[sig] for sig in signatures]
        inner = model.model
        blocks = inner.layers
        self._scales = [block.self_attn.scale for block in blocks]
        # Weights are inputs (inputs=), so a model whose weights are replaced
        # later runs with the new ones; a captured array would be a constant.
        self._segments: list[Callable[..., Any]] = [
            mx.compile(_first_segment(inner, blocks[0]), inputs=[inner.embed_tokens, blocks[0]])
        ]
        for prev, block in zip(blocks, blocks[1:]):
            self._segments.append(mx.compile(_middle_segment(prev, block), inputs=[prev, block]))
        self._segments.append(
            mx.compile(_last_segment(model, blocks[-1]), inputs=[model, blocks[-1]])
        )

    def __call__(self, tokens: mx.array, caches: list[Any]) -> mx.array:
        offset = mx.array(caches[0].offset)
        masks = self._model.model.masks(1, caches)
        h, q, k, v = self._segments[0](tokens, offset)
        last = len(caches) - 1
        for i, (cache, attend, mask) in enumerate(zip(caches, self._attends, masks)):
            keys, values = cache.update_and_fetch(k, v)
            attended = attend(q, keys, values, self._scales[i], mask)
            if i < last:
                h, q, k, v = self._segments[i + 1](h, attended, offset)
        return self._segments[-1](h, attended)  # type: ignore[no-any-return]

    def warm_up(self) -> None:
        """Trace and evaluate every segment once, on zeros and no cache, so a segment
        MLX cannot compile here fails now, before any cache is touched."""
        offset = mx.array(0)
        h, q, _, _ = self._segments[0](mx.zeros((1, 1), mx.uint32), offset)
        outputs = [h]
        for segment in self._segments[1:-1]:
            outputs.extend(segment(h, mx.zeros_like(q), offset))
        outputs.append(self._segments[-1](h, mx.zeros_like(q)))
        mx.eval(outputs)

    def __repr__(self) -> str:
        return f"DecodeStep({', '.join(self.signatures)})"


class _Shapeless:
    """An attention kernel compiled shapeless, or run as it is if MLX cannot compile
    it so (a primitive that infers no shapes: a plug-in family's kernel, say)."""

    def __init__(self, attend: Attend) -> None:
        self._attend = attend
        self._compiled: Attend | None = mx.compile(attend, shapeless=True)

    def __call__(self, queries: mx.array, keys: Any, values: Any, scale: float, mask: Any) -> Any:
        if self._compiled is not None:
            try:
                return self._compiled(queries, keys, values, scale, mask)
            except Exception:  # noqa: BLE001 - tracing is side-effect free: run it eagerly now
                self._compiled = None
        return self._attend(queries, keys, values, scale, mask)


def _first_segment(inner: Any, block: TransformerBlock) -> Callable[..., Any]:
    def segment(tokens: mx.array, offset: mx.array) -> tuple[mx.array, ...]:
        h = inner.embed(tokens)
        return (h, *block.self_attn.project(block.input_layernorm(h), offset))

    return segment


def _middle_segment(prev: TransformerBlock, block: TransformerBlock) -> Callable[..., Any]:
    def segment(h: mx.array, attended: mx.array, offset: mx.array) -> tuple[mx.array, ...]:
        h = prev.finish(h, prev.self_attn.output(attended))
        return (h, *block.self_attn.project(block.input_layernorm(h), offset))

    return segment


def _last_segment(model: Model, block: TransformerBlock) -> Callable[..., Any]:
    def segment(h: mx.array, attended: mx.array) -> mx.array:
        h = block.finish(h, block.self_attn.output(attended))
        return model.logits(model.model.norm(h))

    return segment


def layout_of(caches: Sequence[Any]) -> tuple[tuple[str, ...] | None, str]:
    """``(the per-layer signatures of caches, "")``, or ``(None, why)`` when a step
    cannot be specialised to them (a cache without a signature we know)."""
    signatures = []
    for i, cache in enumerate(caches):
        sig = signature_of(cache)
        if sig is None:
            return None, f"layer {i}: a cache with an unknown signature ({type(cache).__name__})"
        signatures.append(str(sig))
    return tuple(signatures), ""


class DecodeSteps:
    """The decode steps of one model: specialised ones built once per layout.

    Attributes:
        enabled: ``False`` makes every step generic (a switch for comparisons).
        build_after: generic steps with a layout before its specialised step is built.
    """

    def __init__(self, build_after: int = BUILD_AFTER) -> None:
        self.enabled = True
        self.build_after = build_after
        self._built: dict[tuple[str, ...], DecodeStep | GenericStep] = {}
        self._seen: dict[tuple[str, ...], int] = {}

    def step_for(self, model: Model, caches: list[Any]) -> DecodeStep | GenericStep:
        """The step to run for one token over ``caches``: the specialised one for their
        exact signatures, or the generic path (whose ``reason`` says why)."""
        if not self.enabled:
            return GenericStep(model, "specialised steps are disabled")
        if len(caches) != len(model.layers) or not caches:
            return GenericStep(model, "not one cache per layer")
        layout, why = layout_of(caches)
        if layout is None:
            return GenericStep(model, why)
        offset = caches[0].offset
        if any(c.offset != offset for c in caches):
            return GenericStep(model, "the caches disagree on their offset")
        step = self._built.get(layout)
        if step is not None:
            return step
        seen = self._seen.get(layout, 0)
        if seen < self.build_after:
            self._seen[layout] = seen + 1
            return GenericStep(model, f"warming up ({seen + 1} of {self.build_after})")
        step = self._built[layout] = _build(model, layout, caches)
        return step

    def built(self) -> dict[tuple[str, ...], DecodeStep | GenericStep]:
        """The steps built so far, by layout (a generic one where none could be)."""
        return dict(self._built)


def _build(model: Model, layout: tuple[str, ...], caches: list[Any]) -> DecodeStep | GenericStep:
    # The segments cut blocks at their attention: a recurrent layer (issue 16) has
    # none, and a gated attention's output needs its gate carried past the cut.
    for i, block in enumerate(model.model.layers):
        if block.kind != "attention":
            return GenericStep(model, f"layer {i} is a {block.kind} layer, not attention")
        if block.self_attn.gated:
            return GenericStep(model, f"layer {i}'s attention gates its output")
    attends = []
    for i, cache in enumerate(caches):
        try:
            attends.append(attention_for(cache, i))
        except CapabilityError as exc:  # the generic path raises it, with its message
            return GenericStep(model, str(exc))
    step = DecodeStep(model, layout, attends)
    try:
        step.warm_up()
    except Exception as exc:  # noqa: BLE001 - MLX cannot compile it here: the generic path runs
        return GenericStep(model, f"the specialised step failed to compile: {exc}")
    return step
