#!/usr/bin/env bash
# Final GPU run: moe bench against the Triton fused-MoE peer in the same
# invocation for the three target presets (bench/RESULTS.md), then the
# 5-minute soak (issue 7).
# Build: bash bench/gpu/pack.sh . ./backend/cuda/... ./moe
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
row() { sed -n '/^| tokens/,/^$/p' "$1"; }
P="--peer bench/peers/triton_fused_moe.py"
timeout 120 .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 1,8,64,256,1024,4096 --mode single,dual,fused,auto \
  --small-batch -1 $P --out "$OUT/moe-deepseek-v2-lite.md" --plot "$OUT/moe-deepseek-v2-lite.png" > /dev/null 2> "$OUT/bench.log"
echo "== deepseek-v2-lite rc=$?"; row "$OUT/moe-deepseek-v2-lite.md"
timeout 90 .gpu/gpuctx moe bench --preset qwen3-30b-a3b --tokens 1,8,64,256,1024,4096 --mode single --small-batch -1 $P \
  --out "$OUT/moe-qwen3-30b-a3b.md" > /dev/null 2>> "$OUT/bench.log"
echo "== qwen3-30b-a3b rc=$?"; row "$OUT/moe-qwen3-30b-a3b.md"
timeout 150 .gpu/gpuctx moe bench --preset deepseek-v3 --tokens 1,64,1024 --mode single,dual,fused,auto --small-batch -1 --iters 20 $P \
  --out "$OUT/moe-deepseek-v3.md" > /dev/null 2>> "$OUT/bench.log"
echo "== deepseek-v3 rc=$?"; row "$OUT/moe-deepseek-v3.md"; grep -E "^speed vs peer" "$OUT/bench.log"
(cd moe && GPUCTX_SOAK=5m timeout 360 ../.gpu/moe.test -test.count=1 -test.v -test.timeout 350s -test.run 'TestSoak$') > "$OUT/soak.log" 2>&1
echo "soak rc=$?"; grep -E "soak|--- " "$OUT/soak.log" | head -6
