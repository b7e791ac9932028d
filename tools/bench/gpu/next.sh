#!/usr/bin/env bash
# Issue 13's open GPU measurements (the order to take them: tools/bench/gpu/README.md;
# each step fits one call; run after stage 1, carry [".gpu/b", ".gpu/inc"]):
#
#   source .gpu/b/setup.sh >/dev/null 2>&1; KVSTORE_BENCH_GIT=<rev> bash tools/bench/gpu/next.sh STEP $OUT
#
# STEP ab        fresh-process restores of lossless, q8 and TQ 4/4, 5 each, the medians and
#                when each phase ended (tools/bench/gpu/ab_env.py; more settings: run it
#                directly): ~170 s
# STEP profiles  the restore phase by phase, lossless and every lossy policy: ~180 s
# STEP probe     a lossy decode's steps on the device (decode_probe.py): ~60 s, 120 at most
# STEP graphs    probe, then ab_env of lossless, q8 and TQ 4/4 with MLX's CUDA graphs on and
#                off (MLX_USE_CUDA_GRAPHS=0), and with 11 checking threads (16 - 4 locking
#                - the restore's own: q8's restore waits on its own thread's Python), and
#                with TurboQuant's decode kernel (kvstore/turboquant/cuda_decode.py), 4
#                each: ~400 s
# STEP stage     ab_env of lossless, q8 and TQ 4/4 with the spans copied to the device as they
#                are locked (the default) and without (KVSTORE_CUDA_STAGE_SPANS=0), with the
#                GIL switch interval at 0.1 ms and with 8 locking threads; 4 each: ~300 s. (A
#                lossy restore's layers decoded one by one, KVSTORE_STACKED_DECODE=0, crashed
#                the child in ab_env's row digest after its clock at cca0a00:
#                results/gpu/3be324c/perlayer-crash.txt.)
# STEP spans     ab_env of lossless, q8 and TQ 4/4 with a restore's records locked as the
#                library does by default (records under 24 MiB joined into auto's calls, since
#                0045756's A/B: q8 26.9 -> 22.5 ms, TQ 4/4 27.4 -> 25.4, lossless 29.4 -> 31.0
#                with auto), a call per record (=0), and auto for all: ~330 s
# STEP model     ab_env of lossless with and without G1's session before the clock in the
#                child (KVSTORE_PROFILE_MODEL=1: the llama-8B model built, a forward over
#                zeros): G1's restore was 39.5 ms against ab_env's 30.5 at 87ca0d3, is the
#                model why? Each phase's end says where the time goes: ~150 s
# STEP parent    ab_env of lossless and q8 without, then with, G1's model held in the parent
#                (--parent-model): G1/G2's restores stay 5-8 ms slower than ab_env's
#                children, and the model in the child is not why (1a8cb38/ab-model.txt): ~300 s
# STEP cpu       ab_env of TQ 4/4 and q8 with each phase's CPU time on its thread (far under its
#                wall time: the thread waited), with 4 checking threads and with the last block
#                read in part as G2's sessions read it, 4 each: ~350 s (the steps that tried
#                locking after the headers and the parse switches are gone with their switches:
#                results/gpu/c8a32fa/, d1643e2/)
# STEP copy      ab_env of TQ 4/4, q8 and lossless with the records locked where they are (the
#                default) and copied through the staging slots on the staging threads instead
#                (KVSTORE_CUDA_PAGES_ROUTE=copy: no page locked), 4 each: ~250 s
# STEP early     ab_env of TQ 4/4 and q8 with a lossy restore's stacked decode queued on the
#                device as soon as it is made (the default since d0ceccd's A/B: TQ 25.5 ->
#                23.6 ms, q8 27.5 -> 26.3) against evaluated with the caches' joins
#                (KVSTORE_EARLY_DECODE=0), 6 each: ~250 s
# STEP reader   ab_env of TQ 4/4 and q8 with a restore's checks waiting for the headers its
#                own thread parses (the default, record.reader_parses: at d0ceccd the
#                headers took 5.9 ms of that thread's wall for 2.9 of its CPU while the
#                checks parsed the same ones) against parsing whichever they reach
#                (KVSTORE_READER_PARSES=0), 6 each: ~250 s
# STEP alike     ab_env of TQ 4/4 and q8 with a lossy restore's joins made per tensor name
#                (kvstore/codecs/alike_joins.py, the default) against per (layer, name) as
#                before (KVSTORE_ALIKE_JOINS=0), 6 each: ~250 s
# STEP variants which part of the encode kernel costs a launch its ~20 us, and the verdict
#                kept by the kernel against mx.max (encode_variants.py): ~60 s
# STEP verdicts the verdict's cases of encode_variants.py (a 16-byte maximum against a 1-byte
#                one), then P11: ~200 s
# STEP tqpair    ab_env of TQ 4/4 with a restore's stacked keys and values decoded in one
#                launch (cuda_rht.decoded_together, the default) against a launch each
#                (KVSTORE_TQ_TOGETHER=0), 6 each: ~150 s
# STEP fwdgraphs forward_profile.py (the one-token forward after a restore, against the
#                same over the model's own caches) with MLX's CUDA graphs and without
#                (MLX_USE_CUDA_GRAPHS=0), one host: G2's forwards were 11.5-16.2 ms with
#                graphs and 9.1-9.3 in the fast sessions without, on two hosts (d0ceccd):
#                ~200 s
# STEP rht       TurboQuant's one-kernel encode and decode (kvstore/turboquant/cuda_rht.py):
#                proven or not, agreement with the ops and times (rht_probe.py), then P11
#                on the device: ~140 s
# STEP floor     rht_probe.py (the kernels proven?), then where a small TurboQuant encode or
#                decode spends its time (floor_probe.py:
#                the evaluation's floor, an empty custom kernel, the peers, the encode's
#                pieces; with CUDA graphs and without), then P11: ~150 s
# STEP together  rht_probe.py (the kernels proven?), floor_probe.py (with a layer's keys and
#                values encoded, and decoded, in one launch), then P11 with them in one
#                launch (the default) and with a launch each (KVSTORE_TQ_TOGETHER=0): ~350 s
# STEP g1-4k     G1 at 4096 tokens: ~150 s
# STEP g1-16k    G1 at 16384 tokens: ~230 s
# STEP g1ab      G1 at 4096 tokens for an older revision and this tree on one host,
#                alternated twice (old, new, old, new): is a G1 reading the host or the
#                code? Here first: rm -rf .gpu/old && mkdir -p .gpu/old && git archive OLD
#                kvstore tools/bench/gpu | tar -x -C .gpu/old && echo OLD > .gpu/old/rev,
#                and carry [".gpu/b", ".gpu/inc", ".gpu/old"]. Each run from its own tree
#                (the directory a run starts in wins over PYTHONPATH): ~4 x 110 s
# STEP g2a       G2 at 4096 tokens, lossless + kv:quant:8:64 and 4:64: ~330 s
# STEP g2q8      the same with kv:quant:8:64 alone: ~285 s (G2's bar 0.35)
# STEP g2b       the same with kv:turboquant:4:4 alone: ~250 s (with 3:3 as well it outlasted
#                a call of 380 s at 5ba93ee, and G2 writes its figures only at its end)
# STEP g2c       the same with kv:turboquant:3:3 alone: ~250 s
# STEP g2bars    the same with the two policies G2 has bars for, kv:quant:8:64 and
#                kv:turboquant:4:4, on one host and one lossless run: ~440 s (g2b alone
#                took 339 s at 8e1beb9, g2q8 279)
# STEP g3disk    disk_probe.py at 512 MiB and 2 GiB (the host's disk: a durable write of a
#                4096- and a 16384-token llama-8B save's bytes), then G3 at both lengths: is
#                G3's 0.456x at 16384 (ffd1c4c-h100) the host's disk? ~400 s
# STEP disk      disk_probe.py alone at 512 MiB and 2 GiB, the file system named, space
#                reserved by posix_fallocate beside appending and O_DIRECT: would a store
#                that reserves its file's next space ahead write a 2 GiB save faster? ~60 s
# STEP savestall save_stall.py at 4096 tokens (4 saves) and 16384 (2), the download by a kernel
#                and by the copy engine (KVSTORE_CUDA_DOWNLOAD_ROUTE, copy the default; its
#                records checked by check.py first): each decode step during a save behind,
#                with the writer's parts it overlaps (results/gpu/savestall-h100: the step
#                overlapping the records' download runs 3-4x slower): ~200 s
# STEP stacked   check.py, then G3 at both lengths with a run of blocks' payloads built
#                together (KVSTORE_CUDA_SAVE_PAYLOADS=stacked), at both lengths record by
#                record, and save_stall.py at 4096 stacked
#                (results/gpu/ffbfa55-h100, 728fe43-h100): ~330 s
# STEP g3stall   save_stall.py at 16384 tokens with G3's peer saves between (--churn),
#                stacked then record by record: the 176-251 ms step of 4ac01ae-h100: ~250 s
# STEP autostall save_stall.py at 16384 tokens with G3's peer saves between (--churn), under
#                auto (nothing stacked: the save is over AUTO_STACKED_BYTES) then record by
#                record, write_records' parts timed; then G3 at 16384 alone under auto,
#                record, auto: at 6f53194 auto's longest step was 252.9 ms, record's 68.2,
#                with the same code run for both (is it the order, or the host?): ~330 s
# STEP autopay   check.py, then G3 at both lengths record by record, then under the
#                default (auto: lossless runs stacked, RUN_BYTES a run at most): ~230 s
# STEP g3routes  G3 at both lengths, the download by a kernel, then by the copy engine: ~160 s
# STEP pipeline  save_pipeline.py with a 4096-token llama-8B save's 512 MiB (16 records of 32 MiB):
#                every record written, then put and committed, against each put as it is
#                written, on the host's 16 cores (on the 2-core VM: 0.98-1.14x): ~30 s
# STEP g3ab      disk_probe.py and lmdb_put.py at 512 MiB, then G3 at 4096 tokens with the
#                commit's writeback pump on and off (KVSTORE_COMMIT_WRITEBACK=1/0)
# STEP g3phases  where a durable save's time goes on the host, at 4096 and 16384 tokens:
#                save_profile.py's wall clock per phase (the records' encode, LMDB's puts,
#                its commit) for G3's saves behind (32 layers, the model's caches, G3's
#                peer saved before each), and lmdb_put.py's puts of 512 MiB and 2 GiB
#                alone (LMDB's copy without the download and hashing feeding it): ~200 s
# STEP g3values  G3 at both lengths with a store's large values in a file beside LMDB,
#                written in place (KVSTORE_LMDB_VALUES=file), then in LMDB's pages
#                (inline, the default), then G1 at 4096 tokens restoring from the file:
#                ~330 s
# STEP serve8b   tools/bench/serve_ttft.py with the llama-8B shape (written once to
#                /tmp/m8b in mlx-lm's 5 GiB files, 40 s), 3 repeats under KVSTORE_UNFUSED_ATTENTION=never, then
#                auto (MODES="auto" for one): ~2 x 240 s (one repeat took 80-140 s); its
#                prometheus_client is the device image's (warmdecode ran so at 161dfd3)
# STEP firstpick shape_probe.py parts B and E as they are, then with CUDA_MODULE_LOADING=EAGER:
#                is a new suffix length's remaining ~20 ms cuBLAS loading kernels? Then B
#                after a warm-up of 18 suffix lengths (--spread), and D (520 decode steps)
#                with every buffer size's cuDNN graph built first (--decode-warm); each
#                loading mode's start (import to a first evaluation): ~300 s
# STEP warmdecode serve_ttft.py with the llama-8B shape (/tmp/m8b, written once), one repeat,
#                a 300-token turn 2 (its steps pass into a new buffer size), kvstore serve
#                with --warm-decode 4608: the longest gap between tokens, ours against
#                stock's (which builds the graph in the answer), and the warm-up's cost:
#                ~150 s
# STEP switch    G3 at 4096 tokens with the GIL switch interval at 5 ms (Python's) and 0.5 ms
#                (tools/bench/with_switch_interval.py): the decode steps taken while a save's
#                writer commits, median and longest, each way: ~8 min
# STEP kvbits    quantized caches on the device: serve_kv_bits.py (stock and kvstore serve with
#                and without --kv-bits, a small model: each server's text or error),
#                qdecode_probe.py (a decode step's attention over 32 layers of 4096
#                quantized rows, by quantized_matmul against dequantized + fused) and
#                qmm_views.py (the model over kv:quant:4:64 and 8:64 against plain): ~5 min
# STEP loopprofile warmdecode's run twice with tools/bench/gpu/loop_profile on both servers'
#                path: each BatchGenerator.next call's time and the time between calls (the
#                server loop), then with a cProfile of the generating thread; summaries in
#                loop-{0,1}-summary.txt: where a streamed token's ~10 ms beyond the model go
#                and the ~57 ms gap at the third: ~320 s (plus ~60 s to write the model).
#                Every thread's stack sampled each SAMPLE_MS (2) ms, printed for each call
#                or gap over 100 ms (the 419-444 ms gap at the 69th token); CPROFILES=0
#                for the first run alone (~160 s)
# STEP touchgap  the restarted 8B server's 419-444 ms gap at the 69th streamed chunk:
#                warmdecode's run with every thread's stack sampled (loop_profile,
#                SAMPLE_MS 2), then with touch_interval=30 (the restore's recency writes,
#                batched for 1 s, after the turn instead). serve_ttft now prints the tokens
#                behind each long gap's chunk: on the VM every long gap was a chunk of 12-22
#                tokens whose text mlx-lm held back, alike in all three servers; run this
#                only if warmdecode shows the 69th chunk is one or two tokens: ~250 s
# STEP staging  serve_ttft.py with the llama-8B shape, 2 repeats, kvstore serve's staging set
#                up on a thread of its own (the default since results/gpu/staging-h100/: it
#                held the warm-up's thread 3.4-4.5 s) and on the warm-up's
#                (KVSTORE_WARMUP_STAGING_THREAD=0): server.warmup_s, turn 2: ~2 x 170 s
# STEP firstcosts tools/bench/gpu/first_costs.py twice, the second with --copies-first: the
#                staging set-up's parts and a fresh process's save hand-offs, 512 tokens each
#                (results/gpu/firstcosts-h100/: the first hand-off 92-94 ms, the rest ~1.1),
#                the second after a hand-off's copies made and timed alone: ~50 s
# STEP precompiled kvstore's kernels compiled by kvstore.nvrtc and kept on disk (the default
#                since kvstore.cuda_kernel's precompiled route) in a first process (an empty
#                cache) and a second, with serve's warm-up copies before the hand-offs; MLX
#                compiling them (KVSTORE_CUDA_PRECOMPILED=0); check.py on the route; the
#                row digests of 2 GiB on the device: ~120 s
# STEP route    route_probe.py: a launch's Python call, evaluation, CPU and page faults on
#                each kernel route (gather_many's 64 outputs, upload), then ab_env of q8 on
#                both routes, 6 each: ~150 s
# STEP faults   restore_profile.py of kv:quant:8:64 and kv:turboquant:4:4 on the precompiled
#                route and MLX's (KVSTORE_CUDA_PRECOMPILED=0): where the restore thread's
#                ~200 more page faults on the precompiled route come from: ~120 s
# STEP abroute  ab_env of lossless, q8 and TQ 4/4 on the precompiled route and MLX's, 4
#                each: do launches cost more through precompiled_cuda_kernel? ~300 s
#
# Results under OUT; copy them to tools/bench/results/gpu/<rev>/ to commit.
set -uo pipefail
step=${1:?step}
out=${2:-${OUT:?OUT}}
rev=${KVSTORE_BENCH_GIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}  # no .git there: pass it
cd "$(dirname "$0")/../../.."
if ! python3 -c "import mlx.core" 2>/dev/null; then
  # A call that lands on a fresh machine (the one held was given back, or a start was
  # refused in between) has no stage 1: say so before any step spends its time.
  echo "next.sh: MLX is not installed here: a fresh machine; run .gpu/a/stage1.sh (carry .gpu/a) first" >&2
  exit 3
