#!/usr/bin/env bash
# Fused routed path, second run: CUDA tests of the fused path and FusedShared
# mode, then moe bench against the Triton fused-MoE peer in the same
# invocation (--peer) for deepseek-v2-lite and qwen3-30b-a3b.
# Build: bash bench/gpu/pack.sh ./moe/...
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
(cd moe && GPUCTX_FULL_SIZE=deepseek-v2-lite timeout 200 ../.gpu/moe.test -test.count=1 -test.v -test.timeout 190s \
  -test.run 'TestFusedFullSize|TestLayerFusedShared/cuda|TestLayerFusedTiles/cuda|TestLayer(Fixtures|DualBitwise|GraphReplay|RandomPresets)/cuda') > "$OUT/moe-tests.log" 2>&1
echo "moe tests rc=$?"; grep -cE -- '--- PASS' "$OUT/moe-tests.log"; grep -E -- '--- FAIL|panic|T=.*bucket' "$OUT/moe-tests.log" | cut -c1-400 | head -30
row() { sed -n '/^| tokens/,/^$/p' "$1"; }
P="--peer bench/peers/triton_fused_moe.py"
timeout 240 .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 1,8,64,256,1024,4096 --mode single,dual,fused \
  --small-batch -1 $P --out "$OUT/v2.md" --json > "$OUT/v2.json" 2> "$OUT/bench-v2.log"
echo "== deepseek-v2-lite rc=$?"; row "$OUT/v2.md"; grep -E "fused tiles|speedup|vs peer" "$OUT/v2.md" | cut -c1-300 | head -12; tail -2 "$OUT/bench-v2.log"
timeout 200 .gpu/gpuctx moe bench --preset qwen3-30b-a3b --tokens 1,64,1024 --mode single --small-batch -1 $P \
  --out "$OUT/q3.md" > /dev/null 2> "$OUT/bench-q3.log"
echo "== qwen3-30b-a3b rc=$?"; row "$OUT/q3.md"; tail -2 "$OUT/bench-q3.log"
