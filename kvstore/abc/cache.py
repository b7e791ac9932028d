"""What a KV cache is to the rest of kvstore, and the predicates the model routes on.

Contract for implementers: a cache is mlx-lm compatible (``offset``,
``update_and_fetch(keys, values)``, ``make_mask(N, window_size=, return_array=)``,
``state``/``from_state``, ``is_trimmable()``, ``trim(n)``, ``nbytes``,
``empty()``, ``size()``) and reports ``signature() -> str`` in the grammar of
:mod:`kvstore.signature`, plus ``bytes_per_token()``: the physical bytes one
more token costs (one row of keys and values across heads and batch).

Consumers never ask a cache what it *is* (no ``isinstance``/``hasattr`` on
concrete classes). They ask a predicate named after the decision it supports.
Predicates read the cache's registered :class:`~kvstore.family.Family` (what
the family declared: whether it windows, how attention reads it) and **fail
closed**: an object whose signature is missing, raises, or does not parse, or
whose family holds no attention keys and values, makes every predicate false,
and :func:`signature_of` returns ``None`` for it.

mlx-lm's own cache objects are recognised through :data:`MLX_LM_ALIASES`, an
explicit table keyed by the exact class path, so caches that stock
``mlx_lm.generate`` produced can be persisted too.

A recurrent layer's cache (a family of :data:`~kvstore.family.RECURRENT_STATE`,
issue 16) holds a state at one position, no rows: it keeps ``offset`` (where
the state is; mlx-lm's ``ArraysCache`` keeps none), reports
``bytes_per_token() == 0`` and ``bytes_per_checkpoint()``, and every KV
predicate is false on it. Speculative decoding takes a round's rejected tokens
back through :func:`can_rollback`: a cache that keeps rounds
(:class:`SupportsRounds`: ``begin_round()`` before the verify forward,
``end_round(keep)`` after) or a trimmable one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

from kvstore.errors import CapabilityError
from kvstore.family import Family, Quantization, find_family
from kvstore.signature import UNKNOWN, Signature, parse_signature

T = TypeVar("T")

__all__ = [
    "SupportsTrim",
    "MLX_LM_ALIASES",
    "signature_of",
    "signature_string",
    "family_of",
    "is_plain_kv_cache",
    "is_quantized_kv_cache",
    "is_rotating_plain_cache",
    "is_rotating_quantized_cache",
    "is_turboquant_cache",
    "is_sliding_window_cache",
    "uses_quantized_attention",
    "uses_dense_attention",
    "quantized_attention_params",
    "can_trim",
    "SupportsRounds",
    "is_recurrent_cache",
    "is_gated_delta_cache",
    "records_round",
    "keeps_rounds",
    "can_rollback",
]


@runtime_checkable
class SupportsTrim(Protocol):
    def is_trimmable(self) -> bool: ...

    def trim(self, n: int) -> int: ...


@runtime_checkable
class SupportsRounds(Protocol):
    """A cache that takes back the tokens of a speculative round by snapshot and replay."""

    def begin_round(self) -> None: ...

    def end_round(self, keep: int) -> None: ...


def _mlx_lm_quant(cache: Any) -> str:
    return f"kv:quant:{int(cache.bits)}:{int(cache.group_size)}"


#: mlx-lm cache classes we know, by exact ``module.qualname`` (subclasses are
#: not matched: a subclass may change semantics, so it fails closed).
MLX_LM_ALIASES: dict[str, Callable[[Any], str]] = {
    "mlx_lm.models.cache.KVCache": lambda cache: "kv:plain",
    "mlx_lm.models.cache.QuantizedKVCache": _mlx_lm_quant,
    "mlx_lm.models.cache.RotatingKVCache": lambda cache: "kv:rotating-plain",
    # Any mlx-lm recurrent layer (Mamba, Gated-DeltaNet...): its arrays, as a checkpoint.
    "mlx_lm.models.cache.ArraysCache": lambda cache: f"rec:arrays:{len(cache.cache)}",
}


def _call_signature(cache: Any) -> str:
    return cache.signature()  # type: ignore[no-any-return]


@functools.lru_cache(maxsize=128)
def _reporter_for(cls: type) -> Callable[[Any], str] | None:
    """How instances of ``cls`` report their signature, decided once per class
    (the model asks per layer per step, and a runtime Protocol check is slow)."""
    alias = MLX_LM_ALIASES.get(f"{cls.__module__}.{cls.__qualname__}")
    if alias is not None:
        return alias
    if callable(getattr(cls, "signature", None)):
        return _call_signature
    return None


def signature_of(cache: object) -> Signature | None:
    """The parsed signature of ``cache``, or ``None`` when it has none we know.

    Never raises: a missing, failing or unparsable signature is ``None``.
    """
    return _read(cache, parse_signature, None)


def signature_string(cache: object) -> str:
    """The canonical signature of ``cache``, or ``'unknown'`` (what :func:`signature_of`
    says, as text)."""
    return _read(cache, _canonical, UNKNOWN)


def _read(cache: object, parse: Callable[[str], T], unknown: T) -> T:
    """``parse`` of what ``cache`` reports as its signature; ``unknown`` when it reports
    none, or that fails (fail closed: a broken signature is an unknown one)."""
    try:
        report = _reporter_for(type(cache))  # type: ignore[arg-type]
        return unknown if report is None else parse(report(cache))
    except Exception:
        return unknown


@functools.lru_cache(maxsize=256)
def _canonical(text: str) -> str:
    """The canonical form of signature ``text``. Only parses that succeed are kept (an
    error is raised again next time, when a plug-in may have registered its kind), as in
    :func:`~kvstore.signature.parse_signature`'s own cache. A save asks it of every layer:
    24 plain caches 19 -> 6 us on the CI VM, of a ~50 us warm re-save of a stored prefix."""
    return str(parse_signature(text))


def family_of(cache: object) -> Family | None:
    """The registered family of ``cache``'s signature, or ``None``. Never raises."""
    sig = signature_of(cache)
    return None if sig is None else find_family(sig.kind)


