#!/usr/bin/env bash
# Session 5, third GPU call: persistent tiles with 2 and 4 producer warps
# (their bits against the CPU: TestLayerFusedTiles), DeepSeek-V2-Lite and
# Qwen3-30B-A3B at 1024 and 4096 tokens against the Triton peer (per-tile
# times in the notes), ncu of the p4 kernels, and a diagnostic: phases of
# gpuctx_moe_route_align from a scratch copy with clock stamps
# (moe/zz_ra_phases_test.go, git-excluded, copied into the build worktree).
# Build: bash bench/gpu/pack.sh . ./backend/cuda/... ./moe ./cmd/gpuctx
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
(cd moe && timeout 120 ../.gpu/moe.test -test.count=1 -test.v -test.run 'TestLayerFusedTiles|TestMoEFusedGemm|TestZZRouteAlignPhases') > "$OUT/gpu-tests.log" 2>&1
echo "tests rc=$? pass=$(grep -c -- '--- PASS' "$OUT/gpu-tests.log") fail=$(grep -c -- '--- FAIL' "$OUT/gpu-tests.log")"
grep -E -A3 -- '--- FAIL|panic' "$OUT/gpu-tests.log" | head -20
grep -E -- '--- (PASS|FAIL).*cuda.*p[24] ' "$OUT/gpu-tests.log" | head
grep -E "^zz " "$OUT/gpu-tests.log"
echo "== after tests: $(( $(date +%s) - t0 )) s"
row() { grep -E "^\| +[0-9]" "$1"; }
P="--peer .gpu/peers/triton_fused_moe.py"
timeout 150 .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 1024,4096 --mode single,dual,fused,auto \
  --small-batch -1 $P --out "$OUT/moe-deepseek-v2-lite.md" > /dev/null 2> /tmp/bench.log
echo "== deepseek-v2-lite rc=$? $(( $(date +%s) - t0 )) s"; row "$OUT/moe-deepseek-v2-lite.md"
grep -E "^- note: fused tiles: T=4096" "$OUT/moe-deepseek-v2-lite.md" | tr ',' '\n' | grep -E "g2s|T=4096|auto"
timeout 120 .gpu/gpuctx moe bench --preset qwen3-30b-a3b --tokens 1024,4096 --mode single --small-batch -1 $P \
  --out "$OUT/moe-qwen3-30b-a3b.md" > /dev/null 2>> /tmp/bench.log
echo "== qwen3-30b-a3b rc=$? $(( $(date +%s) - t0 )) s"; row "$OUT/moe-qwen3-30b-a3b.md"
grep -E "^- note: fused tiles: T=4096" "$OUT/moe-qwen3-30b-a3b.md" | tr ',' '\n' | grep -E "g2s|T=4096"
grep -E "^speed vs peer|^peer: [0-9]+ |rror" /tmp/bench.log | head
rm -f "$OUT/triton_moe_anchor.json"
timeout 100 ncu --clock-control none -k regex:'g2s4p4' --launch-count 2 --section SpeedOfLight --section Occupancy --section WarpStateStats \
  .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 4096 --mode single --small-batch -1 --tile m128n128k64g2s4p4 --iters 1 --warmup 1 > /tmp/ncu4k.txt 2>&1
echo "ncu rc=$?"; grep -E "^  [a-zA-Z_].*\(|Duration|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Warp Cycles Per Issued|cycles being stalled" /tmp/ncu4k.txt | head -24
cp /tmp/ncu4k.txt "$OUT/ncu4k.txt"
echo "== total $(( $(date +%s) - t0 )) s"
