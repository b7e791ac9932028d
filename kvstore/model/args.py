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
    "LAYER_KINDS",
    "ModelArgs",
    "NAMED_CONFIGS",
    "SUPPORTED_MODEL_TYPES",
    "named_config",
]


#: What a layer's token mixer is: softmax attention over a KV cache, or a
#: Gated-DeltaNet (linear attention with a recurrent state).
LAYER_KINDS = ("attention", "gated-delta")

_HYBRID_DEFAULTS: dict[str, Any] = {
    "attn_output_gate": False,
    "partial_rotary_factor": 1.0,
    "linear_num_key_heads": 0,
    "linear_num_value_heads": 0,
    "linear_key_head_dim": 0,
    "linear_value_head_dim": 0,
    "linear_conv_kernel_dim": 0,
}


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
    #: Per layer: ``"attention"`` or ``"gated-delta"`` (a Gated-DeltaNet layer,
    #: Qwen3.5/Qwen3-Next); empty means every layer attends.
    layer_kinds: tuple[str, ...] = field(default=())
    #: Qwen3-Next/3.5 attention: ``q_proj`` also yields a gate, ``o_proj`` reads
    #: ``output * sigmoid(gate)``.
    attn_output_gate: bool = False
    #: Share of each head's dims that RoPE rotates (Qwen3.5: 0.25).
    partial_rotary_factor: float = 1.0
    #: Gated-DeltaNet geometry (only with ``"gated-delta"`` layers).
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0

    def __post_init__(self) -> None:
        if len(self.layer_windows) != self.num_hidden_layers:
            object.__setattr__(self, "layer_windows", (None,) * self.num_hidden_layers)
        if len(self.layer_kinds) != self.num_hidden_layers:
            object.__setattr__(self, "layer_kinds", ("attention",) * self.num_hidden_layers)
        unknown = sorted(set(self.layer_kinds) - set(LAYER_KINDS))
        if unknown:
            raise ValueError(
                f"[ModelArgs] layer_kinds must each be one of {', '.join(LAYER_KINDS)}; "
                f"received {', '.join(map(repr, unknown))}."
            )
        if "gated-delta" in self.layer_kinds and (
            self.linear_num_value_heads % max(self.linear_num_key_heads, 1)
            or min(
                self.linear_num_key_heads,
                self.linear_key_head_dim,
                self.linear_value_head_dim,
                self.linear_conv_kernel_dim,
            )
            < 1
        ):
            raise ValueError(
                f"[ModelArgs] Gated-DeltaNet layers need positive linear_* sizes with "
                f"linear_num_value_heads a multiple of linear_num_key_heads; received "
                f"{self.linear_num_key_heads} key heads of {self.linear_key_head_dim}, "
                f"{self.linear_num_value_heads} value heads of {self.linear_value_head_dim}, "
                f"conv kernel {self.linear_conv_kernel_dim}."
            )
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

    @property
    def rotary_dims(self) -> int:
        """Dims of each head RoPE rotates."""
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_layout(self) -> list[dict[str, Any]]:
        """Per layer, the cache geometry, known from the config alone: an attention
        layer's ``{"n_kv_heads", "head_dim", "sliding_window"}`` (window ``None``
        for full attention), a Gated-DeltaNet layer's ``{"recurrent":
        "rec:gated-delta", "conv_kernel", "conv_dim", "key_heads", "value_heads",
        "key_head_dim", "value_head_dim"}``."""
        out: list[dict[str, Any]] = []
        for kind, w in zip(self.layer_kinds, self.layer_windows):
            if kind == "gated-delta":
                key_dim = self.linear_num_key_heads * self.linear_key_head_dim
                value_dim = self.linear_num_value_heads * self.linear_value_head_dim
                out.append(
                    {
                        "recurrent": "rec:gated-delta",
                        "conv_kernel": self.linear_conv_kernel_dim,
                        "conv_dim": 2 * key_dim + value_dim,
                        "key_heads": self.linear_num_key_heads,
                        "value_heads": self.linear_num_value_heads,
                        "key_head_dim": self.linear_key_head_dim,
                        "value_head_dim": self.linear_value_head_dim,
                    }
                )
            else:
                out.append(
                    {
                        "n_kv_heads": self.num_key_value_heads,
                        "head_dim": self.head_dim,
                        "sliding_window": w,
                    }
                )
        return out

    def to_dict(self) -> dict[str, Any]:
        """A plain dict of every field (JSON-friendly: tuples become lists). Hybrid-model
        fields at their defaults are left out, so a plain decoder's dict (and the
        fingerprint of a model built from it) is what it was before they existed."""
        out = asdict(self)
        out["layer_windows"] = list(self.layer_windows)
        out["layer_kinds"] = list(self.layer_kinds)
        if all(k == "attention" for k in self.layer_kinds):
            for name, default in _HYBRID_DEFAULTS.items():
                if out.get(name) == default or name == "layer_kinds":
                    out.pop(name, None)
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


