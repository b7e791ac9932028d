"""kvstore's CUDA kernels: compiled once per machine, named by what they compile.

Every kernel kvstore runs on a CUDA GPU is made here (:func:`cuda_kernel`, called as
``mx.fast.cuda_kernel``'s kernels are). Two routes:

* **Precompiled** (the default, :data:`PRECOMPILED`): the kernel's whole source is
  written here -- its body and header as MLX would wrap them, with only the CUDA
  headers it uses -- compiled by NVRTC (:mod:`kvstore.nvrtc`) for the device's
  architecture, kept on disk (:mod:`kvstore.kernel_cache`) and launched with
  ``mx.fast.precompiled_cuda_kernel``. MLX compiles a ``cuda_kernel`` in every
  process, with all its device headers, and keeps it in that process only: on one
  H100 the staging kernels' first uses took 1.5-2.3 s each, in a second process as
  in the first (``tools/bench/results/gpu/``).
* **MLX's** (``mx.fast.cuda_kernel``): where there is no NVRTC, the device's
  architecture is one NVRTC does not know, the body reads what the precompiled
  route does not pass (``<input>_strides``), or the source does not compile here
  (logged: a kernel MLX can build still runs).

A kernel's body may read ``<input>_shape[i]`` and ``<input>_ndim`` as with MLX: the
precompiled route passes them as ``int`` arguments after the outputs and rebuilds the
array at the top of the body.

Names: MLX keeps a compiled kernel under its name for the process and would run an
old one under a reused name, so each is named with a digest of everything it
compiles (:func:`kernel_name`).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Sequence
from typing import Any

from kvstore.knobs import switch_from_env

__all__ = ["PRECOMPILED", "Kernel", "cuda_kernel", "kernel_name", "kernel_source"]

log = logging.getLogger("kvstore.cuda")

#: The switch (on unless ``"0"``) of the precompiled route; off, every kernel is MLX's.
PRECOMPILED = "KVSTORE_CUDA_PRECOMPILED"

#: The integer types MLX's device headers give a kernel (NVRTC has no <cstdint>).
_PRELUDE = """\
typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long long int64_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
"""
_FLOAT16_HEADERS = "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n"


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


def kernel_source(
    symbol: str,
    inputs: Sequence[tuple[str, str, int | None, bool]],
    outputs: Sequence[tuple[str, str]],
    body: str,
    header: str = "",
) -> str:
    """The whole CUDA source of the precompiled route's kernel ``symbol``: ``inputs``
    as ``(name, CUDA type, ndim if the body reads its shape else None, whether it reads
    its ndim)``, ``outputs`` as ``(name, CUDA type)``. Parameters: the inputs'
    pointers, the outputs', then each shape read (its ``ndim`` ints) and each ndim read
    (one int), in the inputs' order -- what :class:`Kernel` passes as scalars."""
    params = [f"const {ctype}* {name}" for name, ctype, _, _ in inputs]
    params += [f"{ctype}* {name}" for name, ctype in outputs]
    prologue = []
    for name, _, ndim, _ in inputs:
        if ndim is not None:
            dims = [f"{name}_shape_{i}" for i in range(ndim)]
            params += [f"int {d}" for d in dims]
            values = ", ".join(dims) or "0"
            prologue.append(f"const int {name}_shape[{max(ndim, 1)}] = {{{values}}};")
    for name, _, _, reads_ndim in inputs:
        if reads_ndim:
            params.append(f"int {name}_ndim")
    text = header + body + "".join(c for _, c, _, _ in inputs) + "".join(c for _, c in outputs)
    includes = _FLOAT16_HEADERS if ("half" in text or "bfloat16" in text) else ""
    joined = ",\n    ".join(params)
    lines = "\n    ".join(prologue)
    return (
        f"{includes}{_PRELUDE}{header}\n"
        f'extern "C" __global__ void {symbol}(\n    {joined}) {{\n    {lines}\n{body}\n}}\n'
    )


def _cuda_types() -> dict[Any, str]:
    import mlx.core as mx

    return {
        mx.bool_: "bool",
        mx.uint8: "uint8_t",
        mx.uint16: "uint16_t",
        mx.uint32: "uint32_t",
        mx.uint64: "uint64_t",
        mx.int8: "int8_t",
        mx.int16: "int16_t",
        mx.int32: "int32_t",
        mx.int64: "int64_t",
        mx.float16: "__half",
        mx.bfloat16: "__nv_bfloat16",
        mx.float32: "float",
        mx.float64: "double",
    }


#: What a kernel's arguments were built for: input dtypes, output dtypes, and the ndim
#: of each input whose shape the body reads.
_Signature = tuple[tuple[Any, ...], tuple[Any, ...], tuple[int, ...]]
_NOT_BUILT = object()


