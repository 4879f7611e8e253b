#!/usr/bin/env bash
# Fused routed path, third run: offsets computed once in the GEMM loads, the
# faster align. CUDA tests (root: the BLAS/graph-workspace changes; moe: fused
# path, tiles, FusedShared), then moe bench against the Triton peer for
# deepseek-v2-lite (fused at every size, and the small-batch kernels at 1-16
# tokens for comparison) and qwen3-30b-a3b.
# Build: bash bench/gpu/pack.sh . ./moe/...
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
[ -z "${NOROOT:-}" ] && (timeout 150 .gpu/root.test -test.count=1 -test.v -test.timeout 140s) > "$OUT/root-tests.log" 2>&1
[ -z "${NOROOT:-}" ] && echo "root tests rc=$?"; grep -cE -- '--- PASS' "$OUT/root-tests.log"; grep -E -- '--- FAIL|panic' "$OUT/root-tests.log" | head -20
(cd moe && GPUCTX_FULL_SIZE=deepseek-v2-lite timeout 200 ../.gpu/moe.test -test.count=1 -test.v -test.timeout 190s \
  -test.run 'TestFusedFullSize|TestLayerFusedShared/cuda|TestLayerFusedTiles/cuda|TestLayer(Fixtures|DualBitwise|GraphReplay|RandomPresets)/cuda') > "$OUT/moe-tests.log" 2>&1
echo "moe tests rc=$?"; grep -cE -- '--- PASS' "$OUT/moe-tests.log"; grep -E -- '--- FAIL|panic' "$OUT/moe-tests.log" | head -20
grep -E 'T=.*bucket' "$OUT/moe-tests.log" | cut -c1-250
row() { sed -n '/^| tokens/,/^$/p' "$1"; }
P="--peer bench/peers/triton_fused_moe.py"
timeout 200 .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 1,8,64,256,1024,4096 --mode single,dual,fused \
  --small-batch -1 $P --out "$OUT/v2.md" --json > "$OUT/v2.json" 2> "$OUT/bench-v2.log"
echo "== deepseek-v2-lite rc=$?"; row "$OUT/v2.md"; tail -1 "$OUT/bench-v2.log"
timeout 60 .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 1,8,16 --mode dual,fused --out "$OUT/v2-small.md" > /dev/null 2>> "$OUT/bench-v2.log"
echo "== deepseek-v2-lite, small-batch kernels up to 16 tokens"; row "$OUT/v2-small.md"
timeout 150 .gpu/gpuctx moe bench --preset qwen3-30b-a3b --tokens 1,8,64,256,1024 --mode single --small-batch -1 $P \
  --out "$OUT/q3.md" > /dev/null 2> "$OUT/bench-q3.log"
echo "== qwen3-30b-a3b rc=$?"; row "$OUT/q3.md"; tail -1 "$OUT/bench-q3.log"
