"""TurboQuant-mse v1 (spec ``specs/turboquant.md``): Lloyd-Max codebooks, the
SplitMix64/RHT or dense rotation, MLX-affine-compatible packing, and the
vector quantizer the TurboQuant caches and codec are built on."""

from kvstore.turboquant.codebook import CODEBOOK_ID, Codebook, codebook
from kvstore.turboquant.packing import pack_indices, packed_words, unpack_indices
from kvstore.turboquant.quantizer import (
    DEFAULT_SCALE_MODE,
    SCALE_MODES,
    TQ_BITS,
    TurboQuantizer,
    bits_per_value,
)
from kvstore.turboquant.rotation import Rotation, rotation_for, sign_vector, splitmix64

__all__ = [
    "CODEBOOK_ID",
    "Codebook",
    "codebook",
    "DEFAULT_SCALE_MODE",
    "SCALE_MODES",
    "TQ_BITS",
    "TurboQuantizer",
    "bits_per_value",
    "pack_indices",
    "packed_words",
    "unpack_indices",
    "Rotation",
    "rotation_for",
    "sign_vector",
    "splitmix64",
]
