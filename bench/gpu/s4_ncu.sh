#!/usr/bin/env bash
# Session 4: what limits the expert GEMMs at 8 tokens (DeepSeek-V2-Lite) --
# ncu's speed of light, occupancy, memory workload and warp stall reasons for
# gpuctx's up and down kernels (tiles forced to the tuner's picks) and for the
# Triton peer's fused_moe kernels in the same call.
# Build: bash bench/gpu/pack.sh ./cmd/gpuctx
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SEC="--section SpeedOfLight --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats"
for tile in m16n16k128w1x1s4 m16n64k64w1x4s6; do
  timeout 120 ncu --clock-control none --kernel-name regex:"gpuctx_moe_(up|down)_" --launch-count 2 $SEC \
    .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 8 --mode single --small-batch -1 --tile $tile --iters 1 --warmup 0 --no-graphs > "$OUT/ncu-dsv2-8-$tile.txt" 2>&1
  echo "== $tile rc=$?"
done
timeout 150 ncu --clock-control none --kernel-name regex:"_moe_gemm_kernel" --launch-count 2 $SEC \
  python3 .gpu/peers/triton_fused_moe.py --preset deepseek-v2-lite --tokens 8 --iters 1 --warmup 0 > "$OUT/ncu-peer-dsv2-8.txt" 2>&1
echo "== peer rc=$?"
for f in "$OUT"/ncu-*.txt; do
  echo "#### $f"
  grep -E "^  [a-zA-Z_].*\(|Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Block Limit|Stall|Warp Cycles Per Issued|Issued Warp|No Eligible|One or More|L2 Hit|Mem Busy|Max Bandwidth" "$f" | head -60
done
