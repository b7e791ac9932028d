"""Model arguments: one normalised description for every supported architecture.

An mlx-lm ``config.json`` is read by :meth:`ModelArgs.from_config`, which applies
the same defaults mlx-lm's ``models/<arch>.py`` applies, so a config means the
same model here as there. The architectures differ only in switches of this
one dataclass (biases, q/k norms, Gemma's norms and scalings, per-layer
windows), which is what lets one transformer serve them all.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from kvstore.errors import CapabilityError

__all__ = [
    "ModelArgs",
    "NAMED_CONFIGS",
    "SUPPORTED_MODEL_TYPES",
    "named_config",
]


@dataclass(frozen=True)
class ModelArgs:
    """The shape and switches of a decoder; built by :meth:`from_config`.

    ``layer_windows[i]`` is layer ``i``'s sliding window, or ``None`` for a
    full-attention layer.
    """

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_traditional: bool = False
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int | None = None
    tie_word_embeddings: bool = True
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    #: Gemma: norms scale by ``1 + weight``, a second norm pair around attention
    #: and MLP outputs, GELU-tanh gate, embeddings scaled by sqrt(hidden).
    gemma_norms: bool = False
    sandwich_norms: bool = False
    hidden_act: Literal["silu", "gelu_approx"] = "silu"
    scale_embeddings: bool = False
    query_pre_attn_scalar: float | None = None
    #: Rope base of the sliding layers (Gemma's ``rope_local_base_freq``).
    rope_local_theta: float | None = None
    layer_windows: tuple[int | None, ...] = field(default=())

    def __post_init__(self) -> None:
        if len(self.layer_windows) != self.num_hidden_layers:
            object.__setattr__(self, "layer_windows", (None,) * self.num_hidden_layers)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"[ModelArgs] num_attention_heads ({self.num_attention_heads}) must be a "
                f"multiple of num_key_value_heads ({self.num_key_value_heads})."
            )

    @property
    def attention_scale(self) -> float:
        """Softmax scale: ``query_pre_attn_scalar**-0.5`` (Gemma) else ``head_dim**-0.5``."""
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        """Normalise an mlx-lm / Hugging Face ``config.json`` dict.

        Raises:
            CapabilityError: ``model_type`` is missing or not supported; the
                message lists the supported ones.
        """
        model_type = config.get("model_type")
        reader = _READERS.get(model_type)  # type: ignore[arg-type]
        if reader is None:
            raise CapabilityError(
                f"[load_model] model_type {model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}. Use mlx-lm for other "
                f"architectures.",
                found=model_type,
                supported=list(SUPPORTED_MODEL_TYPES),
            )
        return reader(_with_rope_parameters(config))

    def layer_layout(self) -> list[dict[str, Any]]:
        """Per layer: ``{"n_kv_heads", "head_dim", "sliding_window"}`` (window ``None``
        for full attention): the cache geometry, known from the config alone."""
        return [
            {"n_kv_heads": self.num_key_value_heads, "head_dim": self.head_dim, "sliding_window": w}
            for w in self.layer_windows
        ]

    def to_dict(self) -> dict[str, Any]:
        """A plain dict of every field (JSON-friendly: tuples become lists)."""
        out = asdict(self)
        out["layer_windows"] = list(self.layer_windows)
        return out


def _with_rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """transformers >= 5 nests ``rope_theta``/``rope_scaling`` under ``rope_parameters``."""
    params = config.get("rope_parameters")
    # Only the flat form; Gemma's per-layer-type nesting is ignored, as mlx-lm does.
    if not params or "rope_theta" not in params:
        return config
    config = dict(config)
    if config.get("rope_theta") is None and "rope_theta" in params:
        config["rope_theta"] = params["rope_theta"]
    if config.get("rope_scaling") is None:
        config["rope_scaling"] = params
    return config


def _common(c: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    heads = c["num_attention_heads"]
    base = dict(
        model_type=c["model_type"],
        hidden_size=c["hidden_size"],
        num_hidden_layers=c["num_hidden_layers"],
        intermediate_size=c["intermediate_size"],
        num_attention_heads=heads,
        num_key_value_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        vocab_size=c["vocab_size"],
        rms_norm_eps=c["rms_norm_eps"],
        rope_theta=c.get("rope_theta", 10000.0),
        rope_traditional=c.get("rope_traditional", False),
        rope_scaling=c.get("rope_scaling"),
        max_position_embeddings=c.get("max_position_embeddings"),
        tie_word_embeddings=c.get("tie_word_embeddings", True),
    )
    base.update(overrides)
    return base


def _llama(c: dict[str, Any]) -> ModelArgs:
    # mlx-lm maps "mistral" to llama; windows come only from layer_types, as there.
    n = c["num_hidden_layers"]
    types = c.get("layer_types") or ["full_attention"] * n
    windows = tuple(c.get("sliding_window") if t == "sliding_attention" else None for t in types)
    bias = c.get("attention_bias", False)
    return ModelArgs(
        **_common(c, qkv_bias=bias, o_proj_bias=bias, mlp_bias=c.get("mlp_bias", False)),
        layer_windows=windows,
    )


def _qwen2(c: dict[str, Any]) -> ModelArgs:
    # Qwen2 derives head_dim from hidden_size even when the config names one.
    return ModelArgs(
        **_common(
            c,
            head_dim=c["hidden_size"] // c["num_attention_heads"],
            rope_theta=c.get("rope_theta", 1000000.0),
            max_position_embeddings=c.get("max_position_embeddings", 32768),
            qkv_bias=True,
        )
    )


def _qwen3(c: dict[str, Any]) -> ModelArgs:
    if c.get("rope_theta") is None:
        raise CapabilityError(
            "[load_model] qwen3 config has no rope_theta (nor rope_parameters.rope_theta); "
            "add it to config.json.",
            found=None,
        )
    return ModelArgs(**_common(c, head_dim=c["head_dim"], rope_traditional=False, qk_norm=True))


_GEMMA3_DEFAULTS: dict[str, Any] = dict(
    hidden_size=1152,
    num_hidden_layers=26,
    intermediate_size=6912,
    num_attention_heads=4,
    head_dim=256,
    rms_norm_eps=1.0e-6,
    vocab_size=262144,
    num_key_value_heads=1,
    rope_theta=1_000_000.0,
    rope_local_base_freq=10_000.0,
    query_pre_attn_scalar=256,
    sliding_window=512,
    sliding_window_pattern=6,
    max_position_embeddings=32768,
)


def _gemma3_text(c: dict[str, Any]) -> ModelArgs:
    c = {**_GEMMA3_DEFAULTS, **{k: v for k, v in c.items() if v is not None}}
    # mlx-lm: every `pattern`-th layer is global, the others slide (layer_types is ignored).
    pattern = c["sliding_window_pattern"]
    windows = tuple(
        None if i % pattern == pattern - 1 else c["sliding_window"]
        for i in range(c["num_hidden_layers"])
    )
    return ModelArgs(
        **_common(
            c,
            rope_traditional=False,
            qk_norm=True,
            gemma_norms=True,
            sandwich_norms=True,
            hidden_act="gelu_approx",
            scale_embeddings=True,
            query_pre_attn_scalar=c["query_pre_attn_scalar"],
            rope_local_theta=c["rope_local_base_freq"],
        ),
        layer_windows=windows,
    )


_READERS: dict[str, Callable[[dict[str, Any]], ModelArgs]] = {
    "llama": _llama,
    "mistral": _llama,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "gemma3_text": _gemma3_text,
}

#: The ``model_type`` values :meth:`ModelArgs.from_config` reads.
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(_READERS)

_TINY: dict[str, Any] = dict(
    model_type="llama",
    hidden_size=128,
    num_hidden_layers=2,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    rms_norm_eps=1e-5,
    vocab_size=256,
    rope_theta=10000.0,
    tie_word_embeddings=True,
)
_SMALL: dict[str, Any] = dict(
    _TINY,
    hidden_size=512,
    num_hidden_layers=6,
    intermediate_size=1408,
    head_dim=128,
    vocab_size=4096,
    max_position_embeddings=8192,
)


def _gemma3_like(base: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return dict(base, model_type="gemma3_text", rms_norm_eps=1e-6, **changes)


#: Named configs (mlx-lm ``config.json`` dicts). ``tiny*`` are for tests (a
#: forward pass in milliseconds); ``small*`` for demos and benchmarks: ``small``
#: prefills 4096 tokens in ~6 s on this 2-core CPU with OpenBLAS preloaded
#: (~64 s with MLX's bundled BLAS), see ``tools/bench/model_speed.py``. Head dim
#: 128 in ``small*``, so every affine group size (32/64/128) fits.
NAMED_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": _TINY,
    "tiny-qwen3": dict(_TINY, model_type="qwen3", rms_norm_eps=1e-6, max_position_embeddings=4096),
    # 2 of every 3 layers slide over a 32-token window: windows wrap in tests.
    "tiny-gemma3": _gemma3_like(
        _TINY,
        num_hidden_layers=3,
        query_pre_attn_scalar=64,
        sliding_window=32,
        sliding_window_pattern=3,
        max_position_embeddings=4096,
    ),
    "small": _SMALL,
    # Gemma-3-like layout: 5 of every 6 layers slide over a 1024-token window.
    "small-gemma3": _gemma3_like(
        _SMALL,
        num_hidden_layers=12,
        query_pre_attn_scalar=128,
        sliding_window=1024,
        sliding_window_pattern=6,
    ),
}


def named_config(name: str) -> dict[str, Any]:
    """A copy of the named config ``name``.

    Raises:
        ValueError: ``name`` is not one of :data:`NAMED_CONFIGS`.
    """
    try:
        return copy.deepcopy(NAMED_CONFIGS[name])
    except KeyError:
        raise ValueError(
            f"[build_model] Unknown named config {name!r}; known: "
            f"{', '.join(NAMED_CONFIGS)}. Pass a ModelArgs or a config dict for others."
        ) from None