_QWEN3_5_DEFAULTS: dict[str, Any] = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    rms_norm_eps=1e-6,
    vocab_size=151936,
    num_key_value_heads=8,
    max_position_embeddings=131072,
    linear_num_value_heads=64,
    linear_num_key_heads=16,
    linear_key_head_dim=192,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    tie_word_embeddings=False,
    attention_bias=False,
    head_dim=None,
    full_attention_interval=4,
    num_experts=0,
)
_QWEN3_5_ROPE: dict[str, Any] = {
    "type": "default",
    "mrope_section": [11, 11, 10],
    "rope_theta": 100000,
    "partial_rotary_factor": 0.25,
}


def _qwen3_5(c: dict[str, Any]) -> ModelArgs:
    """Qwen3.5 (dense): every ``full_attention_interval``-th layer attends (gated
    output, q/k norms, partial RoPE), the others are Gated-DeltaNet layers. The
    text config may be nested under ``text_config`` (Hugging Face) or be the
    whole config (mlx-lm); defaults are mlx-lm's ``qwen3_5.TextModelArgs``."""
    text = c.get("text_config") or c
    t = {**_QWEN3_5_DEFAULTS, **{k: v for k, v in text.items() if v is not None}}
    if t.get("num_experts", 0) > 0:
        raise CapabilityError(
            "[load_model] Qwen3.5 mixture-of-experts checkpoints (num_experts > 0) are not "
            "supported by kvstore.model; load them with mlx-lm (its caches store through "
            "kvstore.mlx_lm).",
            found=t["num_experts"],
        )
    # As mlx-lm: rope_parameters (default-valued when absent) wins over flat rope keys.
    rope = dict(text["rope_parameters"]) if "rope_parameters" in text else dict(_QWEN3_5_ROPE)
    if rope:
        if "type" not in rope and "rope_type" in rope:
            rope["type"] = rope.pop("rope_type")
        partial = rope.get("partial_rotary_factor", 0.25)
        theta = rope.get("rope_theta", 100000.0)
        scaling: dict[str, Any] | None = rope
    else:
        partial = t.get("partial_rotary_factor", 0.25)
        theta = t.get("rope_theta", 100000.0)
        scaling = t.get("rope_scaling")
    n, interval = t["num_hidden_layers"], t["full_attention_interval"]
    heads = t["num_attention_heads"]
    return ModelArgs(
        model_type=c["model_type"],
        hidden_size=t["hidden_size"],
        num_hidden_layers=n,
        intermediate_size=t["intermediate_size"],
        num_attention_heads=heads,
        num_key_value_heads=t["num_key_value_heads"],
        head_dim=t["head_dim"] or t["hidden_size"] // heads,
        vocab_size=t["vocab_size"],
        rms_norm_eps=t["rms_norm_eps"],
        rope_theta=float(theta),
        rope_scaling=scaling,
        max_position_embeddings=t["max_position_embeddings"],
        tie_word_embeddings=t["tie_word_embeddings"],
        qkv_bias=t["attention_bias"],
        o_proj_bias=t["attention_bias"],
        qk_norm=True,
        attn_output_gate=True,
        partial_rotary_factor=float(partial),
        layer_kinds=tuple(
            "attention" if (i + 1) % interval == 0 else "gated-delta" for i in range(n)
        ),
        linear_num_key_heads=t["linear_num_key_heads"],
        linear_num_value_heads=t["linear_num_value_heads"],
        linear_key_head_dim=t["linear_key_head_dim"],
        linear_value_head_dim=t["linear_value_head_dim"],
        linear_conv_kernel_dim=t["linear_conv_kernel_dim"],
    )


_READERS: dict[str, Callable[[dict[str, Any]], ModelArgs]] = {
    "llama": _llama,
    "mistral": _llama,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "gemma3_text": _gemma3_text,
    "qwen3_5": _qwen3_5,
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
    # Qwen3.5-like hybrid: 3 Gated-DeltaNet layers, then one attention layer.
    "tiny-qwen3_5": dict(
        model_type="qwen3_5",
        hidden_size=128,
        num_hidden_layers=4,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        rms_norm_eps=1e-6,
        vocab_size=256,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        full_attention_interval=4,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        rope_parameters={"type": "default", "rope_theta": 100000.0, "partial_rotary_factor": 0.25},
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
