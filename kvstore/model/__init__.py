"""The reference model: a decoder that consumes caches only through capability predicates.

Build one with seeded weights (:func:`build_model`) or load an mlx-lm model
directory (:func:`load_model`); make its caches from a :class:`CachePolicy`
(:meth:`Model.make_cache`); stream tokens with :func:`generate` (with a prefix store:
:func:`kvstore.bridge.generate`).

Architectures: Llama/Mistral (GQA, RoPE with llama3/yarn/linear scaling),
Qwen2 (qkv bias), Qwen3 (q/k RMSNorm), Gemma 3 text (sliding-window layers
interleaved with global ones), Qwen3.5 dense (Gated-DeltaNet layers with a
recurrent ``rec:gated-delta`` state between gated attention layers).
"""

from kvstore.model.args import NAMED_CONFIGS, SUPPORTED_MODEL_TYPES, ModelArgs
from kvstore.model.generate import (
    GeneratedToken,
    GenerationHooks,
    GenerationStats,
    generate,
    generate_tokens,
    prefill,
    prefill_chunks,
)
from kvstore.model.loader import load_model
from kvstore.model.policy import CachePolicy, make_caches
from kvstore.model.sampling import PenalisedSampler, Sampler, greedy, make_sampler
from kvstore.model.tokenizer import Tokenizer
from kvstore.model.transformer import Model, build_model

__all__ = [
    "Model",
    "ModelArgs",
    "CachePolicy",
    "GeneratedToken",
    "GenerationHooks",
    "GenerationStats",
    "Sampler",
    "Tokenizer",
    "NAMED_CONFIGS",
    "SUPPORTED_MODEL_TYPES",
    "build_model",
    "load_model",
    "make_caches",
    "make_sampler",
    "PenalisedSampler",
    "greedy",
    "generate",
    "generate_tokens",
    "prefill",
    "prefill_chunks",
]
