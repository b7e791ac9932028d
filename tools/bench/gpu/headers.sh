#!/usr/bin/env bash
# MLX's C++ headers for the device machine: MLX's CUDA JIT compiles its quantized
# matmul kernels from mlx/include (cute/..., cutlass/...), which ../shared/gpu/prepare.sh
# strips from the runtime it stages. Without them the first quantized_matmul fails:
#   Failed to compile kernel: mlx/backend/cuda/device/cute_dequant.cuh: cannot open
#   source file "cute/numeric/numeric_types.hpp"
#
#   bash tools/bench/gpu/headers.sh      # from the project's root, after prepare.sh
#
# Packs mlx/include of the cached mlx-cuda-13 wheel into .gpu/inc/mlxinc.tar.xz (1.7 MB
# for 0.32.4). Carry ".gpu/inc" with ".gpu/b" on the device call; tools/bench/gpu/run.sh
# extracts it beside the installed mlx package (/tmp/site/mlx/include).
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
cache=${KVSTORE_GPU_CACHE:-$HOME/.cache/kvstore-gpu}
MLX=${MLX_VERSION:-0.32.4}
wheel=$(ls "$cache"/whl/mlx_cuda_13-"$MLX"-*.whl 2>/dev/null | head -1 || true)
if [ -z "$wheel" ]; then
  echo "headers.sh: no mlx-cuda-13 $MLX wheel in $cache/whl; run bash ../shared/gpu/prepare.sh first" >&2
  exit 1
fi
mkdir -p .gpu/inc
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && unzip -q "$wheel" 'mlx/include/*' && tar -cJf mlxinc.tar.xz mlx/include)
mv "$tmp/mlxinc.tar.xz" .gpu/inc/mlxinc.tar.xz
git check-ignore -q .gpu/inc/mlxinc.tar.xz || echo "headers.sh: warning: .gpu/ is not ignored here (prepare.sh adds /.gpu/ to .git/info/exclude)" >&2
du -h .gpu/inc/mlxinc.tar.xz
