"""MLX CUDA kernels named by what they compile, so a changed kernel is never run stale.

MLX keeps each compiled custom kernel under its name, in the process and on disk
(``$TMPDIR/mlx/<version>/ptx/<name>.ptx``, or ``MLX_PTX_CACHE_DIR``), and loads
what it finds there without looking at the source again. A kernel whose source
changed under the same name -- kvstore upgraded on a machine that ran the old
one, with the same MLX -- would run the old code on the new arguments. Every
kernel kvstore builds is therefore made here, its name followed by a digest of
everything it hands MLX to compile (source, header, argument names).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

__all__ = ["cuda_kernel", "kernel_name"]


def kernel_name(
    name: str,
    input_names: Sequence[str],
    output_names: Sequence[str],
    source: str,
    header: str = "",
) -> str:
    """``name`` and a digest of the kernel's source, header and argument names."""
    text = "\0".join([name, *input_names, "->", *output_names, header, source])
    return f"{name}_{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def cuda_kernel(
    name: str,
    input_names: Sequence[str],
    output_names: Sequence[str],
    source: str,
    header: str = "",
) -> Any:
    """``mx.fast.cuda_kernel`` under :func:`kernel_name` (raises where MLX has no CUDA)."""
    import mlx.core as mx

    return mx.fast.cuda_kernel(
        name=kernel_name(name, input_names, output_names, source, header),
        input_names=list(input_names),
        output_names=list(output_names),
        source=source,
        header=header,
    )