class Kernel:
    """One kernel, called as an ``mx.fast.cuda_kernel`` kernel is (``inputs``,
    ``output_shapes``, ``output_dtypes``, ``grid``, ``threadgroup``). Built per
    signature at its first call, on the precompiled route where it can be."""

    def __init__(
        self,
        name: str,
        input_names: Sequence[str],
        output_names: Sequence[str],
        source: str,
        header: str = "",
    ) -> None:
        self.name = kernel_name(name, input_names, output_names, source, header)
        self._input_names = list(input_names)
        self._output_names = list(output_names)
        self._body = source
        self._header = header
        self._shaped = [i for i, n in enumerate(input_names) if f"{n}_shape" in source]
        self._ndims = [i for i, n in enumerate(input_names) if f"{n}_ndim" in source]
        self._strided = any(f"{n}_strides" in source for n in input_names)
        self._built: dict[_Signature, Any] = {}
        self._mlx: Any = None
        self._lock = threading.Lock()

    def __call__(
        self,
        *,
        inputs: Sequence[Any],
        output_shapes: Sequence[tuple[int, ...]],
        output_dtypes: Sequence[Any],
        grid: tuple[int, int, int],
        threadgroup: tuple[int, int, int],
    ) -> list[Any]:
        import mlx.core as mx

        signature = (
            tuple(a.dtype for a in inputs),
            tuple(output_dtypes),
            tuple(inputs[i].ndim for i in self._shaped),
        )
        built = self._built.get(signature, _NOT_BUILT)
        if built is _NOT_BUILT:
            built = self._build(signature)
        if built is None:
            return self._mlx_kernel()(
                inputs=inputs,
                output_shapes=output_shapes,
                output_dtypes=output_dtypes,
                grid=grid,
                threadgroup=threadgroup,
            )
        symbol, cubin = built
        scalars: list[int] = []
        for i in self._shaped:
            scalars.extend(inputs[i].shape)
        for i in self._ndims:
            scalars.append(inputs[i].ndim)
        return mx.fast.precompiled_cuda_kernel(
            name=symbol,
            compiled_source=cubin,
            inputs=inputs,
            output_shapes=output_shapes,
            output_dtypes=output_dtypes,
            scalars=scalars,
            grid=grid,
            threadgroup=threadgroup,
            ensure_row_contiguous=True,  # as mx.fast.cuda_kernel's kernels do by default
        )

    def source_for(self, signature: _Signature) -> tuple[str, str]:
        """``(symbol, whole source)`` of the precompiled route for ``signature``
        (``KeyError`` for a dtype without a CUDA type here)."""
        types = _cuda_types()
        in_dtypes, out_dtypes, ndims = signature
        shape_ndim = dict(zip(self._shaped, ndims, strict=True))
        tag = "|".join(map(str, (*in_dtypes, "->", *out_dtypes, *ndims)))
        symbol = f"{self.name}_{hashlib.sha256(tag.encode()).hexdigest()[:8]}"
        inputs = [
            (n, types[d], shape_ndim.get(i), i in self._ndims)
            for i, (n, d) in enumerate(zip(self._input_names, in_dtypes, strict=True))
        ]
        outputs = [(n, types[d]) for n, d in zip(self._output_names, out_dtypes, strict=True)]
        return symbol, kernel_source(symbol, inputs, outputs, self._body, self._header)

    def _build(self, signature: _Signature) -> tuple[str, bytes] | None:
        from kvstore import kernel_cache, nvrtc

        with self._lock:
            built = self._built.get(signature, _NOT_BUILT)
            if built is not _NOT_BUILT:
                return built  # type: ignore[no-any-return]
            built = None
            compiler = nvrtc.compiler() if switch_from_env(PRECOMPILED) else None
            if compiler is not None and not self._strided:
                try:
                    arch = nvrtc.device_architecture()
                    if arch in compiler.architectures:
                        symbol, source = self.source_for(signature)
                        key = kernel_cache.kernel_key(source, arch, compiler.version)
                        cubin = kernel_cache.cached_cubin(
                            key, lambda: compiler.cubin(source, symbol, arch)
                        )
                        built = (symbol, cubin)
                except (nvrtc.NvrtcError, OSError, RuntimeError, KeyError) as exc:
                    log.warning("kvstore: %s is left to MLX to compile (%s)", self.name, exc)
            self._built[signature] = built
            return built

    def _mlx_kernel(self) -> Any:
        if self._mlx is None:
            import mlx.core as mx

            self._mlx = mx.fast.cuda_kernel(
                name=self.name,
                input_names=self._input_names,
                output_names=self._output_names,
                source=self._body,
                header=self._header,
            )
        return self._mlx


def cuda_kernel(
    name: str,
    input_names: Sequence[str],
    output_names: Sequence[str],
    source: str,
    header: str = "",
) -> Kernel:
    """The :class:`Kernel` of this body and header (raises nothing until it is called;
    a call where MLX has no CUDA raises as MLX does)."""
    return Kernel(name, input_names, output_names, source, header)