def _kv_family(cache: object) -> Family | None:
    """The family of a cache of attention keys and values; ``None`` for anything else."""
    family = family_of(cache)
    return family if family is not None and family.holds_kv else None


def _is(cache: object, growing_kind: str, windowed: bool) -> bool:
    # The built-in families' own predicates: each names its family by its growing kind;
    # whether a kind windows it is the windowed family's declaration, read here.
    family = _kv_family(cache)
    return (
        family is not None and family.growing_kind == growing_kind and family.windowed == windowed
    )


def is_plain_kv_cache(cache: object) -> bool:
    """Raw rows that grow without bound (``kv:plain``)."""
    return _is(cache, "kv:plain", windowed=False)


def is_quantized_kv_cache(cache: object) -> bool:
    """MLX affine rows that grow without bound (``kv:quant``)."""
    return _is(cache, "kv:quant", windowed=False)


def is_rotating_plain_cache(cache: object) -> bool:
    """A sliding-window ring of raw rows (``kv:rotating-plain``)."""
    return _is(cache, "kv:plain", windowed=True)


def is_rotating_quantized_cache(cache: object) -> bool:
    """A sliding-window ring of affine rows (``kv:rotating-quant``)."""
    return _is(cache, "kv:quant", windowed=True)


def is_turboquant_cache(cache: object) -> bool:
    """TurboQuant-encoded rows, growing or windowed; fetch returns decoded rows."""
    family = _kv_family(cache)
    return family is not None and family.growing_kind == "kv:turboquant"


def is_sliding_window_cache(cache: object) -> bool:
    """A cache that keeps only a window (plus ``keep`` sink tokens): its family
    declares which growing family it keeps a window of."""
    family = _kv_family(cache)
    return family is not None and family.windowed


def uses_quantized_attention(cache: object) -> bool:
    """``update_and_fetch`` returns packed rows for ``mx.quantized_matmul`` attention
    (the family declares a :class:`~kvstore.family.QuantizedAttention`)."""
    family = _kv_family(cache)
    return family is not None and family.attention != "dense"


def uses_dense_attention(cache: object) -> bool:
    """``update_and_fetch`` returns dense key/value arrays for ``scaled_dot_product_attention``."""
    family = _kv_family(cache)
    return family is not None and family.attention == "dense"


def quantized_attention_params(cache: object) -> Quantization:
    """``(mode, bits, group_size)`` of a cache whose attention is quantized: what
    ``mx.quantized_matmul`` needs, from its family and signature.

    Raises:
        CapabilityError: ``cache`` does not use quantized attention.
    """
    sig = signature_of(cache)
    family = _kv_family(cache)
    quantization = None if sig is None or family is None else family.quantization(sig)
    if quantization is None:
        found = UNKNOWN if sig is None else str(sig)
        raise CapabilityError(
            f"[quantized_attention_params] Only caches with quantized attention have a "
            f"mode, bits and group size; received a cache with signature '{found}'.",
            signature=found,
        )
    return quantization


def can_trim(cache: object) -> bool:
    """True if ``cache`` can drop its newest tokens now (rotating caches lose this once full)."""
    if signature_of(cache) is None or not isinstance(cache, SupportsTrim):
        return False
    try:
        return bool(cache.is_trimmable())
    except Exception:
        return False


def _recurrent_family(cache: object) -> Family | None:
    """The family of a cache of recurrent state; ``None`` for anything else."""
    family = family_of(cache)
    return family if family is not None and family.holds_recurrent_state else None


def is_recurrent_cache(cache: object) -> bool:
    """A cache holding a recurrent layer's state (a checkpoint at one position), not
    KV rows: its family declares :data:`~kvstore.family.RECURRENT_STATE`.

    Every KV predicate above is false for it; ``bytes_per_token()`` is 0.
    """
    return _recurrent_family(cache) is not None


def is_gated_delta_cache(cache: object) -> bool:
    """The conv window and state of a Gated-DeltaNet layer (``rec:gated-delta``)."""
    family = _recurrent_family(cache)
    return family is not None and family.kind == "rec:gated-delta"


def records_round(cache: object) -> bool:
    """A speculative round is open on ``cache`` and it replays: the layer hands it
    its step inputs (``record_round``)."""
    return is_gated_delta_cache(cache) and bool(getattr(cache, "in_round", False))


def keeps_rounds(cache: object) -> bool:
    """``cache`` opens and ends speculative rounds itself (``begin_round``/``end_round``);
    a trimmable cache without them is rolled back with ``trim``."""
    return signature_of(cache) is not None and isinstance(cache, SupportsRounds)


def can_rollback(cache: object) -> bool:
    """True if the newest tokens of a speculative round can be taken back from ``cache``.

    A KV cache that can trim now trims; a recurrent cache that keeps rounds
    restores its pre-round state and replays the tokens kept. A sliding
    window past its window rolls back too: a multi-token forward leaves the
    new rows at the end of its buffer, in order.
    """
    return keeps_rounds(cache) or can_trim(cache)
