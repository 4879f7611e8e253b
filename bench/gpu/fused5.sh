#!/usr/bin/env bash
# Fifth run: Auto measured per bucket, route_align bounded, s3 tiles. CUDA moe
# tests, deepseek-v2-lite against the Triton peer with every mode, a 30-second
# soak, and compute-sanitizer memcheck over the fused-path tests.
# Build: bash bench/gpu/pack.sh ./moe/...
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
(cd moe && timeout 120 ../.gpu/moe.test -test.count=1 -test.v -test.timeout 110s \
  -test.run 'TestLayerAutoMeasured/cuda|TestLayerDirectGraphs/cuda|TestLayerFusedShared/cuda|TestLayer(Fixtures|DualBitwise|GraphReplay)/cuda') > "$OUT/moe-tests.log" 2>&1
echo "moe tests rc=$?"; grep -cE -- '--- PASS' "$OUT/moe-tests.log"; grep -E -- '--- FAIL|panic' "$OUT/moe-tests.log" | head -20
row() { sed -n '/^| tokens/,/^$/p' "$1"; }
timeout 150 .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 1,8,64,256,1024,4096 --mode single,dual,fused,auto \
  --small-batch -1 --peer bench/peers/triton_fused_moe.py --out "$OUT/v2.md" > /dev/null 2> "$OUT/bench-v2.log"
echo "== deepseek-v2-lite rc=$?"; row "$OUT/v2.md"; grep -E "auto runs" "$OUT/v2.md" | cut -c1-160; tail -1 "$OUT/bench-v2.log"
(cd moe && GPUCTX_SOAK=30s timeout 90 ../.gpu/moe.test -test.count=1 -test.v -test.run 'TestSoak$') > "$OUT/soak.log" 2>&1
echo "soak rc=$?"; grep -E "soak|--- " "$OUT/soak.log" | head -5
(cd moe && timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 ../.gpu/moe.test -test.count=1 \
  -test.run 'TestLayerFusedTiles/cuda|TestLayerFusedShared/cuda/deepseek-v2-lite') > "$OUT/memcheck-moe.log" 2>&1
echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|^ok|^FAIL|^PASS" "$OUT/memcheck-moe.log" | head -5
