"""Compile every variant of kvstore's CUDA kernels with NVRTC on a machine without a GPU.

A kernel that does not compile is found on the device, where it costs device time
(and the kernel's user falls back to MLX ops, or to MLX's own compile, without saying
why). This compiles each one as the precompiled route does (``kvstore.cuda_kernel``:
:meth:`Kernel.source_for`, :mod:`kvstore.nvrtc`) for ``sm_90`` (the H100 and H200):
every TurboQuant encode and decode width, head dim, scale mode and dtype, alone and as
a layer's pair, the TurboQuant decode core, the staging transport's kernels and the
row digests. NVRTC comes from the dev extra (``nvidia-cuda-nvrtc-cu12``)::

    .venv/bin/python -m tools.bench.gpu.compile_check [--arch 90]

Prints one line per kernel that fails (with NVRTC's log) and a count. The tests
compile one of each kind (``tests/test_cuda_kernel.py``); this compiles them all
(a few minutes).
"""

from __future__ import annotations

import argparse
from typing import Any

import mlx.core as mx

from kvstore import nvrtc
from kvstore.codecs import cuda
from kvstore.turboquant import cuda_decode, cuda_rht
from kvstore.turboquant.packing import packed_words

#: Each row dtype an encode reads, by its name.
_ROW_TYPES = {cuda_rht._name(dtype): dtype for dtype in cuda_rht._CUDA_TYPES}
U8, U32, U64, F32 = mx.uint8, mx.uint32, mx.uint64, mx.float32


def _encode(configs: tuple[cuda_rht.EncodeConfig, ...]) -> tuple[Any, tuple]:
    ins: list[Any] = []
    outs: list[Any] = []
    for *_, dtype in configs:
        ins += [_ROW_TYPES[dtype], F32, F32, F32]
        outs += [U32, F32, mx.float16]
    return cuda_rht._encode_kernel(configs, 60000.0), (
        tuple(ins),
        (*outs, U8),
        (4,) * len(configs),
    )


def _decode(configs: tuple[cuda_rht.DecodeConfig, ...]) -> tuple[Any, tuple]:
    ins: list[Any] = []
    for _, _, scales, _ in configs:
        ins += [U32, _ROW_TYPES[scales], F32, F32]
    outs = tuple(_ROW_TYPES[out] for *_, out in configs)
    return cuda_rht._decode_kernel(configs), (tuple(ins), outs, (2,) * len(configs))


def kernels(
    widths: tuple[int, ...] = (2, 3, 4, 5), dims: tuple[int, ...] = (32, 64, 128, 256)
) -> list[tuple[Any, tuple]]:
    """``(kernel, signature)`` of every variant kvstore may build (of TurboQuant's, those
    of ``widths`` and head ``dims``): each TurboQuant encode alone, and together with a
    tensor of another scale mode, width and dtype as a layer's keys and values are; the
    decodes likewise; the rest as their callers call them."""
    out = []
    for bits in widths:
        for dim in dims:
            for mode in ("l2", "matched", "ls"):
                for dtype in _ROW_TYPES:
                    out.append(_encode(((bits, dim, mode, dtype),)))
                    values = (max(2, bits - 1), dim, "ls", "bfloat16")
                    out.append(_encode(((bits, dim, mode, dtype), values)))
            for scales in ("float16", "float32"):
                for o in _ROW_TYPES:
                    out.append(_decode(((bits, dim, scales, o),)))
                    other = (max(2, bits - 1), dim, "float16", "bfloat16")
                    out.append(_decode(((bits, dim, scales, o), other)))
            kernel = cuda_decode._kernel(bits, dim, packed_words(dim, bits))
            out.append((kernel, ((U32, F32, F32, U32), (F32,), ())))
    transport = cuda.transport_kernels()
    many = (U8,) * cuda.GATHER_OUTPUTS
    buffers = (U8,) * cuda.ASSEMBLE_INPUTS
    out += [
        (transport["upload"], ((U64,), (U8,), ())),
        (transport["download"], ((U64, U8), (U32,), ())),
        (transport["address"], ((U8,), (U64,), ())),
        (transport["gather"], ((U64,), (U8,), ())),
        (transport["gather_many"], ((U64,), many, ())),
        (transport["assemble"], ((U64, *buffers), (U8,), ())),
        (transport["assemble_many"], ((U64, *buffers), many, ())),
    ]
    from kvstore.bridge import digests

    out.append((digests._build_kernel(), ((U64, U8), (U64,), ())))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, 90: sm_90")
    args = parser.parse_args()
    compiler = nvrtc.compiler()
    if compiler is None:
        print("no NVRTC found: install the dev extra (nvidia-cuda-nvrtc-cu12)")
        return 2
    failed = size = 0
    every = kernels()
    for kernel, signature in every:
        symbol, source = kernel.source_for(signature)
        try:
            size += len(compiler.cubin(source, symbol, args.arch))
        except nvrtc.NvrtcError as exc:
            failed += 1
            print(exc)
    print(
        f"{len(every) - failed} of {len(every)} kernels compile for sm_{args.arch} "
        f"({size / 2**20:.1f} MiB of cubins: what kernel_cache would keep of them all)"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
