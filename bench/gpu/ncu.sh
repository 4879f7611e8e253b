#!/usr/bin/env bash
# ncu.sh: where the floor is lost, as bench/RESULTS.md records it: the duration
# of every gpuctx MoE kernel of a DeepSeek-V2-Lite forward at 1 and 4096 tokens
# (eager, so that each kernel is a launch), then speed of light, occupancy and
# stall reasons of the routed up/down kernels at the same token counts, and of
# the Triton peer's GEMM kernel beside them.
# Build first (here): bash bench/gpu/pack.sh ./cmd/gpuctx
# Environment: PRESET (deepseek-v2-lite), TOKENS ("1 4096").
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
