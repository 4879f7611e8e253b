#!/usr/bin/env bash
# Fused routed path, fourth run: route+align in one launch for small batches,
# graphs captured on the caller's buffers, more large tiles. CUDA moe tests,
# then moe bench against the Triton peer: deepseek-v2-lite, qwen3-30b-a3b and
# deepseek-v3 (same invocation, --peer).
# Build: bash bench/gpu/pack.sh ./moe/...
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
(cd moe && timeout 150 ../.gpu/moe.test -test.count=1 -test.v -test.timeout 140s \
  -test.run 'TestLayerDirectGraphs/cuda|TestLayerFusedShared/cuda|TestLayerFusedTiles/cuda|TestLayer(Fixtures|DualBitwise|GraphReplay|RandomPresets)/cuda') > "$OUT/moe-tests.log" 2>&1
echo "moe tests rc=$?"; grep -cE -- '--- PASS' "$OUT/moe-tests.log"; grep -E -- '--- FAIL|panic' "$OUT/moe-tests.log" | head -20
row() { sed -n '/^| tokens/,/^$/p' "$1"; }
P="--peer bench/peers/triton_fused_moe.py"
timeout 150 .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 1,8,64,256,1024,4096 --mode single,dual,fused \
  --small-batch -1 $P --out "$OUT/v2.md" --plot "$OUT/v2.png" > /dev/null 2> "$OUT/bench-v2.log"
echo "== deepseek-v2-lite rc=$?"; row "$OUT/v2.md"; tail -1 "$OUT/bench-v2.log"
timeout 120 .gpu/gpuctx moe bench --preset qwen3-30b-a3b --tokens 1,8,64,256,1024,4096 --mode single --small-batch -1 $P \
  --out "$OUT/q3.md" > /dev/null 2> "$OUT/bench-q3.log"
echo "== qwen3-30b-a3b rc=$?"; row "$OUT/q3.md"; tail -1 "$OUT/bench-q3.log"
timeout 250 .gpu/gpuctx moe bench --preset deepseek-v3 --tokens 1,64,1024 --mode single,dual,fused --small-batch -1 --iters 30 $P \
  --out "$OUT/v3.md" > /dev/null 2> "$OUT/bench-v3.log"
echo "== deepseek-v3 rc=$?"; row "$OUT/v3.md"; tail -2 "$OUT/bench-v3.log"
