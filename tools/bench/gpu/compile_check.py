"""Compile kvstore's TurboQuant CUDA kernels with NVRTC on a machine without a GPU.

MLX builds a custom kernel by wrapping its body in a ``__global__`` function whose
parameters are the inputs (with ``<name>_shape`` where the body reads it), then the
outputs, and compiles it with NVRTC at first use; a kernel that does not compile is
found on the device, where it costs device time (and ``cuda_rht`` then falls back
to the ops without saying why). This wraps each body the same way, with a stand-in
for MLX's ``Shape`` and the CUDA headers MLX includes, and compiles every width,
head dim, scale mode and dtype for ``compute_90`` (the H200). NVRTC and the headers
come from NVIDIA's wheels::

    python3 -m pip download --no-deps --only-binary=:all: -d /tmp/nvrtc \\
        nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12
    (cd /tmp/nvrtc && for w in *.whl; do unzip -qo "$w" -d ex; done)
    .venv/bin/python -m tools.bench.gpu.compile_check --root /tmp/nvrtc/ex/nvidia

Prints one line per kernel that fails (with NVRTC's log) and a count.
"""

from __future__ import annotations

import argparse
import ctypes
from pathlib import Path

from kvstore.turboquant import cuda_decode, cuda_rht
from kvstore.turboquant.packing import packed_words

#: What MLX's source has before a kernel's header (its CUDA types), then after it
#: (its namespace, with ``Shape``), as ``mlx/backend/cuda/custom_kernel.cpp`` builds it.
INCLUDES = r"""
#include <cuda_bf16.h>
#include <cuda_fp16.h>
typedef unsigned int uint32_t;
typedef unsigned char uint8_t;
"""
NAMESPACE = r"""
namespace mlx::core::cu {
struct Shape { int v[8]; __device__ int operator[](int i) const { return v[i]; } };
"""


class Nvrtc:
    def __init__(self, root: Path) -> None:
        self.lib = ctypes.CDLL(str(next((root / "cuda_nvrtc" / "lib").glob("libnvrtc.so.*"))))
        self.include = root / "cuda_runtime" / "include"

    def compile(self, name: str, params: str, body: str, arch: str, header: str = "") -> str | None:
        """NVRTC's log if the kernel does not compile, else ``None``."""
        source = (
            f"{INCLUDES}{header}{NAMESPACE}__global__ void {name}(\n{params}) {{\n{body}\n}}\n}}\n"
        )
        prog = ctypes.c_void_p()
        self.lib.nvrtcCreateProgram(
            ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None
        )
        options = [f"--gpu-architecture={arch}".encode(), f"--include-path={self.include}".encode()]
        status = self.lib.nvrtcCompileProgram(
            prog, len(options), (ctypes.c_char_p * len(options))(*options)
        )
        size = ctypes.c_size_t()
        self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        self.lib.nvrtcGetProgramLog(prog, log)
        self.lib.nvrtcDestroyProgram(ctypes.byref(prog))
        return None if status == 0 else log.value.decode()


#: Each row dtype an encode reads, by its name and CUDA type (the kernels' own table).
_ROW_TYPES = {cuda_rht._name(dtype): ctype for dtype, ctype in cuda_rht._CUDA_TYPES.items()}


def encode_kernel(
    configs: tuple[cuda_rht.EncodeConfig, ...], scale_limit: float = 60000.0
) -> tuple[str, str, str, str]:
    """``(name, parameters, body, header)`` of the encode kernel of ``configs``, its
    parameters as MLX declares them."""
    name, inputs, outputs, header, body = cuda_rht.encode_parts(configs, scale_limit)
    params = []
    for s, (_, _, _, dtype) in enumerate(configs):
        x, signs, thresholds, centroids = inputs[4 * s : 4 * s + 4]
        params += [
            f"const {_ROW_TYPES[dtype]}* {x}, const __grid_constant__ Shape {x}_shape, "
            f"const __grid_constant__ int {x}_ndim",
            f"const float* {signs}, const float* {thresholds}, const float* {centroids}",
        ]
    for s in range(len(configs)):
        codes, scale, scale16 = outputs[3 * s : 3 * s + 3]
        params.append(f"uint32_t* {codes}, float* {scale}, __half* {scale16}")
    params.append(f"uint8_t* {outputs[-1]}")
    return name, ", ".join(params), body, header


def decode_kernel(configs: tuple[cuda_rht.DecodeConfig, ...]) -> tuple[str, str, str, str]:
    """``(name, parameters, body, header)`` of the decode kernel of ``configs``."""
    name, inputs, outputs, header, body = cuda_rht.decode_parts(configs)
    params = []
    for s, (_, _, scales, _) in enumerate(configs):
        codes, factors, table, signs = inputs[4 * s : 4 * s + 4]
        params.append(
            f"const uint32_t* {codes}, const __grid_constant__ Shape {codes}_shape, "
            f"const {_ROW_TYPES[scales]}* {factors}, const float* {table}, const float* {signs}"
        )
    for s, (_, _, _, out) in enumerate(configs):
        params.append(f"{_ROW_TYPES[out]}* {outputs[s]}")
    return name, ", ".join(params), body, header


def kernels() -> list[tuple[str, str, str, str]]:
    """``(name, parameters, body, header)`` of every variant kvstore may build: each
    encode alone, and together with a tensor of another scale mode, width and dtype as
    a layer's keys and values are."""
    out = []
    for bits in (2, 3, 4, 5):
        for dim in (32, 64, 128, 256):
            for mode in ("l2", "matched", "ls"):
                for dtype in _ROW_TYPES:
                    out.append(encode_kernel(((bits, dim, mode, dtype),)))
                    values = (max(2, bits - 1), dim, "ls", "bfloat16")
                    out.append(encode_kernel(((bits, dim, mode, dtype), values)))
            for scales in ("float16", "float32"):
                for o in _ROW_TYPES:
                    out.append(decode_kernel(((bits, dim, scales, o),)))
                    # With a tensor of another width, scales and output, as a pair is.
                    other = (max(2, bits - 1), dim, "float16", "bfloat16")
                    out.append(decode_kernel(((bits, dim, scales, o), other)))
            body = cuda_decode.source(bits, dim, packed_words(dim, bits))
            params = (
                "const uint32_t* codes, const float* factors, const float* table, "
                "const uint32_t* count, float* out"
            )
            out.append((f"decode_{bits}_{dim}", params, body, ""))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, required=True, help="the wheels' nvidia/ folder")
    parser.add_argument("--arch", default="compute_90")
    args = parser.parse_args()
    nvrtc = Nvrtc(args.root)
    failed = 0
    every = kernels()
    for name, params, body, header in every:
        log = nvrtc.compile(name, params, body, args.arch, header)
        if log is not None:
            failed += 1
            print(f"{name}: does not compile\n{log}")
    print(f"{len(every) - failed} of {len(every)} kernels compile for {args.arch}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