fi
profile="python3 tools/bench/gpu/restore_profile.py --repeats 3"
# G3 at both lengths with KVSTORE_CUDA_SAVE_PAYLOADS=$1 into $out/g3-$1: its llama8b rows
# printed, its check and log files dropped (a call brings back a limited count of files).
g3_under() {
  KVSTORE_CUDA_SAVE_PAYLOADS=$1 KVSTORE_BENCH_GIT=$rev CHECK_TIMEOUT=1 BENCH_TIMEOUT=200 \
    bash tools/bench/gpu/run.sh G3 "$out/g3-$1" > /dev/null 2>&1
  echo "== $1 $(date +%T)"; grep -E "llama8b" "$out/g3-$1/bench-table.txt"
  rm -f "$out/g3-$1/gpu-check.txt" "$out/g3-$1/bench-log.txt"
}
# disk_probe.py at a 4096- and a 16384-token llama-8B save's bytes, $1 repeats each.
probe_disk() {
  timeout $((50 * $1)) python3 tools/bench/disk_probe.py --dir /tmp --mib 512 2048 --repeats "$1" 2>&1 \
    | tee "$out/disk-probe.txt"
}

# The restarted 8B server's 300-token turn 2 (warmdecode's run) into $out/$1.{json,txt},
# with serve_ttft.py's further options after $1 (the environment passes through).
warm_stream() {
  local name=$1; shift
  timeout 280 python3 tools/bench/serve_ttft.py --model /tmp/m8b --shape llama8b --context 4000 \
    --repeats 1 --answer2 300 --ours-arg=--warm-decode --ours-arg=4608 --json "$out/$name.json" "$@" \
    > "$out/$name.txt" 2>&1
}
case "$step" in
  profiles)
    timeout 300 $profile --policies lossless,kv:quant:8:64,kv:quant:4:64,kv:turboquant:4:4,kv:turboquant:3:3 \
      2>&1 | tee "$out/restore-profiles.txt" ;;
  probe)
    timeout 120 python3 tools/bench/gpu/decode_probe.py 2>&1 | tee "$out/decode-probe.txt" ;;
  graphs)
    timeout 120 python3 tools/bench/gpu/decode_probe.py 2>&1 | tee "$out/decode-probe.txt"
    timeout 420 python3 -m tools.bench.gpu.ab_env --repeats 4 base: 'nograph:MLX_USE_CUDA_GRAPHS=0' \
      'v11:KVSTORE_VERIFY_THREADS=11' \
      'notqk:KVSTORE_TQ_DECODE_KERNEL=0' --policies lossless,kv:quant:8:64,kv:turboquant:4:4 2>&1 | tee "$out/ab-graphs.txt" ;;
  stage)
    timeout 540 python3 -m tools.bench.gpu.ab_env --repeats 4 base: 'nostage:KVSTORE_CUDA_STAGE_SPANS=0' \
      'sw01:KVSTORE_CUDA_SWITCH_MS=0.1' 'reg8:KVSTORE_CUDA_REGISTER_THREADS=8' \
      --policies lossless,kv:quant:8:64,kv:turboquant:4:4 2>&1 | tee "$out/ab-stage.txt" ;;
  spans)
    timeout 540 python3 -m tools.bench.gpu.ab_env --repeats 4 base: 'percall:KVSTORE_CUDA_LOCK_SPANS=0' \
      'auto:KVSTORE_CUDA_LOCK_SPANS=auto' \
      --policies lossless,kv:quant:8:64,kv:turboquant:4:4 2>&1 | tee "$out/ab-spans.txt" ;;
  model)
    timeout 300 python3 -m tools.bench.gpu.ab_env --repeats 5 base: 'model:KVSTORE_PROFILE_MODEL=1' \
      --policies lossless 2>&1 | tee "$out/ab-model.txt" ;;
  parent)
    timeout 200 python3 -m tools.bench.gpu.ab_env --repeats 5 base: --policies lossless,kv:quant:8:64 \
      2>&1 | tee "$out/ab-parent-none.txt"
    timeout 300 python3 -m tools.bench.gpu.ab_env --repeats 5 base: --policies lossless,kv:quant:8:64 \
      --parent-model 2>&1 | tee "$out/ab-parent-model.txt" ;;
  ab)
    timeout 300 python3 -m tools.bench.gpu.ab_env --repeats 5 base: \
      --policies lossless,kv:quant:8:64,kv:turboquant:4:4 2>&1 | tee "$out/ab-env.txt" ;;
  cpu)
    timeout 540 python3 -m tools.bench.gpu.ab_env --repeats 4 base: 'v4:KVSTORE_VERIFY_THREADS=4' \
      'last:KVSTORE_PROFILE_LEAVE_LAST=1' --policies kv:turboquant:4:4,kv:quant:8:64 2>&1 | tee "$out/ab-cpu.txt" ;;
  copy)
    timeout 420 python3 -m tools.bench.gpu.ab_env --repeats 4 base: \
      'copy:KVSTORE_CUDA_PAGES_ROUTE=copy' --policies kv:turboquant:4:4,kv:quant:8:64,lossless \
      2>&1 | tee "$out/ab-copy.txt" ;;
  early)
    timeout 420 python3 -m tools.bench.gpu.ab_env --repeats 6 base: \
      'late:KVSTORE_EARLY_DECODE=0' --policies kv:turboquant:4:4,kv:quant:8:64 \
      2>&1 | tee "$out/ab-early.txt" ;;
  reader)
    timeout 420 python3 -m tools.bench.gpu.ab_env --repeats 6 base: \
      'checks-parse:KVSTORE_READER_PARSES=0' --policies kv:turboquant:4:4,kv:quant:8:64 \
      2>&1 | tee "$out/ab-reader.txt" ;;
  alike)
    timeout 420 python3 -m tools.bench.gpu.ab_env --repeats 6 base: \
      'per-layer-joins:KVSTORE_ALIKE_JOINS=0' --policies kv:turboquant:4:4,kv:quant:8:64 \
      2>&1 | tee "$out/ab-alike.txt" ;;
  variants)
    timeout 240 python3 tools/bench/gpu/encode_variants.py 2>&1 | tee "$out/encode-variants.txt" ;;
  verdicts)
    timeout 240 python3 tools/bench/gpu/encode_variants.py --verdicts 2>&1 | tee "$out/verdicts.txt"
    KVSTORE_BENCH_GIT=$rev CHECK_TIMEOUT=1 BENCH_TIMEOUT=240 REPEATS=5 \
      bash tools/bench/gpu/run.sh P11 /tmp/p11 >/dev/null 2>&1
    cp /tmp/p11/bench-table.txt "$out/p11.txt" ;;
  tqpair)
    timeout 300 python3 -m tools.bench.gpu.ab_env --repeats 6 base: \
      'apart:KVSTORE_TQ_TOGETHER=0' --policies kv:turboquant:4:4 \
      2>&1 | tee "$out/ab-tqpair.txt" ;;
  fwdgraphs)
    timeout 200 python3 tools/bench/gpu/forward_profile.py --repeats 5 2>&1 | tee "$out/forward-graphs.txt"
    MLX_USE_CUDA_GRAPHS=0 timeout 200 python3 tools/bench/gpu/forward_profile.py --repeats 5 \
      2>&1 | tee "$out/forward-nographs.txt" ;;
  rht)
    timeout 150 python3 tools/bench/gpu/rht_probe.py 2>&1 | tee "$out/rht-probe.txt"
    KVSTORE_BENCH_GIT=$rev CHECK_TIMEOUT=1 BENCH_TIMEOUT=240 REPEATS=5 \
      bash tools/bench/gpu/run.sh P11 "$out/p11" ;;
  floor)
    timeout 150 python3 tools/bench/gpu/rht_probe.py 2>&1 | tee "$out/rht-probe.txt"
    timeout 200 python3 tools/bench/gpu/floor_probe.py 2>&1 | tee "$out/floor-probe.txt"
    KVSTORE_BENCH_GIT=$rev CHECK_TIMEOUT=1 BENCH_TIMEOUT=240 REPEATS=5 \
      bash tools/bench/gpu/run.sh P11 "$out/p11" ;;
  together)
    timeout 150 python3 tools/bench/gpu/rht_probe.py 2>&1 | tee "$out/rht-probe.txt"
    timeout 200 python3 tools/bench/gpu/floor_probe.py 2>&1 | tee "$out/floor-probe.txt"
    # Only the tables kept: the device returns a limited count of files.
    for ab in together apart; do
      env=$([ "$ab" = apart ] && echo KVSTORE_TQ_TOGETHER=0 || echo KVSTORE_TQ_TOGETHER=1)
      env "$env" KVSTORE_BENCH_GIT=$rev CHECK_TIMEOUT=1 BENCH_TIMEOUT=200 REPEATS=5 \
        bash tools/bench/gpu/run.sh P11 "/tmp/p11-$ab" >/dev/null 2>&1
      cp "/tmp/p11-$ab/bench-table.txt" "$out/p11-$ab.txt"
    done ;;
  g3disk)
    probe_disk 2
    KVSTORE_BENCH_GIT=$rev CHECK_TIMEOUT=1 BENCH_TIMEOUT=430 bash tools/bench/gpu/run.sh G3 "$out/g3" ;;
  disk)
    probe_disk 3 ;;
  savestall)
    # The copy route's records checked first (check.py: a save's records == encode_record).
    KVSTORE_CUDA_DOWNLOAD_ROUTE=copy timeout 120 python3 tools/bench/gpu/check.py > "$out/check-copy-route.txt" 2>&1
    head -4 "$out/check-copy-route.txt"
    for route in kernel copy; do
      KVSTORE_CUDA_DOWNLOAD_ROUTE=$route timeout 130 python3 tools/bench/gpu/save_stall.py --tokens 4096 \
        --saves 4 > "$out/save-stall-4096-$route.txt" 2>&1
      KVSTORE_CUDA_DOWNLOAD_ROUTE=$route timeout 130 python3 tools/bench/gpu/save_stall.py --tokens 16384 \
        --saves 2 > "$out/save-stall-16384-$route.txt" 2>&1
    done
    for f in "$out"/save-stall-*.txt; do echo "== $f"; grep -E "^Device|^save|download:" "$f"; done ;;
  stacked)
    # check.py (a save behind's records, payloads stacked, == encode_record), then G3 at
    # both lengths with a run of blocks' payloads built together, G3 at both lengths
    # built record by record (the default), and save_stall.py at 4096 stacked.
    timeout 120 python3 tools/bench/gpu/check.py > "$out/check.txt" 2>&1; head -5 "$out/check.txt"
    KVSTORE_CUDA_SAVE_PAYLOADS=stacked KVSTORE_BENCH_GIT=$rev CHECK_TIMEOUT=1 BENCH_TIMEOUT=200 \
      bash tools/bench/gpu/run.sh G3 "$out/g3-stacked" > /dev/null 2>&1
    echo "== stacked"; grep -E "llama8b" "$out/g3-stacked/bench-table.txt"
    KVSTORE_CUDA_SAVE_PAYLOADS=record KVSTORE_BENCH_GIT=$rev CHECK_TIMEOUT=1 BENCH_TIMEOUT=200 \
      bash tools/bench/gpu/run.sh G3 "$out/g3-unstacked" > /dev/null 2>&1
    echo "== unstacked"; grep -E "llama8b" "$out/g3-unstacked/bench-table.txt"
    KVSTORE_CUDA_SAVE_PAYLOADS=stacked timeout 100 python3 tools/bench/gpu/save_stall.py --tokens 4096 \
      --saves 4 > "$out/save-stall-4096.txt" 2>&1
    grep -E "^Device|^save|write_records|lmdb" "$out/save-stall-4096.txt" ;;
  autopay)
    # check.py, then G3 at both lengths with each record's payload built on its own, then
    # with the default (auto: the lossless runs stacked, at most RUN_BYTES a run).
    timeout 120 python3 tools/bench/gpu/check.py > "$out/check.txt" 2>&1; head -6 "$out/check.txt"
    for payloads in record auto; do g3_under "$payloads"; done ;;
  autostall)
    for payloads in auto record; do
      KVSTORE_CUDA_SAVE_PAYLOADS=$payloads timeout 120 python3 tools/bench/gpu/save_stall.py --tokens 16384 \
        --saves 3 --churn > "$out/save-stall-16384-churn-$payloads.txt" 2>&1
      echo "== $payloads"; grep -E "^Device|^save|MLX memory|write_records|eval|download_later|took" \
        "$out/save-stall-16384-churn-$payloads.txt" | cut -c1-260
    done
    for payloads in auto record auto; do
      KVSTORE_CUDA_SAVE_PAYLOADS=$payloads KVSTORE_BENCH_GPU_TOKENS=16384 KVSTORE_BENCH_GIT=$rev CHECK_TIMEOUT=1 \
        BENCH_TIMEOUT=150 bash tools/bench/gpu/run.sh G3 "/tmp/g3-$payloads" > /dev/null 2>&1
      echo "== G3 16384 $payloads $(date +%T)"; grep -E "llama8b" "/tmp/g3-$payloads/bench-table.txt" | grep -o \
        "ours (durable) [0-9.]* m\?s\|mlx-lm save [0-9.]* m\?s\|vs mlx-lm save [0-9.]*x\|longest step during save ms [0-9.]*" | tr '\n' ' '
      echo; rm -rf "/tmp/g3-$payloads"
    done ;;
  g3stall)
    # Why a stacked 2 GiB save stalls one step in G3 and not in save_stall.py: the same
    # with G3's peer saves between (--churn), stacked then record by record.
    for payloads in stacked record; do
      KVSTORE_CUDA_SAVE_PAYLOADS=$payloads timeout 200 python3 tools/bench/gpu/save_stall.py --tokens 16384 \
        --saves 3 --churn > "$out/save-stall-16384-churn-$payloads.txt" 2>&1
      echo "== $payloads"; grep -E "^Device|^save|MLX memory|write_records|took" "$out/save-stall-16384-churn-$payloads.txt" | cut -c1-300
    done ;;
  g3routes)
    # G3 at both lengths with the download by a kernel (the default) and by the copy engine.
    for route in kernel copy; do
      KVSTORE_CUDA_DOWNLOAD_ROUTE=$route KVSTORE_BENCH_GIT=$rev CHECK_TIMEOUT=1 BENCH_TIMEOUT=200 \
        bash tools/bench/gpu/run.sh G3 "$out/g3-$route" > /dev/null 2>&1
      echo "== $route"; cat "$out/g3-$route/bench-table.txt" 2>/dev/null | head -30
    done ;;
  pipeline)
    timeout 120 python3 tools/bench/save_pipeline.py --records 16 --mib 32 --repeats 5 2>&1 | tee "$out/save-pipeline.txt" ;;
  g3ab)
    # The disk and LMDB alone, then G3 at 4096 tokens with the commit's writeback pump on
    # and off (kvstore/store/engines/writeback.py).
    timeout 100 python3 tools/bench/disk_probe.py --dir /tmp --mib 512 --repeats 3 2>&1 | tee "$out/disk-probe.txt"
    timeout 100 python3 tools/bench/lmdb_put.py --values 128 --mib 4 --repeats 3 2>&1 | tee "$out/lmdb-put.txt"
    for wb in 1 0; do
      KVSTORE_COMMIT_WRITEBACK=$wb KVSTORE_BENCH_GPU_TOKENS=4096 KVSTORE_BENCH_GIT=$rev \
        CHECK_TIMEOUT=1 BENCH_TIMEOUT=180 REPEATS=5 bash tools/bench/gpu/run.sh G3 "/tmp/g3-wb$wb" >/dev/null 2>&1
      cp "/tmp/g3-wb$wb/bench-table.txt" "$out/g3-wb$wb.txt"
      tail -3 "/tmp/g3-wb$wb/bench-log.txt" > "$out/g3-wb$wb-log.txt"
    done ;;
  g3phases)
    for mib in 512 2048; do
      timeout 100 python3 tools/bench/lmdb_put.py --values $((mib / 32)) --mib 32 --repeats 3 2>&1 \
        | tee "$out/lmdb-put-$mib.txt"
    done
    for tokens in 4096 16384; do
      timeout 200 python3 tools/bench/save_profile.py --layers 32 --tokens $tokens --repeats 4 \
        --policies lossless --behind --model-caches --with-peer --reuse --phases 2>&1 \
        | tee "$out/phases-$tokens.txt"
    done ;;
  g3values)
    for values in file inline; do
      KVSTORE_LMDB_VALUES=$values KVSTORE_BENCH_GIT=$rev CHECK_TIMEOUT=1 BENCH_TIMEOUT=200 \
        REPEATS=5 bash tools/bench/gpu/run.sh G3 "/tmp/g3-$values" >/dev/null 2>&1
      cp "/tmp/g3-$values/bench-table.txt" "$out/g3-$values.txt"
      tail -3 "/tmp/g3-$values/bench-log.txt" > "$out/g3-$values-log.txt"
      echo "== $values"; grep -E "llama8b" "$out/g3-$values.txt" | cut -c1-400
    done
    KVSTORE_LMDB_VALUES=file KVSTORE_BENCH_GPU_TOKENS=4096 KVSTORE_BENCH_GIT=$rev CHECK_TIMEOUT=60 \
      BENCH_TIMEOUT=170 REPEATS=5 bash tools/bench/gpu/run.sh G1 "$out/g1-4k-file" >/dev/null 2>&1
    echo "== G1 4096, values in the file"; grep -E "llama8b" "$out/g1-4k-file/bench-table.txt" | cut -c1-600 ;;
  g1-4k)
    KVSTORE_BENCH_GPU_TOKENS=4096 KVSTORE_BENCH_GIT=$rev CHECK_TIMEOUT=60 BENCH_TIMEOUT=400 \
      REPEATS=5 bash tools/bench/gpu/run.sh G1 "$out/g1-4k" ;;
  g1ab)
    [ -s .gpu/old/rev ] || { echo "next.sh g1ab: no .gpu/old (see the step's comment)" >&2; exit 2; }
    old=$(cat .gpu/old/rev)
    out=$(mkdir -p "$out" && cd "$out" && pwd)  # each run starts in its own tree
    for round in $(seq "${ROUNDS:-2}"); do  # ROUNDS=1: one of each, ~220 s
      for side in old new; do
        if [ $side = old ]; then tree=.gpu/old; name=$old; else tree=.; name=$rev; fi
        (cd "$tree" && KVSTORE_BENCH_GPU_TOKENS=4096 KVSTORE_BENCH_GIT=$name CHECK_TIMEOUT=1 \
          BENCH_TIMEOUT=130 REPEATS=5 bash tools/bench/gpu/run.sh G1 "$out/g1-$side-$round" >/dev/null 2>&1)
        echo "== $side ($name), round $round $(date +%T)"
        grep -E "llama8b" "$out/g1-$side-$round/bench-table.txt" | cut -c1-420
        rm -f "$out/g1-$side-$round/gpu-check.txt"
      done
    done ;;
  g1-16k)
    KVSTORE_BENCH_GPU_TOKENS=16384 KVSTORE_BENCH_GIT=$rev CHECK_TIMEOUT=1 BENCH_TIMEOUT=520 \
      REPEATS=5 bash tools/bench/gpu/run.sh G1 "$out/g1-16k" ;;
  g2a|g2q8|g2b|g2c|g2bars)
    case "$step" in
      g2a) policies=kv:quant:8:64,kv:quant:4:64 ;;
      g2bars) policies=kv:quant:8:64,kv:turboquant:4:4 ;;
      g2q8) policies=kv:quant:8:64 ;;
      g2b) policies=kv:turboquant:4:4 ;;
      *) policies=kv:turboquant:3:3 ;;
    esac
    KVSTORE_BENCH_G2_POLICIES=$policies KVSTORE_BENCH_GPU_TOKENS=4096 KVSTORE_BENCH_GIT=$rev \
      CHECK_TIMEOUT=1 BENCH_TIMEOUT=540 REPEATS=5 bash tools/bench/gpu/run.sh G2 "$out/$step" ;;
  serve8b)
    for mode in ${MODES:-never auto}; do
      KVSTORE_UNFUSED_ATTENTION=$mode timeout 270 python3 tools/bench/serve_ttft.py --model /tmp/m8b --shape llama8b \
        --context 4000 --repeats 3 --json "$out/serve8b-$mode.json" > "$out/serve8b-$mode.txt" 2>&1
      tail -8 "$out/serve8b-$mode.txt"
    done ;;
  warmdecode)
    warm_stream warmdecode
    tail -12 "$out/warmdecode.txt" ;;
  loopprofile)
    for cprofile in ${CPROFILES:-0 1}; do
      PYTHONPATH=$PWD/tools/bench/gpu/loop_profile:$PYTHONPATH KVSTORE_BENCH_LOOP_PROFILE=$out/loop-$cprofile \
        KVSTORE_BENCH_LOOP_PROFILE_SAMPLE=${SAMPLE_MS:-2} KVSTORE_BENCH_LOOP_PROFILE_CPROFILE=$cprofile \
        warm_stream "loop-$cprofile"
      tail -4 "$out/loop-$cprofile.txt"
      python3 -m tools.bench.gpu.loop_profile.summary "$out/loop-$cprofile" --top 30 > "$out/loop-$cprofile-summary.txt"
      grep -E "^==|calls,|samples|  x[0-9]| x[0-9]" "$out/loop-$cprofile-summary.txt" | cut -c1-400 | head -60
    done ;;
  touchgap)
    for query in "" touch_interval=30; do
      name=touch-${query:-default}; name=${name//=/-}
      PYTHONPATH=$PWD/tools/bench/gpu/loop_profile:$PYTHONPATH KVSTORE_BENCH_LOOP_PROFILE=$out/$name \
        KVSTORE_BENCH_LOOP_PROFILE_SAMPLE=${SAMPLE_MS:-2} warm_stream "$name" --store-query "$query"
      echo "== $name"; grep -E "^kvstore serve|^stock" "$out/$name.txt"
      python3 -m tools.bench.gpu.loop_profile.summary "$out/$name" > "$out/$name-summary.txt"
      sed -n '/(kvstore serve)/,$p' "$out/$name-summary.txt" | grep -E "calls,|samples| x[0-9]" \
        | grep -v "selectors.py\|queue.py:180 get" | cut -c1-300 | tail -40
    done ;;
  kvbits)
    timeout 150 python3 tools/bench/gpu/serve_kv_bits.py 2>&1 | tee "$out/serve-kv-bits.txt"
    timeout 200 python3 tools/bench/gpu/qdecode_probe.py 2>&1 | tee "$out/qdecode-probe.txt"
    timeout 240 python3 tools/bench/gpu/qmm_views.py 2>&1 | tee "$out/qmm-views.txt" ;;
  switch)
    for ms in 5 0.5; do
      KVSTORE_BENCH_GPU_TOKENS=4096 timeout 270 python3 tools/bench/with_switch_interval.py $ms bench \
        --only G3 --repeats 5 --out "$out/switch-$ms" > "$out/switch-$ms.txt" 2>&1
      grep -o "held ms [0-9.]*\|step ms [0-9.]*\|step with save ms [0-9.]*\|steps during save [0-9.]*\|step during save ms [0-9.]*\|longest step during save ms [0-9.]*" \
        "$out/switch-$ms.txt" | head -6 | tr '\n' ' '; echo " (switch interval $ms ms)"
    done ;;
  staging)
    for thread in 1 0; do
      KVSTORE_WARMUP_STAGING_THREAD=$thread timeout 280 python3 tools/bench/serve_ttft.py \
        --model /tmp/m8b --shape llama8b --context 4000 --repeats 2 \
        --json "$out/staging-$thread.json" > "$out/staging-$thread.txt" 2>&1
      tail -4 "$out/staging-$thread.txt"
      python3 -c "import json, sys; d = json.load(open(sys.argv[1]))
