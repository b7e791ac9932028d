#!/usr/bin/env bash
# Several next.sh steps in one device call, each into $OUT/STEP:
#
#   git rev-parse --short HEAD > .gpu/b/rev          # here, after committing
#   device call: carry [".gpu/b", ".gpu/inc"], command `bash tools/bench/gpu/steps.sh STEP...`
#
# Sets up MLX (.gpu/b/setup.sh: stage 1 must have run on this machine), extracts MLX's
# headers from .gpu/inc (tools/bench/gpu/headers.sh) where they are missing, and passes
# the revision measured (.gpu/b/rev: the device's copy has no .git) to every step.
set -uo pipefail
cd "$(dirname "$0")/../../.."
source .gpu/b/setup.sh >/dev/null 2>&1 || { echo "steps.sh: .gpu/b/setup.sh failed (stage 1 not run here?)" >&2; exit 3; }
mlx_dir=$(python3 -c "import mlx; print(list(mlx.__path__)[0])" 2>/dev/null)
if [ -n "$mlx_dir" ] && [ ! -d "$mlx_dir/include/cute" ] && [ -s .gpu/inc/mlxinc.tar.xz ]; then
  tar -xJf .gpu/inc/mlxinc.tar.xz -C "$(dirname "$mlx_dir")"
fi
KVSTORE_BENCH_GIT=$(cat .gpu/b/rev 2>/dev/null || echo unknown)
export KVSTORE_BENCH_GIT
nvidia-smi --query-gpu=name --format=csv,noheader
for step in "$@"; do
  mkdir -p "$OUT/$step"
  echo "##### $step $(date +%T) at $KVSTORE_BENCH_GIT"
  bash tools/bench/gpu/next.sh "$step" "$OUT/$step"
done
echo "##### done $(date +%T)"
