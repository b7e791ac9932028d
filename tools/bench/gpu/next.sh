#!/usr/bin/env bash
# Issue 13's open GPU measurements, in the order the next device session should take
# them (each step fits one call; run after stage 1, carry [".gpu/b", ".gpu/inc"]):
#
#   source .gpu/b/setup.sh >/dev/null 2>&1; KVSTORE_BENCH_GIT=<rev> bash tools/bench/gpu/next.sh STEP $OUT
#
# STEP profiles  the restore phase by phase, lossless and every lossy policy: ~180 s
# STEP ab        lossless under each data-path setting (gather group, device copies,
#                register threads), lossy with copies off and on; best -> .gpu/best.env
# STEP g1-4k     G1 at 4096 tokens: ~150 s
# STEP g1-16k    G1 at 16384 tokens: ~230 s
# STEP g2a       G2 at 4096 tokens, lossless + kv:quant:8:64 and 4:64: ~330 s
# STEP g2b       the same with kv:turboquant:4:4 and 3:3 (G2 whole, 30 sessions of ~18 s,
#                outlasts one call): ~330 s
#
# Results under OUT; copy them to tools/bench/results/gpu/<rev>/ to commit.
set -uo pipefail
step=${1:?step}
out=${2:-${OUT:?OUT}}
rev=${KVSTORE_BENCH_GIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}  # no .git there: pass it
cd "$(dirname "$0")/../../.."
profile="python3 tools/bench/gpu/restore_profile.py --repeats 3"
case "$step" in
  profiles)
    timeout 300 $profile --policies lossless,kv:quant:8:64,kv:quant:4:64,kv:turboquant:4:4,kv:turboquant:3:3 \
      2>&1 | tee "$out/restore-profiles.txt" ;;
  g1-4k)
    KVSTORE_BENCH_GPU_TOKENS=4096 KVSTORE_BENCH_GIT=$rev CHECK_TIMEOUT=60 BENCH_TIMEOUT=400 \
      REPEATS=5 bash tools/bench/gpu/run.sh G1 "$out/g1-4k" ;;
  g1-16k)
    KVSTORE_BENCH_GPU_TOKENS=16384 KVSTORE_BENCH_GIT=$rev CHECK_TIMEOUT=1 BENCH_TIMEOUT=520 \
      REPEATS=5 bash tools/bench/gpu/run.sh G1 "$out/g1-16k" ;;
  g2a|g2b)
    [ "$step" = g2a ] && policies=kv:quant:8:64,kv:quant:4:64 || policies=kv:turboquant:4:4,kv:turboquant:3:3
    KVSTORE_BENCH_G2_POLICIES=$policies KVSTORE_BENCH_GPU_TOKENS=4096 KVSTORE_BENCH_GIT=$rev \
      CHECK_TIMEOUT=1 BENCH_TIMEOUT=540 REPEATS=5 bash tools/bench/gpu/run.sh G2 "$out/$step" ;;
  ab)
    # The lossless restore under each data-path setting, then the lossy ones with and
    # without device copies; the fastest lossless setting goes to .gpu/best.env for the
    # steps after it (source it before them).
    : > "$out/ab.txt"
    best=""; best_ms=999999
    for knobs in "KVSTORE_CUDA_GATHER_GROUP=1 KVSTORE_CUDA_PAGES_COPY=0" \
                 "KVSTORE_CUDA_GATHER_GROUP=8 KVSTORE_CUDA_PAGES_COPY=0" \
                 "KVSTORE_CUDA_GATHER_GROUP=8 KVSTORE_CUDA_PAGES_COPY=1" \
                 "KVSTORE_CUDA_GATHER_GROUP=8 KVSTORE_CUDA_PAGES_COPY=1 KVSTORE_CUDA_REGISTER_THREADS=12"; do
      echo "#### $knobs" | tee -a "$out/ab.txt"
      env $knobs timeout 120 $profile --policies lossless 2>&1 | tee -a "$out/ab.txt" > "$out/ab-one.txt"
      ms=$(sed -n 's/^== lossless: restore \([0-9.]*\) ms.*/\1/p' "$out/ab-one.txt")
      if [ -n "$ms" ] && awk "BEGIN{exit !($ms < $best_ms)}"; then best_ms=$ms; best=$knobs; fi
    done
    for copy in 0 1; do
      echo "#### lossy, KVSTORE_CUDA_PAGES_COPY=$copy" | tee -a "$out/ab.txt"
      env KVSTORE_CUDA_PAGES_COPY=$copy timeout 150 $profile --policies kv:quant:8:64,kv:turboquant:4:4 \
        2>&1 | tee -a "$out/ab.txt" | grep "^=="
    done
    echo "best lossless: $best ($best_ms ms)" | tee -a "$out/ab.txt"
    mkdir -p .gpu && echo "export $best" > .gpu/best.env ;;
  *) echo "next.sh: unknown step $step (profiles, ab, g1-4k, g1-16k, g2a, g2b)"; exit 2 ;;
esac
