#!/usr/bin/env bash
# Verification of a merged tree in one call of about a minute (run on the H200
# on 2026-12-01 through s3_verify.sh; bench/RESULTS.md): every CUDA test
# binary, racecheck on one fused tile, moe run -v on a DeepSeek-V2-Lite-sized
# layer (moe init) with a cold then warm kernel cache, and a dual-stream trace
# rendered as a PNG timeline. SOAK=1 runs only
# the 5-minute soak instead (a call of its own).
# Build: bash bench/gpu/pack.sh . ./backend/cuda/... ./moe ./cmd/gpuctx
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -n "${SOAK:-}" ]; then
  (cd moe && GPUCTX_SOAK=5m timeout 360 ../.gpu/moe.test -test.count=1 -test.v -test.timeout 350s -test.run 'TestSoak$') > "$OUT/soak.log" 2>&1
  echo "soak rc=$?"; grep -E "soak|phase|--- " "$OUT/soak.log" | head -8
  exit 0
fi
timeout 150 bash .gpu/run.sh > "$OUT/tests-summary.txt" 2>&1; echo "tests rc=$?"; tail -3 "$OUT/tests-summary.txt"
grep -E -- '^\s*--- FAIL' "$OUT/gpu-tests.log" | head -20
(cd moe && timeout 75 compute-sanitizer --tool racecheck --error-exitcode 9 ../.gpu/moe.test -test.count=1 \
  -test.run 'TestLayerFusedTiles/cuda/m16n64k64w1x4s6') > "$OUT/racecheck-moe.log" 2>&1
echo "racecheck rc=$? $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$OUT/racecheck-moe.log" | tail -1)"
# moe run -v on a DeepSeek-V2-Lite-sized layer (1.1 GiB of bf16, written by
# moe init: no Go needed there), cold then warm kernel cache (issue 10's
# target: <= 1.0 s warm).
FIX=/tmp/dsv2
timeout 60 .gpu/gpuctx moe init --preset deepseek-v2-lite --dir $FIX > /dev/null 2>&1 || echo "moe init failed"
export GPUCTX_KERNEL_CACHE=/tmp/kcache
for run in cold warm; do
  echo "== moe run -v, $run kernel cache"
  timeout 60 .gpu/gpuctx moe run --model $FIX --input $FIX/input.safetensors --output /tmp/y.safetensors --dtype bf16 --mode dual -v 2>&1 >/dev/null
done
rm -rf "$GPUCTX_KERNEL_CACHE"
timeout 60 .gpu/gpuctx moe bench --preset deepseek-v2-lite --tokens 64 --mode dual --trace "$OUT/dual.json" --out "$OUT/dual.md" > /dev/null 2>&1
python3 bench/gpu/timeline.py "$OUT/dual.json" "$OUT/timeline.png"
