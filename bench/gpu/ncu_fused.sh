#!/usr/bin/env bash
# ncu on the fused expert kernels (deepseek-v2-lite, bf16): speed of light,
# memory workload, occupancy and warp stalls for the up and down kernels at 1,
# 64 and 4096 tokens, each with the tile the tuner picked there.
# Build: bash bench/gpu/pack.sh ./moe/...
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
NCU="ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section LaunchStats"
for spec in "1 m16n64k128w1x4s4" "64 m16n64k64w1x4s6" "4096 m128n64k64w2x4s3"; do
  set -- $spec
  timeout 150 $NCU -k regex:gpuctx_moe_ --launch-skip 12 --launch-count 4 \
    .gpu/gpuctx moe bench --tokens $1 --mode single --small-batch -1 --tile $2 --iters 3 --warmup 2 \
    > "$OUT/ncu-$1.txt" 2>&1
  echo "== T=$1 tile $2 rc=$?"
  grep -E "gpuctx_moe_(up|down|align)|DRAM Throughput|Memory Throughput|Duration|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit (Shared|Registers)|Compute \(SM\) Throughput|Warp Cycles Per Issued|L2 Hit" "$OUT/ncu-$1.txt" | head -60
done