for s in d['samples']: print({k: round(v['ttft_s'], 2) for k, v in s['turn1'].items()}, s['ours_startup_s'])" \
        "$out/staging-$thread.json"
    done ;;
  firstcosts)
    timeout 120 python3 tools/bench/gpu/first_costs.py > "$out/firstcosts-1.txt" 2>&1
    cat "$out/firstcosts-1.txt"
    timeout 120 python3 tools/bench/gpu/first_costs.py --copies-first > "$out/firstcosts-2.txt" 2>&1
    cat "$out/firstcosts-2.txt" ;;
  precompiled)
    kept=/tmp/kvstore-kernels-$$
    rm -rf "$kept"
    for run in 1 2; do
      KVSTORE_CACHE_DIR=$kept timeout 120 python3 tools/bench/gpu/first_costs.py --warm-copies \
        > "$out/precompiled-$run.txt" 2>&1
      echo "-- process $run"; cat "$out/precompiled-$run.txt"
    done
    ls -la "$kept/cuda-kernels" | tee "$out/precompiled-files.txt"
    KVSTORE_CUDA_PRECOMPILED=0 KVSTORE_CACHE_DIR=$kept timeout 120 python3 tools/bench/gpu/first_costs.py \
      > "$out/precompiled-off.txt" 2>&1
    echo "-- MLX's route"; cat "$out/precompiled-off.txt"
    KVSTORE_CACHE_DIR=$kept timeout 200 python3 tools/bench/gpu/check.py 2>&1 | tee "$out/precompiled-check.txt"
    KVSTORE_CACHE_DIR=$kept timeout 100 python3 -c "
