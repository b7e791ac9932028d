"""The bridge between a model and a prefix store.

:mod:`.fingerprint` and :mod:`.namespace` name a model's namespace (what it is
and what its caches hold); :mod:`.capture` keeps the blocks a sliding window is
about to forget during prefill; :mod:`.session` is one generation's use of a
store (restore before prefill, capture during, save after); :mod:`.generate` is
the reference model's generation with a store.
"""

from kvstore.bridge.fingerprint import model_fingerprint, namespace_for
from kvstore.bridge.generate import generate, generate_tokens
from kvstore.bridge.namespace import namespace_for_model
from kvstore.bridge.session import StoreSession

__all__ = [
    "generate",
    "generate_tokens",
    "model_fingerprint",
    "namespace_for",
    "namespace_for_model",
    "StoreSession",
]
