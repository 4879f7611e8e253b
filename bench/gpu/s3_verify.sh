#!/usr/bin/env bash
# Session 3, call 1: verify the merged tree on the GPU (next_session.sh: every
# CUDA test binary, racecheck on one fused tile, moe run -v cold/warm kernel
# cache, dual trace -> timeline.png), then a no-peer moe bench of the merged
# tree at 64 and 1024 tokens (issue 9: within noise of before), then ncu on the
# fused up/down GEMMs at 4096 tokens with a 4-warp and an 8-warp tile (issue 8:
# why the large tiles are slower).
# Build: bash bench/gpu/pack.sh . ./backend/cuda/... ./moe ./cmd/gpuctx
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
bash bench/gpu/next_session.sh 2>&1 | tee "$OUT/next_session.txt"
echo "== after next_session: $(( $(date +%s) - t0 )) s"
timeout 90 .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 64,1024 --mode single,dual,auto --out "$OUT/bench-merged.md" > "$OUT/bench-merged.txt" 2>&1
echo "bench rc=$?"; grep -E "^\| *(64|1024) " "$OUT/bench-merged.md" | head
echo "== after bench: $(( $(date +%s) - t0 )) s"
NCU="ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section LaunchStats --section ComputeWorkloadAnalysis --section InstructionStats"
for tile in m64n64k64w2x2s4 m128n128k64w2x4s3; do
  timeout 100 $NCU -k regex:'gpuctx_moe_(up|down)' --launch-skip 2 --launch-count 2 \
    .gpu/gpuctx moe bench --tokens 4096 --mode single --small-batch -1 --tile $tile --iters 2 --warmup 1 \
    > "$OUT/ncu-4096-$tile.txt" 2>&1
  echo "== ncu $tile rc=$?"
  grep -E "gpuctx_moe_(up|down)|Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Issue Slots Busy|Shared Memory Configuration|Dynamic Shared" "$OUT/ncu-4096-$tile.txt" | head -40
done
echo "== total $(( $(date +%s) - t0 )) s"
