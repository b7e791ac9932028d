#!/usr/bin/env bash
# The GPU figures on the device machine, in one call.
#
#   bash tools/bench/gpu/run.sh [FIGURES] [OUT_DIR]    # default G1,G2,G3,G4 and $OUT
#
# Run from the checkout whose kvstore/ is measured, after `source .gpu/b/setup.sh`
# (../shared/gpu/README.md: stage1 on a fresh machine first). It checks the CUDA paths
# (tools/bench/gpu/check.py: a line each, never fatal), then runs
# `kvstore bench --only FIGURES --repeats 5`, writing bench-results.json (after every
# figure), the table and the log to OUT_DIR; copy them to tools/bench/results/gpu/ to
# commit. The bench stops itself after BENCH_TIMEOUT seconds (default 540, inside a
# call's 600) so what it measured comes back. Other figures (issue 17's decode figure)
# join by their ids: bash tools/bench/gpu/run.sh G1,G2,G3,G4,G5
#
# MLX's C++ headers: its CUDA JIT compiles the quantized matmul kernels (G2's kv:quant
# policies, G5's quantized layout, check.py's model line) from mlx/include, which
# prepare.sh strips. Pack them here first with `bash tools/bench/gpu/headers.sh` and carry
# [".gpu/b", ".gpu/inc"]: this script extracts .gpu/inc/mlxinc.tar.xz beside the installed
# mlx package. Without them those kernels fail to compile ("cannot open source file
# cute/numeric/numeric_types.hpp") and G5 says so in its row, and MLX's CPU JIT fails
# under the device's g++ 13 (every test that compiles on the CPU stream).
#
#   bash tools/bench/gpu/run.sh tests [OUT_DIR]        # the CUDA tests instead, to tests.txt
set -uo pipefail
figures=${1:-G1,G2,G3,G4}
out=${2:-${OUT:-tools/bench/results/gpu}}
root=$(cd "$(dirname "$0")/../../.." && pwd)
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$out"
cd "$root"
mlx_dir=$(python3 -c "import mlx, os; print(list(mlx.__path__)[0])" 2>/dev/null || true)
if [ -n "$mlx_dir" ] && [ ! -d "$mlx_dir/include/cute" ]; then
  if [ -s .gpu/inc/mlxinc.tar.xz ]; then
    tar -xJf .gpu/inc/mlxinc.tar.xz -C "$(dirname "$mlx_dir")" && echo "run.sh: MLX's headers extracted into $mlx_dir/include"
  else
    echo "run.sh: warning: $mlx_dir/include/cute is missing and .gpu/inc/mlxinc.tar.xz was not carried (tools/bench/gpu/headers.sh): quantized matmul kernels will not compile"
  fi
fi
if [ "$figures" = tests ]; then  # what touches CUDA: pages, staging, joins, checks, pools
  timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider \
    tests/test_codecs/test_cuda_pages.py tests/test_codecs/test_cuda_staging.py \
    tests/test_codecs/test_device_joins.py tests/test_store/test_read_checking.py \
    tests/test_store/test_checks.py tests/test_threads.py > "$out/tests.txt" 2>&1
  status=$?
  tail -3 "$out/tests.txt"
  exit "$status"
fi
timeout "${CHECK_TIMEOUT:-90}" python3 tools/bench/gpu/check.py 2>&1 | tee "$out/gpu-check.txt"
timeout "${BENCH_TIMEOUT:-540}" python3 -m kvstore.cli bench --only "$figures" \
  --repeats "${REPEATS:-5}" --out "$out" > "$out/bench-table.txt" 2> "$out/bench-log.txt"
status=$?
if [ "$status" = 124 ] && [ -s "$out/bench-results.json" ]; then
  echo "run.sh: the bench ran out of time; the figures done, from bench-results.json:"
  python3 -c "import sys; from kvstore.bench.report import format_table; from kvstore.bench.results \
import BenchResults; print(format_table(BenchResults.load(sys.argv[1])))" "$out/bench-results.json" \
    | tee "$out/bench-table.txt"
else
  cat "$out/bench-table.txt"
fi
tail -5 "$out/bench-log.txt"
exit "$status"
