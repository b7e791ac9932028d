"""Moving tensors between MLX and numpy without hidden copies.

numpy has no bfloat16, so bfloat16 travels as its raw 16-bit words: a numpy
``uint16`` array whose dtype carries ``metadata={"dtype": "bfloat16"}``
(:data:`BFLOAT16_WORDS`). The tag survives slicing and reshaping, so a view
cut from a record still knows what it is, and :func:`as_mlx` turns it back
into ``mx.bfloat16`` with one copy and a free reinterpretation.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import mlx.core as mx
import numpy as np

__all__ = [
    "BFLOAT16_WORDS",
    "DTYPES",
    "MLX_DTYPES",
    "dtype_name",
    "numpy_dtype",
    "as_mlx",
    "as_numpy",
    "as_numpy_all",
    "byte_view",
    "contiguous_chunks",
    "owned_array",
    "owned_arrays",
    "owned_views",
    "word_dtype",
]

#: numpy's stand-in for bfloat16: the raw words, tagged.
BFLOAT16_WORDS = np.dtype(np.uint16, metadata={"dtype": "bfloat16"})

#: Every dtype a snapshot tensor may have, by name -> MLX dtype.
MLX_DTYPES: dict[str, mx.Dtype] = {
    "bool": mx.bool_,
    "uint8": mx.uint8,
    "uint16": mx.uint16,
    "uint32": mx.uint32,
    "uint64": mx.uint64,
    "int8": mx.int8,
    "int16": mx.int16,
    "int32": mx.int32,
    "int64": mx.int64,
    "float16": mx.float16,
    "bfloat16": mx.bfloat16,
    "float32": mx.float32,
}

#: Name -> numpy dtype used for views (bfloat16 as tagged words).
DTYPES: dict[str, np.dtype] = {
    name: (BFLOAT16_WORDS if name == "bfloat16" else np.dtype(name)) for name in MLX_DTYPES
}

_NAME_OF_MLX = {dtype: name for name, dtype in MLX_DTYPES.items()}
_NAME_OF_NUMPY = {np.dtype(name): name for name in MLX_DTYPES if name != "bfloat16"}

# At most this many contiguous pieces per tensor before a strided one is
# compacted first (thousands of tiny writes cost more than one copy).
_MAX_CHUNKS = 4096


def dtype_name(array: Any) -> str:
    """The dtype name of an ``mx.array`` or numpy array (tagged words -> ``bfloat16``).

    Raises:
        TypeError: not an array, or a dtype snapshots do not carry.
    """
    if isinstance(array, mx.array):
        name = _NAME_OF_MLX.get(array.dtype)
    elif isinstance(array, np.ndarray):
        dtype = array.dtype
        # Tagged words first: dtype equality (and so the table) ignores the tag.
        # The table spares numpy's ``dtype.name``, slow enough to show on every restore.
        tag = dtype.metadata.get("dtype") if dtype.metadata else None
        name = tag or _NAME_OF_NUMPY.get(dtype) or dtype.name
    else:
        raise TypeError(
            f"[codecs] A snapshot tensor must be an mx.array or a numpy array; "
            f"received {type(array).__name__}."
        )
    if name not in MLX_DTYPES:
        raise TypeError(
            f"[codecs] Snapshot tensors may have dtype {', '.join(MLX_DTYPES)}; "
            f"received {getattr(array, 'dtype', name)}."
        )
    return name


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype that views tensors of dtype ``name``."""
    return DTYPES[name]


def as_mlx(array: Any) -> mx.array:
    """``array`` as an ``mx.array``: itself if it is one, else one copy of the numpy data."""
    if isinstance(array, mx.array):
        return array
    name = dtype_name(array)
    out = mx.array(array)
    return out.view(mx.bfloat16) if name == "bfloat16" else out


def as_numpy(array: Any) -> np.ndarray:
    """A numpy view of ``array`` (no copy; strides kept; bfloat16 as tagged words).

    Evaluates a lazy ``mx.array`` first.
    """
    return as_numpy_all([array])[0]


def byte_view(array: mx.array) -> mx.array:
    """An MLX array's bytes, in C order, as one flat ``uint8`` array: free for a
    contiguous array, a copy (by the reshape) for a strided view."""
    return array.reshape(-1).view(mx.uint8)


