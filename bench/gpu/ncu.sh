#!/usr/bin/env bash
# ncu.sh: where the floor is lost, as bench/RESULTS.md records it: the duration
# of every gpuctx MoE kernel of a DeepSeek-V2-Lite forward at 1 and 4096 tokens
# (eager, so that each kernel is a launch), then speed of light, occupancy and
# stall reasons of the routed up/down kernels at the same token counts, and of
# the Triton peer's GEMM kernel beside them.
# Build first (here): bash bench/gpu/pack.sh ./cmd/gpuctx
# Environment: PRESET (deepseek-v2-lite), TOKENS ("1 4096").
# FP8=1 (pack ./moe/internal/moekernels too): also the w8a16 tiles at
# DeepSeek-V2-Lite 8 and 64 tokens (BenchmarkFP8Expert): speed of light,
# occupancy and warp state of the plain and the transposed m16n128w8s3 up tile
# at 8 tokens, and the per-SASS source counters of the transposed one at 64
# tokens as CSV ($OUT/fp8-sass.csv.gz; bench/RESULTS.md, session 11, calls 2
# and 4, reads its instruction mix).
# W8A8=1 (pack ./moe/internal/moekernels too): also the FP8 w8a8 persistent
# tiles at DeepSeek-V2-Lite 4096 tokens (BenchmarkW8A8Expert): the stall
# reasons per issued instruction, and the source counters per SASS
# instruction as CSV ($OUT/w8a8-sass.csv.gz; bench/RESULTS.md, session 10,
# call 6, reads it by SASS range: epilogue, wgmma + DEPBAR, scaling, waits).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
P=${PRESET:-deepseek-v2-lite}
SEC="--section SpeedOfLight --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis --section WarpStateStats"
for T in ${TOKENS:-1 4096}; do
  timeout 150 ncu --clock-control none --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed \
    -k regex:gpuctx_moe -c 24 .gpu/gpuctx moe bench --preset "$P" --tokens "$T" --mode single,fused --no-graphs --iters 2 --warmup 1 --sets 1 \
    > "$OUT/ncu-stages-$P-$T.txt" 2>&1
  echo "== stages T=$T rc=$?"
  grep -E "^  gpuctx_moe|gpu__time_duration|dram__throughput|sm__throughput" "$OUT/ncu-stages-$P-$T.txt" | head -60
  timeout 150 ncu --clock-control none --kernel-name regex:"gpuctx_moe_(up|down)_" --launch-count 4 $SEC \
    .gpu/gpuctx moe bench --preset "$P" --tokens "$T" --mode single --no-graphs --iters 1 --warmup 1 --sets 1 > "$OUT/ncu-experts-$P-$T.txt" 2>&1
  echo "== experts T=$T rc=$?"
  timeout 150 ncu --clock-control none --kernel-name regex:"_moe_gemm_kernel" --launch-count 2 $SEC \
    python3 .gpu/peers/triton_fused_moe.py --preset "$P" --tokens "$T" --iters 1 --warmup 0 --sets 1 > "$OUT/ncu-peer-$P-$T.txt" 2>&1
  echo "== peer T=$T rc=$?"
done
for f in "$OUT"/ncu-experts-*.txt "$OUT"/ncu-peer-*.txt; do
  echo "#### $f"
  grep -E "^  [a-zA-Z_].*\(|Duration|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|L2 Hit" "$f" | head -40
done
if [ -n "${FP8:-}" ]; then
  B=(-test.run '^$' -test.benchtime 1x)
  (cd moe/internal/moekernels &&
    for k in gpuctx_moe_fp8_up_m16n128w8s3 gpuctx_moe_fp8_up_m16n128w8s3t; do
      timeout 100 ncu --clock-control none --section SpeedOfLight --section Occupancy --section WarpStateStats -k regex:"$k\$" -c 1 \
        ../../../.gpu/moe_internal_moekernels.test "${B[@]}" -test.bench 'FP8Expert/deepseek-v2-lite/T=8$' > "$OUT/ncu-$k.txt" 2>&1
      echo "== $k T=8 rc=$?"
      grep -E "Duration|DRAM Throughput|Compute \(SM\)|Registers Per|Achieved Occupancy|Warp Cycles Per Issued" "$OUT/ncu-$k.txt"
    done
    timeout 120 ncu --clock-control none --section SourceCounters --section WarpStateStats --import-source no -k regex:'gpuctx_moe_fp8_up_m16n128w8s3t$' -c 1 -o /tmp/fp8t \
      ../../../.gpu/moe_internal_moekernels.test "${B[@]}" -test.bench 'FP8Expert/deepseek-v2-lite/T=64$' > /dev/null 2>&1
    echo "== fp8 source counters rc=$?")
  ncu -i /tmp/fp8t.ncu-rep --page source --print-source sass --csv 2>/dev/null | gzip > "$OUT/fp8-sass.csv.gz"
fi
if [ -n "${W8A8:-}" ]; then
  K=gpuctx_moe_w8a8_up_m128n64s6p2\|gpuctx_moe_w8a8_down_m128n128s6p2
  B=(-test.run '^$' -test.bench 'W8A8Expert/deepseek-v2-lite/T=4096$' -test.benchtime 1x)
  (cd moe/internal/moekernels &&
    timeout 150 ncu --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio,gpu__time_duration.sum \
      -k regex:"$K" -c 2 ../../../.gpu/moe_internal_moekernels.test "${B[@]}" > "$OUT/ncu-w8a8-stalls.txt" 2>&1
    echo "== w8a8 stalls rc=$?"
    timeout 150 ncu --section SourceCounters --section WarpStateStats --import-source no -k regex:"$K" -c 2 -o /tmp/w8a8 \
      ../../../.gpu/moe_internal_moekernels.test "${B[@]}" > /dev/null 2>&1
    echo "== w8a8 source counters rc=$?")
  ncu -i /tmp/w8a8.ncu-rep --page source --print-source sass --csv 2>/dev/null | gzip > "$OUT/w8a8-sass.csv.gz"
  grep -E "gpuctx_moe_w8a8|duration|stalled" "$OUT/ncu-w8a8-stalls.txt" | head -40
fi