import time, mlx.core as mx
from kvstore.bridge import digests
a = mx.random.normal((1 << 30,)).astype(mx.bfloat16); mx.eval(a)
for i in range(3):
    t = time.perf_counter(); d = digests.array_digests([a]); print('row digests of 2 GiB: %.1f ms' % ((time.perf_counter() - t) * 1e3), 'kernel' if digests._kernel() else 'host')
" 2>&1 | tee "$out/precompiled-digests.txt" ;;
  route)
    timeout 120 python3 tools/bench/gpu/route_probe.py 2>&1 | tee "$out/route-probe.txt"
    timeout 300 python3 -m tools.bench.gpu.ab_env --repeats 6 base: 'mlx:KVSTORE_CUDA_PRECOMPILED=0' \
      --policies kv:quant:8:64 2>&1 | tee "$out/ab-route-q8.txt" | grep -E "^== |  (base|mlx) +restore" ;;
  faults)
    for precompiled in 1 0; do
      KVSTORE_CUDA_PRECOMPILED=$precompiled timeout 200 $profile \
        --policies kv:quant:8:64,kv:turboquant:4:4 2>&1 | tee "$out/faults-precompiled-$precompiled.txt"
    done ;;
  abroute)
    timeout 560 python3 -m tools.bench.gpu.ab_env --repeats 4 base: 'mlx:KVSTORE_CUDA_PRECOMPILED=0' \
      --policies lossless,kv:quant:8:64,kv:turboquant:4:4 2>&1 | tee "$out/ab-route.txt" ;;
  firstpick)
    for loading in LAZY EAGER; do
      CUDA_MODULE_LOADING=$loading python3 -c "import time; t = time.perf_counter()
import mlx.core as mx; mx.eval(mx.ones(4) @ mx.ones(4))
print('start under $loading: %.2f s' % (time.perf_counter() - t))"
      CUDA_MODULE_LOADING=$loading timeout 250 python3 tools/bench/gpu/shape_probe.py --prefix 4096 \
        --suffixes 7,19,45,100,250 --ops --skip-c > "$out/firstpick-$loading.txt" 2>&1
      grep -E "^(ours|E )" "$out/firstpick-$loading.txt"
    done
    timeout 200 python3 tools/bench/gpu/shape_probe.py --prefix 4096 --suffixes 7,19,45,100,250 \
      --spread 1,2,3,4,6,8,12,16,24,32,48,64,96,128,192,256,384,512 --decode 520 --decode-warm \
      --skip-c > "$out/firstpick-warm.txt" 2>&1
    grep -E "^(ours|spread w|decode|D )" "$out/firstpick-warm.txt" ;;
  *) echo "next.sh: unknown step $step; the steps: $(sed -n 's/^# STEP \([a-z0-9-]*\).*/\1/p' "$0" | tr '\n' ' ')" >&2
     exit 2 ;;
esac