def as_numpy_all(arrays: Sequence[Any]) -> list[np.ndarray]:
    """:func:`as_numpy` of each of ``arrays``, evaluating the MLX ones in one go
    (an evaluation per array is a round trip to MLX's worker thread)."""
    ready = [
        a.view(mx.uint16) if isinstance(a, mx.array) and a.dtype == mx.bfloat16 else a
        for a in arrays
    ]
    lazy = [a for a in ready if isinstance(a, mx.array)]
    if lazy:  # host pieces only: MLX is not asked (several threads write at once)
        mx.eval(lazy)
    out = []
    for original, array in zip(arrays, ready, strict=True):
        if isinstance(array, np.ndarray):
            out.append(array)
            continue
        dtype_name(array)  # a dtype snapshots do not carry raises here
        view = np.asarray(array)
        out.append(view.view(BFLOAT16_WORDS) if array is not original else view)
    return out


def contiguous_chunks(array: np.ndarray) -> Iterator[memoryview]:
    """Byte views that, concatenated, are ``array`` in C order.

    A strided view (a token range cut from a cache buffer) is walked along its
    leading axes until the trailing block is contiguous, so no copy is made.
    """
    if array.size == 0:
        return
    if array.flags.c_contiguous:
        yield _bytes(array)
        return
    lead = _contiguous_split(array)
    if lead is None or int(np.prod(array.shape[:lead])) > _MAX_CHUNKS:
        yield _bytes(np.ascontiguousarray(array))
        return
    for index in np.ndindex(*array.shape[:lead]):
        yield _bytes(array[index])


def _bytes(array: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array, as a flat view."""
    return array.view(np.uint8).reshape(-1).data


def _contiguous_split(array: np.ndarray) -> int | None:
    """The fewest leading axes after which every sub-array is C-contiguous."""
    expected = array.itemsize
    for axis in range(array.ndim - 1, -1, -1):
        if array.shape[axis] != 1 and array.strides[axis] != expected:
            return axis + 1 if axis + 1 < array.ndim else None
        expected *= array.shape[axis]
    return 0


def owned_arrays(specs: Sequence[tuple[tuple[int, ...], str]]) -> list[tuple[mx.array, np.ndarray]]:
    """Fresh, evaluated MLX arrays of the given ``(shape, dtype name)``, zero-filled,
    each with a writable numpy view of its memory: fill the view, and the array
    holds what was written. All are allocated in one evaluation.

    This is MLX's documented NumPy interop ("writing to the view is reflected in the
    original array", usage/numpy in the MLX docs). It is safe here because each array
    is new (no other array shares its buffer), already evaluated (MLX will not run
    its fill again) and nothing reads it before the caller is done writing. It is
    how a restore copies rows from store pages into MLX memory exactly once: MLX has
    no uninitialised allocation, and building from numpy pieces would copy twice.
    bfloat16 arrays are allocated as their 16-bit words and handed out as a
    bfloat16 view of them (numpy has no bfloat16; the view shares the buffer).
    """
    return owned_views([mx.zeros(shape, word_dtype(name)) for shape, name in specs], specs)


def word_dtype(name: str) -> mx.Dtype:
    """The MLX dtype an array of dtype ``name`` is allocated as, for a numpy view of it:
    itself, or words of its width where numpy lacks it (bfloat16)."""
    return _WORDS.get(name, MLX_DTYPES[name])


def owned_views(
    words: Sequence[mx.array], specs: Sequence[tuple[tuple[int, ...], str]]
) -> list[tuple[mx.array, np.ndarray]]:
    """New arrays ``words`` (of :func:`word_dtype`, no other array sharing their memory)
    as the arrays of ``specs``, each with a writable numpy view of its memory, all
    evaluated (see :func:`owned_arrays`)."""
    arrays = [
        w.view(MLX_DTYPES[name]) if name in _WORDS else w
        for w, (_, name) in zip(words, specs, strict=True)
    ]
    mx.eval(words, arrays)
    out = []
    for w, array in zip(words, arrays, strict=True):
        view = np.asarray(w)
        if not (view.flags.writeable and view.flags.c_contiguous):  # pragma: no cover
            raise RuntimeError("[owned_arrays] MLX did not expose a writable contiguous buffer.")
        out.append((array, view))
    return out


def owned_array(shape: tuple[int, ...], name: str) -> tuple[mx.array, np.ndarray]:
    """One array of :func:`owned_arrays`."""
    return owned_arrays([(shape, name)])[0]


#: Dtypes numpy lacks, allocated as words of the same width.
_WORDS = {"bfloat16": mx.uint16}
